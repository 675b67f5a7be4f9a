# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""t(k) learned live: the verify cost priced from the verify passes generation runs anyway, so no call waits for a
measurement.

Remote-code file (imports only torch and transformers). The hardware-aware schedule (`scheduling_dspark.py`) prices
rounds by `DSparkLiveVerifyProfile`: a shape (the measured profile of `profiling_dspark.py` where `dspark-hf profile`
stored one, else a prior) times what passes of each k really cost here, stored every few passes under the Hugging
Face cache home so the next process goes on from it. Reading order: the live profile → loading it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel
from transformers.utils import logging

from .profiling_dspark import (
    PROFILE_CONTEXT_LENGTHS,
    DSparkVerifyProfile,
    _interpolate,
    _read_stored_profile,
    store_verify_profile,
    verify_profile_key,
    verify_profile_path,
)

logger = logging.get_logger(__name__)

LIVE_PROFILE_FORMAT = "dspark-live-verify-profile/1"
PRIOR_SLOPE = 0.15  # t(k)/t(0) = 1 + PRIOR_SLOPE·k where no measured profile gives the shape (CPU bf16: 0.05-0.4)
LIVE_WEIGHT = 0.2  # weight of the newest pass once a k has been seen 1/LIVE_WEIGHT times (a running mean before)
STORE_EVERY = 32  # passes between writes of what was learned


def smoothed(old: float | None, new: float, weight: float) -> float:
    """A running mean that gives the newest observation `weight` (the first one is taken as it is)."""
    return new if old is None else (1 - weight) * old + weight * new


def _signature(profile: DSparkVerifyProfile | None) -> str:
    if profile is None:
        return "none"
    return hashlib.sha256(json.dumps(profile.verify_time_s).encode()).hexdigest()[:16]


@dataclass
class DSparkLiveVerifyProfile:
    """t(k) = shape(k, context) × r(k): the shape from a measured profile when one is stored (`dspark-hf profile`),
    else 1 + PRIOR_SLOPE·k; r(k) the running ratio of live verify passes of k drafts to that shape, interpolated
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

    @property
    def context_lengths(self) -> list[int]:
        return self.prior.context_lengths if self.prior is not None else [PROFILE_CONTEXT_LENGTHS[0]]

    def shape(self, num_drafts: int, context_length: int) -> float:
        if self.prior is not None:
            return self.prior.verify_time(min(num_drafts, self.prior.max_drafts), context_length)
        return 1.0 + PRIOR_SLOPE * num_drafts

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
        return {"format": LIVE_PROFILE_FORMAT, "key": self.key, "prior": _signature(self.prior),
                "ratios": self.ratios, "counts": self.counts}

    def learned_from(self, data: dict[str, Any]) -> None:
        """Take over what an earlier process learned on the same key and prior (a mismatch starts over)."""
        if (data.get("format") != LIVE_PROFILE_FORMAT or data.get("key") != self.key
                or data.get("prior") != _signature(self.prior)):
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


__all__ = ["DSparkLiveVerifyProfile", "live_verify_profile", "smoothed"]
