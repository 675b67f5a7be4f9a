# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""What rounds cost, learned live from the verify passes generation runs anyway, so no call waits for a measurement.

Remote-code file (imports only torch and transformers). The hardware-aware schedule (`scheduling_dspark.py`) prices
rounds by a round-cost model, one interface (`max_drafts`, `noisy`, `needs_plain_step`, `round_cost`, `observe`) with
a model per driver: `DSparkRowCosts` for one row, whose t(k) is `DSparkLiveVerifyProfile` (a shape from the measured
profile of `profiling_dspark.py` where `dspark-hf profile` stored one, else the prior, times what passes of each k
really cost here, stored every few passes under the Hugging Face cache home so the next process goes on from it), and
`DSparkBatchCosts` for a batch, whose t(B, w) is the batch profile scaled and corrected by whole rounds
(`DSparkBatchRoundCosts`). Both priors are one: a pass costs a fixed part plus `prior_token_slope` per token.
Reading order: the live profile → loading it → the row costs → the batch costs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel
from transformers.utils import logging

from .profiling_dspark import (
    DSparkBatchVerifyProfile,
    DSparkVerifyProfile,
    _interpolate,
    _read_stored_profile,
    prior_token_slope,
    store_verify_profile,
    verify_profile_key,
    verify_profile_path,
)

logger = logging.get_logger(__name__)

LIVE_PROFILE_FORMAT = "dspark-live-verify-profile/1"
LIVE_WEIGHT = 0.2  # weight of the newest pass once a k has been seen 1/LIVE_WEIGHT times (a running mean before)
STORE_EVERY = 32  # passes between writes of what was learned


def smoothed(old: float | None, new: float, weight: float) -> float:
    """A running mean that gives the newest observation `weight` (the first one is taken as it is)."""
    return new if old is None else (1 - weight) * old + weight * new


def _signature(profile: DSparkVerifyProfile | None, key: dict[str, str]) -> str:
    """What the learned ratios are relative to: the measured profile, or the prior's slope (ratios learned against
    another shape start over)."""
    if profile is None:
        return f"prior slope {prior_token_slope(key)}"
    return hashlib.sha256(json.dumps(profile.verify_time_s).encode()).hexdigest()[:16]


@dataclass
class DSparkLiveVerifyProfile:
    """t(k) = shape(k, context) × r(k): the shape from a measured profile when one is stored (`dspark-hf profile`),
    else the prior 1 + slope·k (`prior_token_slope`); r(k) the running ratio of live verify passes of k drafts to that shape, interpolated
    between the k seen so far (a k never seen takes its nearest neighbours' ratio). Every pass refines it (a noisy
    machine only averages longer), so a first call prices rounds after its first verify pass, and what it learned is
    stored for the next process. Until the first pass, without a clean measured shape (`noisy`), the schedule admits
    drafts by confidence alone."""

    key: dict[str, str]
    max_drafts: int
    ratios: list[float | None]
    counts: list[int]
    prior: DSparkVerifyProfile | None = None
    path: str | None = None  # where to store what was learned (None: keep it in memory)
    unsaved: int = 0
    frozen: bool = False  # priced by the prior as given (a profile the user set), nothing learned

    @classmethod
    def fresh(cls, key, max_drafts: int, prior: DSparkVerifyProfile | None, path: str | None,
              frozen: bool = False) -> "DSparkLiveVerifyProfile":
        return cls(key, max_drafts, [None] * (max_drafts + 1), [0] * (max_drafts + 1), prior, path, frozen=frozen)

    @property
    def noisy(self) -> bool:
        """Nothing to rank k by yet: no live pass seen, and no measured profile (or only a noisy one)."""
        return not any(self.counts) and (self.prior is None or self.prior.noisy)

    def shape(self, num_drafts: int, context_length: int) -> float:
        if self.prior is not None:
            return self.prior.verify_time(min(num_drafts, self.prior.max_drafts), context_length)
        return 1.0 + prior_token_slope(self.key) * num_drafts

    def ratio(self, num_drafts: int) -> float:
        seen = [k for k, count in enumerate(self.counts) if count]
        if not seen:
            return 1.0
        return _interpolate(seen, [self.ratios[k] for k in seen], num_drafts)

    def verify_time(self, num_drafts: int, context_length: int) -> float:
        return self.shape(num_drafts, context_length) * self.ratio(num_drafts)

    def observe(self, num_drafts: int, context_length: int, seconds: float) -> None:
        """One live verify pass of `num_drafts` drafts after `context_length` tokens took `seconds`."""
        k = min(num_drafts, self.max_drafts)
        shape = self.shape(k, context_length)
        if self.frozen or shape <= 0 or seconds <= 0:
            return
        self.counts[k] += 1
        weight = max(1.0 / self.counts[k], LIVE_WEIGHT)
        self.ratios[k] = smoothed(self.ratios[k], seconds / shape, weight)
        self.unsaved += 1
        if self.unsaved >= STORE_EVERY and self.path is not None:
            store_verify_profile(self, self.path)
            self.unsaved = 0

    def to_dict(self) -> dict[str, Any]:
        return {"format": LIVE_PROFILE_FORMAT, "key": self.key, "prior": _signature(self.prior, self.key),
                "ratios": self.ratios, "counts": self.counts}

    def learned_from(self, data: dict[str, Any]) -> None:
        """Take over what an earlier process learned on the same key and prior (a mismatch starts over)."""
        if (data.get("format") != LIVE_PROFILE_FORMAT or data.get("key") != self.key
                or data.get("prior") != _signature(self.prior, self.key)):
            return
        ratios, counts = list(data.get("ratios", [])), list(data.get("counts", []))
        usable = min(len(ratios), len(counts), self.max_drafts + 1)
        for k in range(usable):
            if isinstance(counts[k], int) and counts[k] > 0 and isinstance(ratios[k], (int, float)) and ratios[k] > 0:
                self.ratios[k], self.counts[k] = float(ratios[k]), counts[k]


def live_verify_profile(target: PreTrainedModel, max_drafts: int,
                        given: DSparkVerifyProfile | None = None) -> DSparkLiveVerifyProfile:
    """The live profile for this target, device, dtype and torch: exactly the `given` profile when there is one;
    else shaped by the stored measured profile (never measured here: that is `dspark-hf profile`'s job), continuing
    what earlier processes learned."""
    key = verify_profile_key(target)
    if given is not None:
        return DSparkLiveVerifyProfile.fresh(key, given.max_drafts, given, None, frozen=True)
    prior = _read_stored_profile(verify_profile_path(key), key)
    live_key = {**key, "axis": "live"}
    path = verify_profile_path(live_key)
    live = DSparkLiveVerifyProfile.fresh(key, max_drafts, prior, path)
    if os.path.isfile(path):
        try:
            with open(path) as file:
                live.learned_from(json.load(file))
        except (OSError, ValueError, TypeError):
            logger.warning(f"DSpark live verify profile {path} is unreadable; learning it again.")
    return live


SMOOTHING = 0.2  # weight of the newest observation in the drafter's running time and the batch costs


class DSparkRowCosts:
    """One row's rounds: t(k) of the live verify profile at this context length, plus the drafter's running time."""

    def __init__(self, profile: DSparkLiveVerifyProfile, draft_time_s: float | None = None):
        self.profile, self.draft_time_s = profile, draft_time_s
        self.max_drafts = profile.max_drafts

    @property
    def noisy(self) -> bool:
        return self.profile.noisy

    def needs_plain_step(self, batch_size: int) -> bool:
        return False

    def round_cost(self, width: float, batch_size: int, context_length: int, with_drafter: bool) -> float:
        verify = self.profile.verify_time(int(width), context_length)
        return verify + (self.draft_time_s or 0.0) if with_drafter and width else verify

    def observe(self, width: float, batch_size: int, context_length: int, drafter_ran: bool, draft_s: float | None,
                verify_s: float) -> None:
        if drafter_ran and draft_s is not None:
            self.draft_time_s = smoothed(self.draft_time_s, draft_s, SMOOTHING)
        self.profile.observe(int(width), context_length, verify_s)


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
        both = [b for b, d in self.factors if d and (b, False) in self.factors]
        if not drafted or not both:
            return plain
        nearest = min(both, key=lambda b: (abs(math.log(b / batch_size)), b))
        return plain * self.factors[nearest, True] / self.factors[nearest, False]


class DSparkBatchCosts:
    """Batched rounds: the profile's t(B, w) keeps the shape across widths, the live scale its level in seconds, and
    a factor per batch size and class (plain or drafted) the rest, plus the drafter's running time per batch size. A
    batch size whose plain step was never timed takes one plain step first. `live` may be shared between calls."""

    noisy = False

    def __init__(self, profile: DSparkBatchVerifyProfile, live: DSparkBatchRoundCosts | None = None):
        self.profile, self.live = profile, DSparkBatchRoundCosts() if live is None else live
        self.max_drafts = profile.max_drafts
        self.draft_time_s: dict[int, float] = {}  # the drafter's time per round, by batch size

    def needs_plain_step(self, batch_size: int) -> bool:
        return (batch_size, False) not in self.live.factors

    def _modelled(self, width: float, batch_size: int, with_drafter: bool) -> float:
        """A round's seconds as the profile and the drafter's running time say (before the live factor)."""
        profiled = (self.live.scale or 1.0) * self.profile.verify_time(batch_size, width)
        return profiled + self.draft_time_s.get(batch_size, 0.0) if with_drafter else profiled

    def round_cost(self, width: float, batch_size: int, context_length: int, with_drafter: bool) -> float:
        return self.live.factor(batch_size, with_drafter) * self._modelled(width, batch_size, with_drafter)

    def observe(self, width: float, batch_size: int, context_length: int, drafter_ran: bool, draft_s: float | None,
                verify_s: float) -> None:
        if drafter_ran and draft_s is not None:
            self.draft_time_s[batch_size] = smoothed(self.draft_time_s.get(batch_size), draft_s, SMOOTHING)
        self.live.observe_verify(verify_s, self.profile.verify_time(batch_size, width))
        if width > 0 or not drafter_ran:  # a drafted round, or a plain step (not a round whose drafts were refused)
            seconds = (draft_s or 0.0) + verify_s
            self.live.observe_round(batch_size, width > 0, seconds, self._modelled(width, batch_size, width > 0))


__all__ = ["DSparkBatchCosts", "DSparkBatchRoundCosts", "DSparkLiveVerifyProfile", "DSparkRowCosts",
           "live_verify_profile", "smoothed"]
