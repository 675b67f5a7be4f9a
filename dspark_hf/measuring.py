"""Measuring the target's verify profiles t(k) and t(B, w) and storing the fastest drafter dtype: the work of
`dspark-hf profile`. Generation never measures (it learns from its own rounds); the profile formats, keys and stores
are the remote code's (`profiling_dspark.py`), which reads what this writes.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from .remote_code.profiling_dspark import (
    BATCH_PROFILE_CONTEXT,
    BATCH_PROFILE_SIZES,
    BATCH_PROFILE_WIDTHS,
    DRAFTER_DTYPE_FORMAT,
    PROFILE_CONTEXT_LENGTHS,
    DSparkBatchVerifyProfile,
    DSparkVerifyProfile,
    batch_profile_key,
    drafter_dtype_path,
    store_json,
    verify_profile_key,
)
from .timing import synchronize

PROFILE_REPEATS = 4  # timed repetitions per (context, k), after one warm-up pass
PROFILE_MAX_SPREAD = 0.25  # a timing whose interquartile spread exceeds this fraction of its median is noise
PROFILE_TYPICAL_SPREAD = 0.10  # ... and a profile whose median spread exceeds this fraction cannot rank k
BATCH_PROFILE_REPEATS = 2


def _is_noisy(times: list[float], spreads: list[float]) -> bool:
    """Too noisy to rank k: one timing's spread wider than PROFILE_MAX_SPREAD of its median, or the typical (median)
    spread wider than PROFILE_TYPICAL_SPREAD. A consistent inversion, t(k+1) < t(k) with tight spreads, is no noise:
    a CPU picks another matmul kernel for 3 rows than for 4 (fp32 on a 2-core EPYC: 3 tokens verify slower than 4),
    and the schedule should know it."""
    relative = sorted(s / t for t, s in zip(times, spreads))
    return relative[-1] > PROFILE_MAX_SPREAD or relative[len(relative) // 2] > PROFILE_TYPICAL_SPREAD


@torch.no_grad()
def _time_verify_passes(target, tokens: torch.Tensor, length: int, counts: list[int], repeats: int) -> list[list[float]]:
    """Seconds of each forward of k+1 tokens after `length` cached ones, `repeats` times per k in `counts`, as a
    verify pass runs (aux hidden states requested, cache cropped back). The k order rotates each repetition so a
    slow moment of a shared machine lands on every k alike; repetition 0 warms up and is dropped."""
    device = target.device
    prefill = target(input_ids=tokens[:, :length], use_cache=True)
    cache = getattr(prefill, "cache", None) or prefill.past_key_values
    samples: list[list[float]] = [[] for _ in counts]
    for repeat in range(repeats + 1):
        shift = repeat % len(counts)
        for i in list(range(len(counts)))[shift:] + list(range(len(counts)))[:shift]:
            k = counts[i]
            synchronize(device)
            start = time.perf_counter()
            target(input_ids=tokens[:, length : length + k + 1], cache=cache, use_cache=True, output_hidden_states=True)
            synchronize(device)
            if repeat:
                samples[i].append(time.perf_counter() - start)
            cache.crop(-(k + 1))
    return samples


def _median_and_spread(samples: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per k: the median timing and the interquartile spread (robust to one outlier in four)."""
    ordered = [sorted(s) for s in samples]
    return [s[(len(s) - 1) // 2] for s in ordered], [s[(3 * len(s) - 1) // 4] - s[len(s) // 4] for s in ordered]


def measure_verify_profile(
    target: PreTrainedModel,
    max_drafts: int,
    context_lengths: tuple[int, ...] = PROFILE_CONTEXT_LENGTHS,
    repeats: int = PROFILE_REPEATS,
) -> DSparkVerifyProfile:
    """t(k) for every k = 0..max_drafts at each context length, on random tokens: the median of `repeats` timings
    and their interquartile spread; marked noisy when the timings cannot rank k (see `_is_noisy`). Every k is timed,
    none interpolated: on CPUs t(k) is not even monotone (small-matrix kernels change with the row count)."""
    started = time.perf_counter()
    text_config = target.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None) or max(context_lengths) + max_drafts + 1
    lengths = sorted({max(1, min(length, limit - max_drafts - 1)) for length in context_lengths})
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, text_config.vocab_size, (1, lengths[-1] + max_drafts + 1), generator=generator)
    tokens = tokens.to(target.device)
    counts = list(range(max_drafts + 1))
    medians, spreads, noisy = [], [], False
    for length in lengths:
        times, spread = _median_and_spread(_time_verify_passes(target, tokens, length, counts, repeats))
        noisy = noisy or _is_noisy(times, spread)
        medians.append(times)
        spreads.append(spread)
    return DSparkVerifyProfile(verify_profile_key(target), lengths, medians, spreads, noisy, time.perf_counter() - started)


def measure_batch_verify_profile(
    target: PreTrainedModel,
    max_drafts: int,
    batch_sizes: tuple[int, ...] = BATCH_PROFILE_SIZES,
    context_length: int = BATCH_PROFILE_CONTEXT,
    repeats: int = BATCH_PROFILE_REPEATS,
) -> DSparkBatchVerifyProfile:
    """t(B, w) at a few widths up to max_drafts and a few batch sizes, on random tokens after `context_length` cached
    ones (a first batched call waits for it: a few seconds on a CPU)."""
    started = time.perf_counter()
    text_config = target.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None) or context_length + max_drafts + 1
    length = max(1, min(context_length, limit - max_drafts - 1))
    generator = torch.Generator().manual_seed(0)
    counts = sorted({min(w, max_drafts) for w in BATCH_PROFILE_WIDTHS} | {max_drafts})
    medians, spreads, noisy = [], [], False
    for size in batch_sizes:
        tokens = torch.randint(0, text_config.vocab_size, (size, length + max_drafts + 1), generator=generator)
        times, spread = _median_and_spread(_time_verify_passes(target, tokens.to(target.device), length, counts, repeats))
        noisy = noisy or _is_noisy(times, spread)
        medians.append(times)
        spreads.append(spread)
    return DSparkBatchVerifyProfile(batch_profile_key(target), list(batch_sizes), counts, length, medians, spreads,
                                    noisy, time.perf_counter() - started)


def store_drafter_dtype(target: PreTrainedModel, dtype: str, tokens_per_s: dict[str, float]) -> str:
    """Record the drafter dtype measured fastest with this target here (`dspark-hf profile --drafter`)."""
    path = drafter_dtype_path(target)
    record = {"format": DRAFTER_DTYPE_FORMAT, "key": verify_profile_key(target), "drafter_dtype": dtype,
              "tokens_per_s": tokens_per_s}
    store_json(record, path, "the drafter dtype")
    return path


__all__ = ["measure_batch_verify_profile", "measure_verify_profile", "store_drafter_dtype"]
