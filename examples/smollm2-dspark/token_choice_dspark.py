# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Token choice: each draft is chosen the way the target will judge it, for one row or many alike.

Remote-code file (imports only torch and transformers). The drafting loop (`DSparkDraftModel.draft`) hands the
chooser each position's Markov-corrected logits (rows, V_d); the chooser returns the drafts and, when sampling, the q
they were drawn from, which speculative sampling needs exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Warpers that read nothing but the scores' probabilities: on the draft vocabulary they keep and rescale exactly the
# tokens they would keep among the same logits scattered to the target vocabulary (-inf elsewhere has probability 0),
# and on a batch they treat every row alike, whatever ids it holds.
VOCAB_AGNOSTIC_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def sampling_warpers(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    """The warpers of plain sampling settings (for `draft_block` called outside generate)."""
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One draw per row from probs (rows, V) by the inverse CDF in float64: one uniform number per row, where
    `torch.multinomial` draws V exponentials (0.35 ms for V = 16k on one CPU core, ~10x this). Zero-probability ids
    are never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).reshape(-1)


class DSparkTokenChooser:
    """Chooses one draft per row from its Markov-corrected logits (rows, V_d).

    Greedy without processors: the argmax over the draft vocabulary. With only probability warpers (temperature,
    top-k, top-p, min-p): warped on the draft vocabulary, V_d wide rather than V_t, every row alike. Processors that
    read ids (repetition penalty, bad words, ...) run where the committed ids are at hand (`sequence`, one row): the
    logits are scattered to the target vocabulary (-inf outside the draft vocab) and processed there, each draft then
    joining the ids they read. A batch leaves them to verification: a draft needs only to be drawn from the q that
    verification is given. Either way the processed scores are that q; `target_scores` gives them on V_t.
    """

    def __init__(
        self,
        draft_to_target: torch.LongTensor,  # (V_d,) target id of each draft id
        vocab_size: int,
        do_sample: bool = False,
        logits_processor: LogitsProcessorList | None = None,
        sequence: torch.LongTensor | None = None,  # (1, t) the committed ids the processors read (one row), or None
        generator: torch.Generator | None = None,
    ):
        self.draft_to_target, self.vocab_size, self.do_sample, self.generator = draft_to_target, vocab_size, do_sample, generator
        processors = list(logits_processor or ())
        if sequence is None:  # a batch: its rows' ids are not at hand here
            processors = [p for p in processors if isinstance(p, VOCAB_AGNOSTIC_WARPERS)]
        self.logits_processor = LogitsProcessorList(processors) if processors else None
        self.on_draft_vocab = all(isinstance(p, VOCAB_AGNOSTIC_WARPERS) for p in processors)
        self.sequence = sequence

    def choose(self, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft logits (rows, V_d) -> target ids (rows,) and the processed scores (rows, V_d or V_t), or None if
        greedy without processors."""
        if not (self.do_sample or self.logits_processor):
            return self.draft_to_target[logits.argmax(dim=-1)], None
        if self.on_draft_vocab:
            scores = self.logits_processor(self._ids(logits), logits) if self.logits_processor else logits
            return self.draft_to_target[self._pick(scores)], scores
        scores = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        scores[:, self.draft_to_target] = logits
        scores = self.logits_processor(self.sequence, scores)
        token = self._pick(scores)
        self.sequence = torch.cat([self.sequence, token.reshape(1, 1)], dim=-1)  # processors read the drafts so far
        return token, scores

    def _ids(self, logits: torch.Tensor) -> torch.LongTensor:
        """What probability-only warpers are handed as ids (they read none of them)."""
        return self.sequence if self.sequence is not None else logits.new_zeros((logits.shape[0], 1), dtype=torch.long)

    def _pick(self, scores: torch.Tensor) -> torch.LongTensor:
        if self.do_sample:
            return sample_from(F.softmax(scores, dim=-1), self.generator)
        return scores.argmax(dim=-1)

    def target_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Stacked scores of `choose` (rows, n, V_d or V_t) on the target vocabulary (rows, n, V_t), -inf outside V_d."""
        if not self.on_draft_vocab:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = scores
        return full


def one_hot_scores(tokens: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """Scores (..., k, V) whose softmax is one-hot at `tokens` (..., k): the q of drafts copied rather than drawn
    (prompt lookup), so speculative sampling accepts such a draft x with probability p(x)."""
    return torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device).scatter_(-1, tokens[..., None], 0.0)


__all__ = ["DSparkTokenChooser", "VOCAB_AGNOSTIC_WARPERS", "one_hot_scores", "sample_from", "sampling_warpers"]
