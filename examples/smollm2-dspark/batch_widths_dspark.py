# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Batch widths: how many drafts a round of batched generation verifies for its rows.

Remote-code file (imports only torch and transformers). A round drafts one width w for all its rows, row i
committing 1 + Σ_{n≤l_i} a_{i,n} tokens on average for the l_i ≤ w drafts it verifies. The width grows position by
position from the rows' confidences so far, never from the drafts themselves, so sampling stays lossless (as for the
batch-1 schedules of `scheduling_dspark.py`, whose batch forms these are); greedy decoding may cut it back after
seeing the whole block (`finish`). Where the round is verified packed (each row's own tokens, `packing_dspark`), the
hardware schedule then gives each row its own length (`row_lengths`): the DSpark paper's per-row scheduler. Every
width schedule has the interface of `DSparkBatchWidth`, whose hooks do nothing.
"""

from __future__ import annotations

import math

import torch

from .live_profiling_dspark import smoothed
from .scheduling_dspark import DSparkDrafterBackoff, DSparkHardwareAwareSchedule


class DSparkBatchWidth:
    """Fixed width: every draft of the block, for every row. The hooks do nothing here."""

    prices_rounds = False  # True: the width is priced in seconds, and the confidence bias it learns is worth keeping
    packed = False  # True: the batch loop verifies each row's own tokens only, so a row's drafts cost that row alone
    batch_size = 1  # active rows this round, set by the batch loop
    context_length = 0  # cache columns this round, set by the batch loop
    bias = 0.0

    def start(self) -> None:
        self.survivals: list[torch.Tensor] = []  # per admitted position n: (b,) a_{·,n}

    def admit(self, confidences: torch.Tensor) -> bool:
        """Position n's calibrated c_{·,n} (b,) -> True: every row drafts it."""
        self.survivals.append(self._next_survival(confidences))
        return True

    def _next_survival(self, confidences: torch.Tensor) -> torch.Tensor:
        return self.survivals[-1] * confidences if self.survivals else confidences

    def finish(self, num_drafted: int) -> int:
        return num_drafted

    def row_lengths(self, width: int, num_rows: int) -> torch.LongTensor:
        """How many of the round's `width` drafts each row verifies (num_rows,): here every one."""
        return torch.full((num_rows,), width, dtype=torch.long)

    def should_skip(self) -> bool:
        """True: the drafter rests this round (a plain batched step)."""
        return False

    def observe_round(self, counts, accepted, batch_size: int, drafter_ran: bool, draft_s: float, verify_s: float) -> None:
        """After verification: how many drafts each row verified and accepted, whether the drafter ran, the times."""


class DSparkBatchThresholdWidth(DSparkBatchWidth):
    """Widen while some row's survival a_n stays at or above `threshold`."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def admit(self, confidences: torch.Tensor) -> bool:
        survival = self._next_survival(confidences)
        if not bool((survival >= self.threshold).any()):
            return False
        self.survivals.append(survival)
        return True


class DSparkBatchVerifyCostWidth(DSparkBatchThresholdWidth):
    """The verify-cost rule summed over rows: widen while E / C rises, E = Σ_rows (1 + Σ_n a_n), C = 1 + verify_cost·w
    (`verify_cost`: one more verified token per row relative to a whole verify pass)."""

    def __init__(self, verify_cost: float, threshold: float | None = None):
        super().__init__(-math.inf if threshold is None else threshold)
        self.verify_cost = verify_cost

    def start(self) -> None:
        super().start()
        self.expected, self.cost = float(self.batch_size), 1.0

    def admit(self, confidences: torch.Tensor) -> bool:
        if not super().admit(confidences):
            return False
        gained = float(self.survivals[-1].sum())
        if (self.expected + gained) / (self.cost + self.verify_cost) <= self.expected / self.cost:
            self.survivals.pop()
            return False
        self.expected, self.cost = self.expected + gained, self.cost + self.verify_cost
        return True


SMOOTHING = DSparkHardwareAwareSchedule.smoothing  # weight of the newest observation in every live cost


class DSparkBatchRoundCosts:
    """What batched rounds really cost, learned live and shared by the calls of one decoding setting.

    `scale`: seconds per unit of the profile's t(B, w) (a prior profile is unitless), set by the first verify pass
    and then followed (contexts grow, machines drift). `factors[(B, drafted)]`: by how much whole rounds of batch
    size B, plain or drafted, exceed that model (the drafter's time and the loop included). A drafted round of a
    batch size that has only stepped plainly is priced with the drafted / plain ratio of the nearest batch size that
    has done both, so one expensive guess never keeps a batch size from ever drafting."""

    def __init__(self):
        self.scale: float | None = None
        self.factors: dict[tuple[int, bool], float] = {}

    def observe_verify(self, seconds: float, profiled: float) -> None:
        if profiled > 0:
            self.scale = smoothed(self.scale, seconds / profiled, SMOOTHING)

    def observe_round(self, batch_size: int, drafted: bool, seconds: float, modelled: float) -> None:
        key = (batch_size, drafted)
        self.factors[key] = smoothed(self.factors.get(key), seconds / modelled, SMOOTHING)

    def factor(self, batch_size: int, drafted: bool) -> float:
        if (batch_size, drafted) in self.factors:
            return self.factors[batch_size, drafted]
        plain = self.factors.get((batch_size, False), 1.0)
        if not drafted:
            return plain
        both = [b for b, drafted in self.factors if drafted and (b, False) in self.factors]
        if not both:
            return plain
        nearest = min(both, key=lambda b: (abs(math.log(b / batch_size)), b))
        return plain * self.factors[nearest, True] / self.factors[nearest, False]

    def timed_plain_step(self, batch_size: int) -> bool:
        return (batch_size, False) in self.factors


class DSparkBatchHardwareWidth(DSparkBatchWidth):
    """The DSpark paper's batch scheduler: the width w maximising Σ_rows (1 + Σ_{n≤w} a_{i,n}) / cost(B, w), with
    cost(B, w) = t(B, w) + the drafter's time (× `min_gain`) and cost(B, 0) = t(B, 0), a plain batched step (after
    which the drafter rests: back-off, restarted whenever a row leaves). As the batch-1 schedule: the later survivals
    are projected geometrically when sampling, greedy decoding looks at the whole block (`lookahead`), and
    confidences get an online logit bias.

    Rounds are priced by what they cost live (`DSparkBatchRoundCosts`): the profile keeps the shape across widths,
    the live scale its level in seconds, and a factor per batch size and class (plain or drafted) the rest. A batch
    size whose plain step was never timed takes one plain step first. `live` may be shared between calls (the batch
    loop keeps one on the drafter per decoding setting)."""

    prices_rounds = True
    recalibration_rate = DSparkHardwareAwareSchedule.recalibration_rate
    max_bias = DSparkHardwareAwareSchedule.max_bias

    def __init__(self, profile, max_drafts: int, min_gain: float = 1.0, lookahead: bool = False,
                 live: DSparkBatchRoundCosts | None = None):
        self.profile, self.min_gain, self.lookahead = profile, min_gain, lookahead
        self.max_drafts = min(max_drafts, profile.max_drafts)
        self.draft_time_s: dict[int, float] = {}  # the drafter's time per round, by batch size
        self.live = DSparkBatchRoundCosts() if live is None else live
        self.backoff, self.backoff_batch_size = DSparkDrafterBackoff(), None

    def _profiled(self, width: int, batch_size: int | None = None) -> float:
        return (self.live.scale or 1.0) * self.profile.verify_time(batch_size or self.batch_size, width)

    def _modelled(self, width: int, batch_size: int) -> float:
        """A round's seconds as the profile and the drafter's running time say (before the live factor)."""
        if width == 0:
            return self._profiled(0, batch_size)
        return self._profiled(width, batch_size) + self.draft_time_s.get(batch_size, 0.0)

    def cost(self, width: float) -> float:
        """Seconds of a round of `width` drafts per row (0: a plain step; a drafted round also pays the drafter)."""
        if width == 0:
            return self.live.factor(self.batch_size, False) * self._modelled(0, self.batch_size)
        return self._drafted_cost(width)

    def _drafted_cost(self, width: float) -> float:
        modelled = self._profiled(width, self.batch_size) + self.draft_time_s.get(self.batch_size, 0.0)
        return self.live.factor(self.batch_size, True) * modelled * self.min_gain

    def start(self) -> None:
        super().start()
        self._costs = [self.cost(w) for w in range(self.max_drafts + 1)]
        self._expected = [float(self.batch_size)]  # E_w for w = 0, 1, ...
        self._admitted: list[torch.Tensor] = []  # recalibrated c_{·,n} of the admitted positions
        if self.packed:  # a drafted round verifying B, B + 1, ... packed tokens
            rows = self.batch_size
            self._token_costs = [self._token_cost(tokens) for tokens in range(rows, rows * (self.max_drafts + 1) + 1)]

    def admit(self, confidences: torch.Tensor) -> bool:
        n = len(self.survivals) + 1
        if n > self.max_drafts:
            return False
        confidences = torch.sigmoid(torch.logit(confidences.double().clamp(1e-6, 1 - 1e-6)) + self.bias)
        survival = self._next_survival(confidences)
        if self.lookahead:  # draft on while even certain later drafts could beat the best stop so far
            best = max(e / c for e, c in zip(self._expected, self._costs))
            admitted = self._best_from(n, survival, torch.ones_like(survival)) > best
        else:
            admitted = self._best_from(n, survival, confidences) > self._expected[-1] / self._costs[n - 1]
        if admitted:
            self.survivals.append(survival)
            self._admitted.append(confidences)
            self._expected.append(self._expected[-1] + float(survival.sum()))
        return admitted

    def _best_from(self, n: int, survival: torch.Tensor, ratio: torch.Tensor) -> float:
        best, expected, projected = 0.0, self._expected[-1], survival
        for k in range(n, self.max_drafts + 1):
            expected += float(projected.sum())
            best = max(best, expected / self._costs[k])
            projected = projected * ratio
        return best

    def finish(self, num_drafted: int) -> int:
        width = num_drafted
        if self.lookahead:
            width = max(range(num_drafted + 1), key=lambda k: self._expected[k] / self._costs[k])
        self.survivals, self._admitted = self.survivals[:width], self._admitted[:width]
        self.backoff.record(width)
        return width

    def row_lengths(self, width: int, num_rows: int) -> torch.LongTensor:
        """Packed rounds: each row's own length, (row, position) candidates admitted by calibrated survival, most likely
        first, while the round's expected committed tokens per second still rise under the cost of verifying that many
        tokens. Greedy decoding takes the best prefix of all candidates ranked together (verification is exact for any
        proposal); sampling decides position by position, each row's draft n from the rows' survivals up to n only."""
        if not self.packed or width == 0:
            return super().row_lengths(width, num_rows)
        survivals = torch.stack(self.survivals[:width], dim=1).double().cpu()  # (b, w) a_{r,n}
        costs = self._token_costs[: num_rows * width + 1]
        if self.lookahead:
            return self._best_candidates(survivals, costs)
        return self._candidates_in_order(survivals, costs)

    def _token_cost(self, tokens: int) -> float:
        """A drafted round verifying `tokens` packed tokens (the drafter's time included even at none: it has run),
        priced as the profile's rounds of the same number of tokens per row."""
        return self._drafted_cost(tokens / self.batch_size - 1)

    def _best_candidates(self, survivals: torch.Tensor, costs: list[float]) -> torch.LongTensor:
        rows, width = survivals.shape
        order = torch.argsort(-survivals.flatten(), stable=True)  # ties: a row's earlier position first (a prefix)
        expected = rows + survivals.flatten()[order].cumsum(0)  # E after the top K = 1, 2, ... candidates
        rates = expected / torch.tensor(costs[1:], dtype=expected.dtype)
        best = int(rates.argmax())
        if float(rates[best]) <= rows / self.cost(0):  # no drafts at all pay: a plain step
            return torch.zeros(rows, dtype=torch.long)
        return torch.bincount(order[: best + 1] // width, minlength=rows)

    def _candidates_in_order(self, survivals: torch.Tensor, costs: list[float]) -> torch.LongTensor:
        rows, width = survivals.shape
        lengths, alive, expected, admitted = [0] * rows, [True] * rows, float(rows), 0
        for n in range(width):
            column = survivals[:, n].tolist()
            for row in sorted(range(rows), key=lambda r: -column[r]):
                if alive[row] and (expected + column[row]) * costs[admitted] > expected * costs[admitted + 1]:
                    lengths[row] += 1
                    expected += column[row]
                    admitted += 1
                else:
                    alive[row] = False
        return torch.tensor(lengths, dtype=torch.long)

    def _round_width(self, counts: torch.LongTensor, batch_size: int) -> float:
        """The width a round is priced at: its widest row's drafts, or, packed, its tokens per row less the anchor."""
        if not counts.numel():
            return 0
        return float((counts + 1).sum()) / batch_size - 1 if self.packed else int(counts.max())

    def should_skip(self) -> bool:
        if not self.live.timed_plain_step(self.batch_size):  # time this batch size's plain step first
            return True
        if self.batch_size != self.backoff_batch_size:  # a row left: what pays has changed, so probe again
            self.backoff, self.backoff_batch_size = DSparkDrafterBackoff(), self.batch_size
        return self.backoff.should_skip()

    def observe_round(self, counts, accepted, batch_size: int, drafter_ran: bool, draft_s: float, verify_s: float) -> None:
        width = self._round_width(counts, batch_size)
        if drafter_ran:
            self.draft_time_s[batch_size] = smoothed(self.draft_time_s.get(batch_size), draft_s, SMOOTHING)
        self.live.observe_verify(verify_s, self.profile.verify_time(batch_size, width))
        if width > 0 or not drafter_ran:  # a drafted round, or a plain step (not a round whose drafts were refused)
            self.live.observe_round(batch_size, width > 0, draft_s + verify_s, self._modelled(width, batch_size))
        self._recalibrate(counts, accepted)

    def _recalibrate(self, counts: torch.Tensor, accepted: torch.Tensor) -> None:
        """Every draft verification reached is one outcome of its recalibrated c_n: the batch-1 schedule's SGD step per
        draft on the shared logit bias (a batch of B rows learns as B rounds of one row would)."""
        if not self._admitted:
            return
        predicted = torch.stack(self._admitted, dim=1)  # (b, w)
        n = torch.arange(1, predicted.shape[1] + 1, device=predicted.device)
        counts, accepted = counts.to(predicted.device), accepted.to(predicted.device)
        reached = n[None, :] <= torch.minimum(counts, accepted + 1)[:, None]
        error = ((n[None, :] <= accepted[:, None]).double() - predicted) * reached
        self.bias += self.recalibration_rate * float(error.sum())
        self.bias = min(max(self.bias, -self.max_bias), self.max_bias)


__all__ = ["DSparkBatchHardwareWidth", "DSparkBatchRoundCosts", "DSparkBatchThresholdWidth", "DSparkBatchVerifyCostWidth", "DSparkBatchWidth"]
