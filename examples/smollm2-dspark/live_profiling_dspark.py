# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""What rounds cost, learned live from the verify passes generation runs anyway, so no call waits for a measurement.

Remote-code file (imports only torch and transformers). The hardware-aware schedule (`scheduling_dspark.py`) prices
rounds for one row and many by `DSparkLiveVerifyProfile`: t(B, k) (a shape from the measured profiles of
`profiling_dspark.py` where `dspark-hf profile` stored them, else the prior, a fixed part plus `prior_token_slope` per
token, times what passes of each batch size and k really cost here, stored every few passes under the Hugging Face
cache home so the next process goes on from it) plus the drafter's running time. Reading order: the live profile →
loading it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel
from transformers.utils import logging

from .profiling_dspark import (
    DSparkBatchVerifyProfile,
    DSparkVerifyProfile,
    _interpolate,
    _read_stored_profile,
    batch_verify_profile,
    prior_token_slope,
    store_json,
    verify_profile_key,
    verify_profile_path,
)

logger = logging.get_logger(__name__)

LIVE_PROFILE_FORMAT = "dspark-live-verify-profile/2"  # /2: a table per batch size (older files start over)
LIVE_WEIGHT = 0.2  # weight of the newest pass once a k has been seen 1/LIVE_WEIGHT times (a running mean before)
STORE_EVERY = 32  # passes between writes of what was learned
SMOOTHING = 0.2  # weight of the newest observation in the drafter's running time
OUTLIER = 5.0  # a k whose ratio is this many times its batch size's lowest is priced by its neighbours (`ratio`)


def smoothed(old: float | None, new: float, weight: float) -> float:
    """A running mean that gives the newest observation `weight` (the first one is taken as it is)."""
    return new if old is None else (1 - weight) * old + weight * new


def _digest(profile) -> str:
    return hashlib.sha256(json.dumps(profile.verify_time_s).encode()).hexdigest()[:16]


@dataclass
class DSparkLiveVerifyProfile:
    """t(B, k) = shape(B, k, context) × r_B(k): seconds of one verify pass over k drafts for each of B rows. The shape:
    for one row a measured profile per context when one is stored (`dspark-hf profile`), else the batch shape t(B, w)
    (measured with `--batch-sizes`, or the prior 1 + slope·(B(k + 1) − 1)). r_B(k): the running ratio of live passes
    to that shape, interpolated between the k seen at B. A batch size that has only stepped plainly takes the
    drafted / plain ratio of the nearest batch size that has drafted, so one expensive guess never keeps it from
    drafting. Every pass refines it (a noisy machine only averages longer), so a first call prices rounds after its
    first verify pass, and what it learned is stored for the next process. Until then, without a clean measured shape
    (`noisy`), one row admits drafts by confidence alone; a batch takes a plain step first (`seen`)."""

    key: dict[str, str]
    max_drafts: int
    prior: DSparkVerifyProfile | None = None  # one row's measured t(k) per context
    batch_prior: DSparkBatchVerifyProfile | None = None  # t(B, w)'s shape (None: the prior)
    given_batch: DSparkBatchVerifyProfile | None = None  # the shape the user set (then `batch_prior`), else None
    path: str | None = None  # where to store what was learned (None: keep it in memory)
    frozen: bool = False  # one row priced by `prior` as given (a profile the user set), nothing learned for it
    ratios: dict[int, list[float | None]] = field(default_factory=dict)  # batch size -> r_B(k)
    counts: dict[int, list[int]] = field(default_factory=dict)  # batch size -> passes seen of each k
    draft_time_s: dict[int, float] = field(default_factory=dict)  # batch size -> the drafter's running time (kept
    unsaved: int = 0                                                # in memory: it is the drafter's, not the target's)

    def seen(self, rows: int, num_drafts: int | None = None) -> bool:
        """Whether a pass of `num_drafts` (any k: None) drafts for `rows` rows has been timed."""
        counts = self.counts.get(rows, [])
        return any(counts) if num_drafts is None else bool(num_drafts < len(counts) and counts[num_drafts])

    def noisy(self, rows: int = 1) -> bool:
        """Nothing to rank one row's k by yet: no live pass seen, and no measured profile (or only a noisy one)."""
        return rows == 1 and not self.seen(1) and (self.prior is None or self.prior.noisy)

    def shape(self, num_drafts: float, context_length: int, rows: int = 1) -> float:
        if rows == 1 and self.prior is not None:
            return self.prior.verify_time(min(int(num_drafts), self.prior.max_drafts), context_length)
        if self.batch_prior is not None:
            return self.batch_prior.verify_time(rows, num_drafts)
        return 1.0 + prior_token_slope(self.key) * (rows * (num_drafts + 1) - 1)

    def ratio(self, num_drafts: float, rows: int = 1) -> float:
        """Seconds per unit of the shape; a k far above the rest (timed in a stall: never run again) takes its neighbours'."""
        seen = [k for k, count in enumerate(self.counts.get(rows, [])) if count]
        lowest = min((self.ratios[rows][k] for k in seen), default=0.0)  # once: rounds price many k
        seen = [k for k in seen if self.ratios[rows][k] <= OUTLIER * lowest]
        if rows > 1 and not seen:  # a batch size never run: its nearest neighbour's (the shape scales it)
            near = self._nearest(rows, lambda b: True)
            return 1.0 if near is None else self.ratio(num_drafts, near)
        if rows > 1 and seen == [0] and num_drafts > 0:  # only plain steps at this batch size so far
            near = self._nearest(rows, lambda b: self.seen(b, 0) and any(self.counts[b][1:]))
            if near is not None:
                return self.ratios[rows][0] * self.ratio(num_drafts, near) / self.ratios[near][0]
        return _interpolate(seen, [self.ratios[rows][k] for k in seen], num_drafts) if seen else 1.0

    def _nearest(self, rows: int, usable) -> int | None:
        """The seen batch size (of more than one row) nearest to `rows` on a log scale among the `usable` ones."""
        sizes = [b for b in self.counts if b > 1 and b != rows and self.seen(b) and usable(b)]
        return min(sizes, key=lambda b: (abs(math.log(b / rows)), b), default=None)

    def verify_time(self, num_drafts: float, context_length: int, rows: int = 1) -> float:
        return self.shape(num_drafts, context_length, rows) * self.ratio(num_drafts, rows)

    def round_cost(self, num_drafts: float, rows: int, context_length: int, with_drafter: bool) -> float:
        """A round's seconds: its verify pass, plus the drafter's time when it ran (whatever the round then verifies)."""
        verify = self.verify_time(num_drafts, context_length, rows)
        return verify + self.draft_time_s.get(rows, 0.0) if with_drafter else verify

    def needs_plain_step(self, rows: int) -> bool:
        """A batch size whose plain step was never timed takes one first (one row drafts from its first round)."""
        return rows > 1 and not self.seen(rows, 0)

    def observe_drafter(self, rows: int, seconds: float) -> None:
        self.draft_time_s[rows] = smoothed(self.draft_time_s.get(rows), seconds, SMOOTHING)

    def observe(self, num_drafts: float, context_length: int, seconds: float, rows: int = 1) -> None:
        """One live verify pass of `num_drafts` drafts per row (the mean, packed) for `rows` rows after
        `context_length` tokens took `seconds`."""
        k = min(round(num_drafts), self.max_drafts)  # a packed round's ratio is to its own shape, kept at the nearest k
        shape = self.shape(min(num_drafts, self.max_drafts), context_length, rows)
        if (self.frozen and rows == 1) or shape <= 0 or seconds <= 0:
            return
        counts = self.counts.setdefault(rows, [0] * (self.max_drafts + 1))
        ratios = self.ratios.setdefault(rows, [None] * (self.max_drafts + 1))
        counts[k] += 1
        ratios[k] = smoothed(ratios[k], seconds / shape, max(1.0 / counts[k], LIVE_WEIGHT))
        self.unsaved += 1
        if self.unsaved >= STORE_EVERY and self.path is not None:
            store_json(self.to_dict(), self.path)
            self.unsaved = 0

    def signature(self) -> str:
        """What the learned ratios are relative to: the measured profiles, or the prior's slope (ratios learned
        against another shape start over)."""
        shapes = [f"prior slope {prior_token_slope(self.key)}" if p is None else _digest(p)
                  for p in (self.prior, self.batch_prior)]
        return " ".join(shapes)

    def to_dict(self) -> dict[str, Any]:
        return {"format": LIVE_PROFILE_FORMAT, "key": self.key, "prior": self.signature(),
                "ratios": {str(b): r for b, r in self.ratios.items()}, "counts": {str(b): c for b, c in self.counts.items()}}

    def learned_from(self, data: dict[str, Any]) -> None:
        """Take over what an earlier process learned on the same key and priors (a mismatch starts over)."""
        if data.get("format") != LIVE_PROFILE_FORMAT or data.get("key") != self.key or data.get("prior") != self.signature():
            return
        for size, counts in dict(data.get("counts", {})).items():
            ratios, rows = list(dict(data.get("ratios", {})).get(size, [])), int(size)
            for k in range(min(len(ratios), len(counts), self.max_drafts + 1)):
                if rows > 0 and isinstance(counts[k], int) and counts[k] > 0 and isinstance(ratios[k], (int, float)) and ratios[k] > 0:
                    self.counts.setdefault(rows, [0] * (self.max_drafts + 1))[k] = counts[k]
                    self.ratios.setdefault(rows, [None] * (self.max_drafts + 1))[k] = float(ratios[k])


def live_verify_profile(target: PreTrainedModel, max_drafts: int, given: DSparkVerifyProfile | None = None,
                        given_batch: DSparkBatchVerifyProfile | None = None, sampling: bool = False) -> DSparkLiveVerifyProfile:
    """The live profile for this target, device, dtype and torch, and for greedy or sampled rounds (sampling's
    acceptance costs a softmax over every verified token): one row priced exactly by the `given` profile when there is
    one; else shaped by the stored measured profiles (never measured here: that is `dspark-hf profile`'s job),
    continuing what earlier processes learned."""
    key = verify_profile_key(target)
    batch = given_batch or batch_verify_profile(target, max_drafts)
    if given is not None:
        return DSparkLiveVerifyProfile(key, given.max_drafts, given, batch, given_batch=given_batch, frozen=True)
    prior = _read_stored_profile(verify_profile_path(key), key)
    path = verify_profile_path({**key, "axis": "live", **({"decoding": "sample"} if sampling else {})})
    live = DSparkLiveVerifyProfile(key, max_drafts, prior, batch, given_batch, path)
    if os.path.isfile(path):
        try:
            with open(path) as file:
                live.learned_from(json.load(file))
        except (OSError, ValueError, TypeError, AttributeError):
            logger.warning(f"DSpark live verify profile {path} is unreadable; learning it again.")
    return live


__all__ = ["DSparkLiveVerifyProfile", "live_verify_profile", "smoothed"]
