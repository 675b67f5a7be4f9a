# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Draft schedules: how many of a block's drafts each row proposes for verification, for one row or many.

Remote-code file (imports only torch and transformers). The drafting loop hands a schedule, position by position,
the rows' calibrated confidences c_{r,n}, which depend on the tokens before n only, so every schedule is lossless
(a schedule may also cut the block back after drafting it, `finish`, which only greedy decoding allows). One
interface serves both drivers (one row is a batch of one): `start`/`admit`/`finish` per block, `row_lengths` (how
many of the drafted positions each row verifies), `should_skip` (the drafter rests this round) and `observe_round`
(what the round did, learned from where the schedule learns). The simple schedules' hooks do nothing.

Reading order: the interface with the fixed, threshold and verify-cost schedules → the hardware-aware schedule (the
DSpark paper's scheduler, priced by a round-cost model of `live_profiling_dspark.py`) → choosing a schedule → the
drafter back-off → prompt-lookup drafts.
"""

from __future__ import annotations

import math

import torch


class DSparkDraftSchedule:
    """Fixed length: every row drafts every position of the block; with a `threshold`, while some row's survival
    a_{r,n} stays at or above it; with a `verify_cost`, while position n raises the expected committed tokens per unit
    of verify cost: with E = Σ_rows (1 + Σ a_{r,i}) over the admitted positions and C = 1 + verify_cost · (positions
    admitted), admit n when (E + Σ_r a_{r,n}) / (C + verify_cost) > E / C (`verify_cost`: one more verified token per
    row relative to a whole verify pass). `survivals[n-1]` holds a_{r,n} = Π_{i≤n} c_{r,i} of each row for the
    positions admitted so far."""

    prices_rounds = False  # True: rounds are priced in seconds (prompt lookup competes; the learned bias is kept)
    packed = False  # True: the round is verified packed, each row's own tokens, so a row's drafts cost that row alone
    batch_size = 1  # rows this round, set by the driver
    context_length = 0  # committed tokens (cache columns) before the block, set by the driver
    bias = 0.0  # online confidence logit bias, carried between generate calls when the schedule learns one
    plain_only = False  # True: this round must be a plain step (the schedule is timing one), no drafts of any kind

    def __init__(self, threshold: float | None = None, verify_cost: float | None = None):
        self.threshold = -math.inf if threshold is None else threshold
        self.verify_cost = verify_cost

    def start(self) -> None:
        """Called once at the start of each block."""
        self.survivals: list[list[float]] = []
        self.expected, self.cost = float(self.batch_size), 1.0

    def admit(self, confidences: torch.Tensor) -> bool:
        """Position n's calibrated c_{·,n} (rows,) -> True: the rows draft position n; False: the block ends."""
        survival = self._next_survival(confidences.double().tolist())
        if max(survival) < self.threshold:
            return False
        if self.verify_cost is not None:
            gained = sum(survival)
            if (self.expected + gained) / (self.cost + self.verify_cost) <= self.expected / self.cost:
                return False
            self.expected, self.cost = self.expected + gained, self.cost + self.verify_cost
        self.survivals.append(survival)
        return True

    def _next_survival(self, confidences: list[float]) -> list[float]:
        return [a * c for a, c in zip(self.survivals[-1], confidences)] if self.survivals else confidences

    def finish(self, num_drafted: int) -> int:
        """After the block: how many of its positions to propose (all; a lookahead schedule may cut back)."""
        return num_drafted

    def row_lengths(self, width: int, num_rows: int) -> torch.LongTensor:
        """How many of the round's `width` drafts each row verifies (num_rows,): here every one."""
        return torch.full((num_rows,), width, dtype=torch.long)

    def should_skip(self) -> bool:
        """True: the drafter rests this round (a plain step)."""
        return False

    def price_of(self, counts: torch.Tensor, drafter_ran: bool) -> float | None:
        """The seconds a round that verified `counts` drafts per row costs as the schedule prices it (before
        `observe_round` learns from it), or None for a schedule that prices nothing."""
        return None

    def observe_round(self, counts: torch.Tensor, accepted: torch.Tensor, drafter_ran: bool, draft_s: float | None,
                      verify_s: float, own: torch.Tensor | None = None) -> tuple[float, int, int] | None:
        """After verification: the drafts each row verified and accepted (rows,), whether the drafter ran, its time
        (None: no measure of a round) and the verify time. Returns (Σ predicted c, accepted, reached) over the drafts
        verification reached where the schedule learns from them: the drafter's own, not prompt lookup's (`own`
        (rows,) bool: the rows whose drafts the drafter drafted; None: every row)."""
        return None


class DSparkHardwareAwareSchedule(DSparkDraftSchedule):
    """The DSpark paper's scheduler (docs/drafting.md): the w maximising expected committed tokens per second,
    E_w / cost(w), E_w = Σ_rows (1 + Σ_{n≤w} a_{r,n}), cost(w) a round-cost model's price of w drafts per row (the
    drafter's time included, × `min_gain`; cost(0) is a plain step, after which the drafter rests: back-off).

    Lossless: position n is admitted from c_{·,1..n} alone, iff the best rate over every w ≥ n, later survivals
    projected geometrically from c_n, beats stopping at n-1. Greedy decoding (`lookahead`) may look at the whole block
    and propose the best w after it (`finish`): verification commits the target's argmax whatever is proposed.
    Verified packed, each row gets its own length (`row_lengths`). Until the costs can rank w (`costs.noisy`), the
    threshold rule (a_n ≥ `fallback_threshold`). The confidences get a logit bias learned online from finished rounds
    (every draft verification reached is one Bernoulli outcome of its recalibrated c).
    """

    prices_rounds = True
    max_backoff = 16
    fallback_threshold = 0.5
    recalibration_rate = 0.1  # SGD step of the online logit bias per verified draft
    max_bias = 4.0  # |bias| bound: a run of misses can lower confidences, never pin them at 0 or 1

    def __init__(self, costs, max_drafts: int | None = None, min_gain: float = 1.0, lookahead: bool = False):
        self.costs, self.min_gain, self.lookahead = costs, min_gain, lookahead
        self.max_drafts = costs.max_drafts if max_drafts is None else min(max_drafts, costs.max_drafts)
        self.backoff, self._backoff_rows = DSparkDrafterBackoff(self.max_backoff), None
        self.start()

    def priced(self, width: float, with_drafter: bool = True) -> float:
        """Seconds a round of `width` drafts per row is charged: a round with drafts, or with the drafter's time,
        counts `min_gain` times over."""
        seconds = self.costs.round_cost(width, self.batch_size, self.context_length, with_drafter)
        return self.min_gain * seconds if width or with_drafter else seconds

    def start(self) -> None:
        self.survivals = []
        self._costs = [self.priced(0, False)] + [self.priced(w) for w in range(1, self.max_drafts + 1)]
        self._expected = [float(self.batch_size)]  # E_w for w = 0, 1, ...
        self._admitted: list[list[float]] = []  # recalibrated c_{·,n} of the admitted positions
        if self.packed:  # a drafted round verifying B, B + 1, ... packed tokens, priced per token; the drafter has run
            rows = self.batch_size  # by the time the rows are cut (`row_lengths`), so even no drafts pays its time
            self._token_costs = [self.priced(t / rows - 1) for t in range(rows, rows * (self.max_drafts + 1) + 1)]

    def _recalibrated(self, confidence: float) -> float:
        confidence = min(max(confidence, 1e-6), 1 - 1e-6)
        return 1.0 / (1.0 + math.exp(-(math.log(confidence / (1 - confidence)) + self.bias)))

    def admit(self, confidences: torch.Tensor) -> bool:
        n = len(self.survivals) + 1
        if n > self.max_drafts:
            return False
        confidences = [self._recalibrated(c) for c in confidences.double().tolist()]
        survival = self._next_survival(confidences)
        if self.costs.noisy(self.batch_size):
            admitted = max(survival) >= self.fallback_threshold
        elif self.lookahead:  # draft on while even certain later drafts could beat the best stop so far
            best = max(e / c for e, c in zip(self._expected, self._costs))
            admitted = self._best_from(n, survival, [1.0] * len(survival)) > best
        else:
            admitted = self._best_from(n, survival, confidences) > self._expected[-1] / self._costs[n - 1]
        if admitted:
            self.survivals.append(survival)
            self._admitted.append(confidences)
            self._expected.append(self._expected[-1] + sum(survival))
        return admitted

    def _best_from(self, n: int, survival: list[float], ratios: list[float]) -> float:
        best, expected, projected = 0.0, self._expected[-1], survival
        for w in range(n, self.max_drafts + 1):
            expected += sum(projected)
            best = max(best, expected / self._costs[w])
            projected = [a * r for a, r in zip(projected, ratios)]
        return best

    def finish(self, num_drafted: int) -> int:
        width = num_drafted
        if self.lookahead and not self.costs.noisy(self.batch_size):
            width = max(range(num_drafted + 1), key=lambda w: self._expected[w] / self._costs[w])
        self.survivals, self._admitted = self.survivals[:width], self._admitted[:width]
        self.backoff.record(width)
        return width

    def best_plan(self, survivals: list[float], drafter_ran: bool, counts: list[int] | None = None,
                  row: int = 0) -> tuple[int, float]:
        """(k, the round's expected tokens per second) of the best stop for row `row`'s drafts with survivals a_1, a_2,
        ... (prompt lookup's or the drafter's), the other rows verifying `counts` (None: one row); every row commits a
        token, and the round costs its width (none: a plain step), the drafter's time counted when it ran."""
        counts, best, expected = [0] if counts is None else list(counts), (0, 0.0), float(self.batch_size)
        for k in range(min(len(survivals), self.max_drafts) + 1):
            expected, counts[row] = expected + (survivals[k - 1] if k else 0.0), k
            width = self._round_width(counts)
            if (rate := expected / self.priced(width, drafter_ran and width > 0)) > best[1]:
                best = (k, rate)
        return best

    def row_lengths(self, width: int, num_rows: int) -> torch.LongTensor:
        """Packed rounds: each row's own length. Greedy decoding takes the best prefix of all (row, position)
        candidates ranked together (verification is exact for any proposal); sampling decides position by position,
        each row's draft n from the rows' survivals up to n only."""
        if not self.packed or width == 0:
            return super().row_lengths(width, num_rows)
        survivals = torch.tensor(self.survivals[:width], dtype=torch.float64).T  # (rows, w) a_{r,n}
        costs = self._token_costs[: num_rows * width + 1]
        if self.lookahead:
            return self._best_candidates(survivals, costs)
        return self._candidates_in_order(survivals, costs)

    def _best_candidates(self, survivals: torch.Tensor, costs: list[float]) -> torch.LongTensor:
        rows, width = survivals.shape
        order = torch.argsort(-survivals.flatten(), stable=True)  # ties: a row's earlier position first (a prefix)
        expected = rows + survivals.flatten()[order].cumsum(0)  # E after the top K = 1, 2, ... candidates
        rates = expected / torch.tensor(costs[1:], dtype=expected.dtype)
        best = int(rates.argmax())
        if float(rates[best]) <= rows / costs[0]:  # no drafts pay even with the drafter run: verify none
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

    def should_skip(self) -> bool:
        self.plain_only = self.costs.needs_plain_step(self.batch_size)  # time this batch size's plain step first
        if self.plain_only:
            return True
        if not (self._backoff_rows or 0) / 2 < self.batch_size <= (self._backoff_rows or 0):
            # a new batch, or half its rows gone (one row leaving changes little): what pays has changed, probe again
            self.backoff, self._backoff_rows = DSparkDrafterBackoff(self.max_backoff), self.batch_size
        return self.backoff.should_skip()

    def price_of(self, counts, drafter_ran):
        """A drafted round or a plain step (not a round whose drafts were all refused, which the schedule never
        chooses to run)."""
        width = self._round_width(counts.tolist())
        if drafter_ran and not width:
            return None
        return self.costs.round_cost(width, self.batch_size, self.context_length, drafter_ran)

    def observe_round(self, counts, accepted, drafter_ran, draft_s, verify_s, own=None):
        counts, accepted = counts.tolist(), accepted.tolist()
        if drafter_ran and draft_s is not None:
            self.costs.observe_drafter(self.batch_size, draft_s)
        self.costs.observe(self._round_width(counts), self.context_length, verify_s, self.batch_size)
        own = [True] * len(counts) if own is None else own.tolist()
        return self._recalibrate(counts, accepted, own) if drafter_ran and any(own) else None

    def _round_width(self, counts: list[int]) -> float:
        """The width a round is priced at: its widest row's drafts, or, packed, its tokens per row less the anchor."""
        return 0 if not counts else sum(c + 1 for c in counts) / len(counts) - 1 if self.packed else max(counts)

    def _recalibrate(self, counts: list[int], accepted: list[int], own: list[bool]) -> tuple[float, int, int] | None:
        """Every draft of the drafter's that verification reached is one outcome of its recalibrated c: one SGD step
        each on the shared logit bias (a batch of B rows learns as B rounds of one row would)."""
        if not self._admitted:
            return None
        error = predicted = 0.0
        observed = verified = 0
        for row, (count, taken, mine) in enumerate(zip(counts, accepted, own)):
            for n in range(1, (min(count, taken + 1, len(self._admitted)) if mine else 0) + 1):
                c = self._admitted[n - 1][row]
                error += float(n <= taken) - c
                predicted, observed, verified = predicted + c, observed + (n <= taken), verified + 1
        self.bias = min(max(self.bias + self.recalibration_rate * error, -self.max_bias), self.max_bias)
        return predicted, observed, verified


def make_schedule(settings, do_sample: bool, costs) -> DSparkDraftSchedule:
    """The schedule the drafting settings ask for: threshold / verify cost when set; else the hardware-aware schedule,
    priced by `costs()` (a round-cost model, built only here); else fixed length (`DSparkDraftSchedule`)."""
    if not settings.hardware:
        return DSparkDraftSchedule(settings.confidence_threshold, settings.verify_cost)
    # greedy verification is exact for any proposal, so the schedule may choose the length after seeing the block
    return DSparkHardwareAwareSchedule(costs(), settings.num_drafts, settings.min_gain, settings.lookahead and not do_sample)


class DSparkDrafterBackoff:
    """Skips the drafter after rounds that drafted nothing, for 1, 2, 4, ... up to `max_skip` rounds, each skip
    followed by one probe round; a probe that drafts resets it. When drafting does not pay, the drafter's own cost
    then vanishes too (a round with a drafter pass and no drafts costs more than a plain step)."""

    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip
        self.skip_next = 0  # rounds to skip before the next probe
        self.remaining = 0

    def should_skip(self) -> bool:
        skip, self.remaining = self.remaining > 0, max(self.remaining - 1, 0)
        return skip

    def record(self, num_drafts: int):
        """After a round in which the drafter ran and the schedule chose `num_drafts`."""
        self.skip_next = 0 if num_drafts else min(max(1, 2 * self.skip_next), self.max_skip)
        self.remaining = self.skip_next


class DSparkPromptLookup:
    """Drafts copied from the context (prompt lookup), for one row or each row of a batch: the tokens that followed
    the latest earlier occurrence of the row's last n-gram, the longest of `max_ngram`..1 that occurs. Free to draft,
    and often right exactly where the drafter is unsure: code restating its signature, a long chat quoting itself, a
    model repeating a phrase. The hardware schedule prices them like the drafter's own, from survivals ℓ^n, where ℓ,
    the chance a lookup draft is accepted once the ones before it were, is learned online per n-gram size: a Beta mean
    whose prior, worth `prior_weight` drafts, is n / (n + 3) (a longer match is a better bet: 1-grams start at 1 in
    4, 3-grams at 1 in 2), so where verifying is dear (fp32 on a CPU) only long matches are tried until lookup has
    proven itself. When sampling, their q is one-hot, so speculative sampling accepts a lookup draft x with
    probability p(x): still lossless."""

    prior_weight = 4.0

    def __init__(self, max_ngram: int, max_tokens: int, do_sample: bool = False):
        self.max_ngram, self.max_tokens, self.do_sample = max_ngram, max_tokens, do_sample
        self.counts = {  # n-gram size -> [accepted, reached]
            n: [self.prior_weight * n / (n + 3), self.prior_weight] for n in range(1, max_ngram + 1)
        }

    def propose(self, sequence: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, int]:
        """(up to `budget` drafts (k,) after the row's tokens `sequence` (L,), the n-gram size matched); no drafts and
        size 0 when nothing matches."""
        for n in range(min(self.max_ngram, sequence.shape[0] - 1), 0, -1):
            earlier = sequence.unfold(0, n, 1)[:-1]  # every n-gram but the suffix itself
            hits = (earlier == sequence[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return sequence[start : start + min(budget, self.max_tokens)], n
        return sequence[:0], 0

    def may_pay(self, schedule, budget: int, num_rows: int, drafter_ran: bool) -> bool:
        """False where `choose` gives no row drafts, known before any row is looked up (which costs a batch about 2 %
        of a plain step): a plain step, or a rested drafter's round where even the best-proven n-gram size's drafts
        over the whole `budget` promise no more tokens per second than the plain step."""
        if schedule.plain_only or drafter_ran:
            return not schedule.plain_only
        rate = max(accepted / reached for accepted, reached in self.counts.values())
        return schedule.best_plan([rate**n for n in range(1, min(budget, self.max_tokens) + 1)], False, [0] * num_rows)[0] > 0

    def choose(self, schedule, sequence: torch.LongTensor, budget: int, own: list[float], drafter_ran: bool,
               counts: list[int] | None = None, row: int = 0) -> tuple[torch.LongTensor, int]:
        """The row's lookup drafts and n-gram size where its round promises more tokens per second with them than with
        its drafter's drafts (survivals `own`), the other rows verifying `counts` (None: one row), both priced by the
        schedule, the drafter's time counted when it ran, whoever drafts; else no drafts and size 0."""
        tokens, ngram = self.propose(sequence, budget) if not schedule.plain_only else (sequence[:0], 0)
        if not ngram:
            return tokens, 0
        k, rate = schedule.best_plan(self.survivals(ngram, tokens.shape[0]), drafter_ran, counts, row)
        if k == 0 or rate <= schedule.best_plan(own, drafter_ran, counts, row)[1]:
            return tokens[:0], 0
        return tokens[:k], ngram

    def drafter_survivals(self, schedule, row: int, num_drafted: int, budget: int) -> list[float]:
        """The drafter's survivals a_1, a_2, ... of `row` that the choice against lookup may read. Greedy: every
        draft's. When sampling, only a_1 = c_1 (projected as a_1^n), which no draft decides: c_{n+1} reads x_n, so
        keeping the drafter's block by its later survivals would keep x_n by its own value, and x_n would no longer
        be a draw from q (speculative sampling would then drift from the target's distribution)."""
        survivals = [a[row] for a in schedule.survivals[:num_drafted]]
        if not self.do_sample or not survivals:
            return survivals
        return [survivals[0] ** n for n in range(1, budget + 1)]

    def survivals(self, ngram: int, num_drafts: int) -> list[float]:
        accepted, reached = self.counts[ngram]
        return [(accepted / reached) ** n for n in range(1, num_drafts + 1)]

    def observe(self, ngram: int, num_drafted: int, num_accepted: int):
        """Each draft verification reached is one outcome: accepted, or the one rejected."""
        self.counts[ngram][0] += num_accepted
        self.counts[ngram][1] += min(num_drafted, num_accepted + 1)


def make_prompt_lookup(settings, schedule: DSparkDraftSchedule, do_sample: bool, learned: dict,
                       key: tuple) -> DSparkPromptLookup | None:
    """Prompt-lookup drafts (`dspark_lookup_ngram_size`) where the schedule prices rounds (lookup competes with the
    drafter on price); they go on from what earlier calls of the same decoding settings (`key`) learned (`learned`,
    the drafting state's `lookup_counts`)."""
    if not settings.lookup_ngram_size or not schedule.prices_rounds:
        return None
    lookup = DSparkPromptLookup(settings.lookup_ngram_size, settings.num_drafts, do_sample)
    lookup.counts = learned.setdefault(key, lookup.counts)
    return lookup


__all__ = ["DSparkDraftSchedule", "DSparkDrafterBackoff", "DSparkHardwareAwareSchedule", "DSparkPromptLookup",
           "make_prompt_lookup", "make_schedule"]
