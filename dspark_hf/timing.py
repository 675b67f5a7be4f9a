"""One `generate` call timed as `eval` and `bench` compare methods.

Every method runs with the same decoding settings (greedy, or pure T = 1 sampling with no top-k/top-p from the
target's config) and is reseeded per call, so runs compare. The call is timed whole and up to its first new token:
the prefill is the same target forward with or without a drafter, so speed-ups of decoding are measured after it
(long prompts and short answers otherwise dilute them, and at T = 1 answers of different lengths weigh the prefill
differently).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer


class FirstTokenClock(BaseStreamer):
    """Notes when the first new token arrives (the prompt is streamed first): where the prefill ends and decoding
    starts."""

    def __init__(self):
        self.prompt_seen = False
        self.first_token_at: float | None = None

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
        elif self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


@dataclass
class TimedGeneration:
    tokens: torch.Tensor  # the new token ids
    seconds: float  # the whole generate call
    prefill_seconds: float  # until the first new token
    first_tokens: int = 1  # tokens the prefill itself yields (0 where the call is not split at its first token)

    @property
    def decode_tokens(self) -> int:
        """Tokens after the prefill's."""
        return max(self.tokens.numel() - self.first_tokens, 0)

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds


def timed_generation(target, inputs, max_new_tokens: int, do_sample: bool, seed: int = 0, **kwargs) -> TimedGeneration:
    """One `generate` call timed whole and up to its first new token; sampling reseeded per call so runs compare."""
    clock = FirstTokenClock()
    out, start, seconds = _timed_call(target, inputs, max_new_tokens, do_sample, seed, streamer=clock, **kwargs)
    tokens = out[0, inputs["input_ids"].shape[1]:]
    prefill = (clock.first_token_at or start + seconds) - start
    return TimedGeneration(tokens, seconds, min(prefill, seconds))


def timed_generate(target, inputs, max_new_tokens: int, do_sample: bool, seed: int = 0, **kwargs):
    """(new token ids, seconds) of one `generate` call; sampling reseeded per call so runs are comparable."""
    out, _, seconds = _timed_call(target, inputs, max_new_tokens, do_sample, seed, **kwargs)
    return out[0, inputs["input_ids"].shape[1]:], seconds


def timed_batch_generation(target, batch, max_new_tokens: int, do_sample: bool, seed: int = 0, **kwargs) -> TimedGeneration:
    """One `generate` call on a left-padded batch, timed whole (a batch does not stream, so there is no first-token
    split): its tokens are every row's new tokens up to and including its EOS (the call's: none with
    `eos_token_id=None`), end to end."""
    out, _, seconds = _timed_call(target, batch, max_new_tokens, do_sample, seed, **kwargs)
    eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else target.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos])
    rows = []
    for row in out[:, batch["input_ids"].shape[1]:]:
        ends = torch.isin(row, eos).nonzero()
        rows.append(row[: int(ends[0]) + 1] if ends.numel() else row)
    return TimedGeneration(torch.cat(rows), seconds, 0.0, first_tokens=0)


def _timed_call(target, inputs, max_new_tokens: int, do_sample: bool, seed: int, **kwargs):
    """(output ids, start time, seconds) of one `generate` call with the bench's decoding settings: greedy, or
    pure T = 1 sampling (no top-k/top-p from the target's config)."""
    settings = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=target.generation_config.eos_token_id)
    if do_sample:
        settings.update(temperature=1.0, top_k=0, top_p=1.0)
    else:
        settings.update(temperature=None, top_k=None, top_p=None)
    settings.update(kwargs)
    torch.manual_seed(seed)
    synchronize(target.device)
    start = time.perf_counter()
    out = target.generate(**inputs, **settings)
    synchronize(target.device)
    return out, start, time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    """On an accelerator, wait for queued kernels so the clock reads finished work, not launched work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["FirstTokenClock", "TimedGeneration", "synchronize", "timed_generate", "timed_generation"]
