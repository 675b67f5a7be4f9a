# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Draft schedules: how many of a block's drafts to propose for verification, and the helpers that price rounds.

Remote-code file (imports only torch and transformers). A schedule decides, left to right, whether draft n of a block
is proposed. It sees only the calibrated confidence c_n, which depends on the tokens before n, so every schedule is
lossless (a schedule may also cut the block back after drafting it, `finish`, which only greedy decoding allows: see
DSparkHardwareAwareSchedule). Every schedule has the same interface: `start`/`admit`/`finish` per block, and the
observation hooks the candidate generator calls after each round (no-ops on the simple schedules).

Reading order: the interface and the fixed schedule → threshold → verify cost → the hardware-aware schedule (the
DSpark paper's scheduler at batch 1, priced by the measured verify profile of `profiling_dspark.py`) → the drafter
back-off → prompt-lookup drafts.
"""

from __future__ import annotations

import math

import torch

from .live_profiling_dspark import DSparkLiveVerifyProfile, smoothed


class DSparkDraftSchedule:
    """Base schedule: admits every draft (fixed block length). `survival` is a_n = Π_{i≤n} c_i of the drafts seen.

    The class attributes and hooks below are the whole interface the candidate generator uses: on this schedule and
    the other simple ones the hooks do nothing.
    """

    prices_rounds = False  # True: rounds are priced in seconds, so prompt-lookup drafts can compete with the drafter
    max_backoff = 0  # rounds the drafter may rest after drafting nothing (0: it always runs)
    bias = 0.0  # online confidence logit bias, carried between generate calls when the schedule learns one
    context_length = 0  # committed tokens before the block, set each round

    def start(self) -> None:
        """Called once at the start of each block."""
        self.survival = 1.0

    def admit(self, confidence: float) -> bool:
        """Draft n's calibrated c_n -> True: propose draft n; False: end the block before it."""
        self.survival *= confidence
        return True

    def finish(self, num_drafted: int) -> int:
        """After the block: how many of its drafts to propose (all of them; a lookahead schedule may cut back)."""
        return num_drafted

    def observe_draft_time(self, seconds: float) -> None:
        """The drafter's own time in a round."""

    def observe_verify_time(self, num_drafts: int, context_length: int, seconds: float) -> None:
        """A live verify round of `num_drafts` drafts at this context length."""

    def observe_outcome(self, num_drafted: int, num_accepted: int) -> tuple[float, int, int] | None:
        """After verification: (Σ predicted c_n, accepted, reached) when the schedule learns from it, else None."""
        return None


class DSparkThresholdSchedule(DSparkDraftSchedule):
    """Admit draft n while its survival a_n stays at or above `threshold` (None: no threshold)."""

    def __init__(self, threshold: float | None):
        self.threshold = threshold

    def admit(self, confidence: float) -> bool:
        super().admit(confidence)
        return self.threshold is None or self.survival >= self.threshold


class DSparkVerifyCostSchedule(DSparkThresholdSchedule):
    """Admit draft n only while it raises the expected committed tokens per unit of verify cost.

    With E = 1 + Σ a_i over the admitted drafts (the bonus token counts) and C = 1 + verify_cost · (drafts admitted),
    draft n is admitted when (E + a_n) / (C + verify_cost) > E / C. `verify_cost` is the cost of one more verified
    token relative to a whole verify pass; an optional survival `threshold` is applied first.
    """

    def __init__(self, verify_cost: float, threshold: float | None = None):
        super().__init__(threshold)
        self.verify_cost = verify_cost

    def start(self) -> None:
        super().start()
        self.expected, self.cost = 1.0, 1.0

    def admit(self, confidence: float) -> bool:
        if not super().admit(confidence):
            return False
        if (self.expected + self.survival) / (self.cost + self.verify_cost) <= self.expected / self.cost:
            return False
        self.expected, self.cost = self.expected + self.survival, self.cost + self.verify_cost
        return True


def draft_schedule(confidence_threshold: float | None = None, verify_cost: float | None = None) -> DSparkDraftSchedule:
    """The schedule that the `confidence_threshold` / `verify_cost` settings describe (fixed length if neither)."""
    if verify_cost is not None:
        return DSparkVerifyCostSchedule(verify_cost, confidence_threshold)
    if confidence_threshold is not None:
        return DSparkThresholdSchedule(confidence_threshold)
    return DSparkDraftSchedule()


class DSparkHardwareAwareSchedule(DSparkDraftSchedule):
    """Drafts the k maximising expected committed tokens per second, (1 + Σ_{n≤k} a_n) / (t(k) + draft time).

    Lossless by construction: draft n is admitted from c_1..c_n alone. At draft n the later survivals are projected
    geometrically from the newest conditional confidence, â_m = a_n · c_n^(m-n) (the drafter's confidences are
    strongly correlated along a block, so the last one is the best guess for the next), and draft n is admitted iff
    the best ratio over every k ≥ n beats stopping at n-1. Stopping at 0 is a plain target step, costed t(0) without
    the draft time (the back-off then skips the drafter), so drafting must beat plain decoding, and by `min_gain`: a
    drafted round's cost counts `min_gain` times over, so it must promise that multiple of a plain step's rate (its
    outcome is a gamble on a few probabilities, and a short generation never earns a lost round back; among drafted
    lengths the comparison is unchanged). t(k) comes from the live profile at the current context length: the measured
    shape (or a prior one) times what verify passes of each k really cost here, learned from every round (a shared
    machine drifts, and a CPU prices short rounds unlike its profile); the draft time is a running mean of the
    drafter's own time per round. Until there is anything to rank k by (`profile.noisy`), the schedule falls back to
    the calibrated threshold rule (admit while a_n ≥ `fallback_threshold`).

    Greedy decoding (`lookahead`) lifts the left-to-right restriction: greedy verification commits the target's own
    argmax whatever is proposed, so any k is lossless, and the schedule drafts on while even certain later drafts
    (c = 1) could beat the best stop so far, then proposes the k with the best expected rate given every c_n it saw
    (`finish`). The geometric projection errs both ways (the conditionals usually fall along a block, and a dip is
    often followed by confident drafts); when sampling, choosing k from later drafts would bias which drafts get
    verified, so it stays left to right.

    The confidences were calibrated offline on greedy drafts of the training domains; sampling (a draft survives
    with probability Σ min(p, q), not 1[argmax match]) and unseen domains shift them. So each confidence gets a logit
    bias learned online (Platt scaling by SGD; the candidate generator carries it from one generate call to the next
    of the same decoding settings): every draft that verification reached (all before it accepted) is one Bernoulli
    outcome of its c_n. The bias only uses finished rounds, so it stays lossless.
    """

    prices_rounds = True
    max_backoff = 16
    fallback_threshold = 0.5
    smoothing = 0.2  # weight of the newest observation in the running draft time and verify-speed scale
    recalibration_rate = 0.1  # SGD step of the online logit bias per verified draft
    max_bias = 4.0  # |bias| bound: a run of misses can lower confidences, never pin them at 0 or 1

    def __init__(
        self,
        profile: DSparkLiveVerifyProfile,
        max_drafts: int | None = None,
        draft_time_s: float | None = None,
        min_gain: float = 1.0,
        lookahead: bool = False,
    ):
        self.profile = profile
        self.min_gain = min_gain
        self.lookahead = lookahead
        self.max_drafts = profile.max_drafts if max_drafts is None else min(max_drafts, profile.max_drafts)
        self.draft_time_s = draft_time_s
        self.context_length = profile.context_lengths[0]
        self.bias = 0.0
        self.start()

    def observe_draft_time(self, seconds: float):
        self.draft_time_s = smoothed(self.draft_time_s, seconds, self.smoothing)

    def observe_verify_time(self, num_drafts: int, context_length: int, seconds: float):
        """A live verify round of k drafts: the live profile learns what rounds of k really cost here."""
        self.profile.observe(num_drafts, context_length, seconds)

    def observe_outcome(self, num_drafted: int, num_accepted: int) -> tuple[float, int, int]:
        """After verification of this round's `num_drafted` drafts: nudge the bias toward the outcomes of the drafts
        verification reached. Returns (Σ predicted c_n, accepted, reached) over them, for live calibration stats."""
        reached = self._admitted[: min(num_drafted, num_accepted + 1)]
        for n, predicted in enumerate(reached, start=1):
            self.bias += self.recalibration_rate * (float(n <= num_accepted) - predicted)
        self.bias = min(max(self.bias, -self.max_bias), self.max_bias)
        return sum(reached), min(num_accepted, len(reached)), len(reached)

    def _recalibrated(self, confidence: float) -> float:
        confidence = min(max(confidence, 1e-6), 1 - 1e-6)
        return 1.0 / (1.0 + math.exp(-(math.log(confidence / (1 - confidence)) + self.bias)))

    def round_cost(self, num_drafts: int, draft_s: float) -> float:
        """Seconds a round verifying `num_drafts` drafts is charged: its verify pass plus `draft_s`, times `min_gain`.
        k = 0 is a plain step: with the back-off the drafter then stops running too."""
        verify = self.profile.verify_time(num_drafts, self.context_length)
        return verify if num_drafts == 0 else self.min_gain * (verify + draft_s)

    def start(self):
        self._costs = [self.round_cost(k, self.draft_time_s or 0.0) for k in range(self.max_drafts + 1)]
        self._drafted, self.survival, self._expected = 0, 1.0, 1.0
        self._admitted: list[float] = []  # recalibrated c_n of the drafts admitted this round
        self._ratios = [1.0 / self._costs[0]]  # expected tokens per second of stopping after k = 0, 1, ... drafts

    def admit(self, confidence: float) -> bool:
        n = self._drafted + 1
        if n > self.max_drafts:
            return False
        confidence = self._recalibrated(confidence)
        survival = self.survival * confidence
        if self.profile.noisy:
            admitted = survival >= self.fallback_threshold
        elif self.lookahead:  # draft on while even certain later drafts (c = 1) could beat the best stop so far
            admitted = self._best_ratio_from(n, survival, 1.0) > max(self._ratios)
        else:
            admitted = self._best_ratio_from(n, survival, confidence) > self._expected / self._costs[n - 1]
        if admitted:
            self._drafted, self.survival, self._expected = n, survival, self._expected + survival
            self._admitted.append(confidence)
            self._ratios.append(self._expected / self._costs[n])
        return admitted

    def admitted_survivals(self) -> list[float]:
        """a_1..a_k of the drafts this round proposes (recalibrated)."""
        survivals, survival = [], 1.0
        for confidence in self._admitted:
            survival *= confidence
            survivals.append(survival)
        return survivals

    def best_plan(self, survivals: list[float], drafter_ran: bool) -> tuple[int, float]:
        """(k, expected tokens per second) of the best stop for drafts with these survivals a_1, a_2, ...: the
        rate of a plain step for k = 0; the drafter's time counts when it ran this round, whoever drafted."""
        draft = (self.draft_time_s or 0.0) if drafter_ran else 0.0
        best, expected = (0, 1.0 / self.round_cost(0, draft)), 1.0
        for k, survival in enumerate(survivals[: self.max_drafts], start=1):
            expected += survival
            rate = expected / self.round_cost(k, draft)
            if rate > best[1]:
                best = (k, rate)
        return best

    def finish(self, num_drafted: int) -> int:
        """With lookahead, propose the k ≤ `num_drafted` whose expected rate is best, knowing every c_n drafted."""
        if not self.lookahead or self.profile.noisy:
            return num_drafted
        best = max(range(num_drafted + 1), key=lambda k: self._ratios[k])
        self._drafted, self._admitted = best, self._admitted[:best]
        return best

    def _best_ratio_from(self, n: int, survival: float, confidence: float) -> float:
        best, expected, projected = 0.0, self._expected, survival
        for k in range(n, self.max_drafts + 1):
            expected += projected
            best = max(best, expected / self._costs[k])
            projected *= confidence
        return best


class DSparkDrafterBackoff:
    """Skips the drafter after rounds that drafted nothing, for 1, 2, 4, ... up to `max_skip` rounds, each skip
    followed by one probe round; a probe that drafts resets it. When drafting does not pay, the drafter's own cost
    then vanishes too (a k = 0 round with a drafter pass costs more than a plain step)."""

    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip
        self.skip_next = 0  # rounds to skip before the next probe
        self.remaining = 0

    def should_skip(self) -> bool:
        if self.remaining > 0:
            self.remaining -= 1
            return True
        return False

    def record(self, num_drafts: int):
        """After a round in which the drafter ran and the schedule chose `num_drafts`."""
        self.skip_next = 0 if num_drafts else min(max(1, 2 * self.skip_next), self.max_skip)
        self.remaining = self.skip_next


class DSparkPromptLookup:
    """Drafts copied from the context (prompt lookup): the tokens that followed the latest earlier occurrence of the
    sequence's last n-gram, the longest of `max_ngram`..1 that occurs. Free to draft, and often right exactly where
    the drafter is unsure: code restating its signature, a long chat quoting itself, a model repeating a phrase. The
    hardware schedule prices them like the drafter's own, from survivals ℓ^n, where ℓ, the chance a lookup draft is
    accepted once the ones before it were, is learned online per n-gram size: a Beta mean whose prior, worth
    `prior_weight` drafts, is n / (n + 3) (a longer match is a better bet: 1-grams start at 1 in 4, 3-grams at 1 in 2),
    so where verifying is dear (fp32 on a CPU) only long matches are tried until lookup has proven itself."""

    prior_weight = 4.0

    def __init__(self, max_ngram: int, max_tokens: int):
        self.max_ngram, self.max_tokens = max_ngram, max_tokens
        self.counts = {  # n-gram size -> [accepted, reached]
            n: [self.prior_weight * n / (n + 3), self.prior_weight] for n in range(1, max_ngram + 1)
        }

    def propose(self, input_ids: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, int]:
        """(up to `budget` drafts (k,), the n-gram size matched); no drafts and size 0 when nothing matches."""
        sequence = input_ids[0]
        for n in range(min(self.max_ngram, sequence.shape[0] - 1), 0, -1):
            earlier = sequence.unfold(0, n, 1)[:-1]  # every n-gram but the suffix itself
            hits = (earlier == sequence[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return sequence[start : start + min(budget, self.max_tokens)], n
        return sequence[:0], 0

    def survivals(self, ngram: int, num_drafts: int) -> list[float]:
        accepted, reached = self.counts[ngram]
        return [(accepted / reached) ** n for n in range(1, num_drafts + 1)]

    def observe(self, ngram: int, num_drafted: int, num_accepted: int):
        """Each draft verification reached is one outcome: accepted, or the one rejected."""
        self.counts[ngram][0] += num_accepted
        self.counts[ngram][1] += min(num_drafted, num_accepted + 1)


__all__ = [
    "DSparkDraftSchedule",
    "DSparkDrafterBackoff",
    "DSparkHardwareAwareSchedule",
    "DSparkPromptLookup",
    "DSparkThresholdSchedule",
    "DSparkVerifyCostSchedule",
    "draft_schedule",
]
