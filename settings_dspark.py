# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""A drafter's drafting settings and the state it keeps between generate calls, shared by the one-row generator
(`generation_dspark`) and the batch loop (`batching_dspark`).

Remote-code file (imports only torch and transformers). Reading order: the defaults every drafter drafts with → the
settings (every knob of the drafter's generation_config, read and checked once) → fitting the drafter to the target
→ the state kept between calls (learned biases and costs, the last call's stats per thread).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import logging

from .live_profiling_dspark import DSparkLiveVerifyProfile, live_verify_profile
from .profiling_dspark import (DSparkBatchVerifyProfile, DSparkVerifyProfile, batch_profile_key, stored_drafter_dtype,
                               unmeasured_drafter_dtype, verify_profile_key)

logger = logging.get_logger(__name__)

# ------------------------------------------------------------------------------------------------------------------
# Drafting settings and the state kept between generate calls

# What every drafter drafts with unless its generation_config says otherwise (a new drafter, one trained or converted
# here, a checkpoint saved without these keys): the schedule that drafts only what pays on this machine, with prompt
# lookup joining the drafter's drafts. Unset on a generation_config of the user's own, the schedule is fixed.
DEFAULT_DRAFTING = {"dspark_schedule": "hardware", "dspark_lookup_ngram_size": 4}


def default_drafting_config(num_draft_tokens: int) -> GenerationConfig:
    """A drafter's own generation_config: at most the whole block per round, DEFAULT_DRAFTING for the rest."""
    return GenerationConfig(num_assistant_tokens=num_draft_tokens, **DEFAULT_DRAFTING)


def with_default_drafting(generation_config: GenerationConfig) -> GenerationConfig:
    """A loaded generation_config with every drafting default it does not set itself (a checkpoint keeps its own)."""
    for name, value in DEFAULT_DRAFTING.items():
        if name not in generation_config.to_diff_dict():
            setattr(generation_config, name, value)
    return generation_config


@dataclass(frozen=True)
class DSparkDraftingSettings:
    """Every drafting knob of a drafter's `generation_config`, read and checked once (see `from_drafter`)."""

    num_drafts: int  # `num_assistant_tokens`: drafts per round at most
    confidence_threshold: float | None = None  # `dspark_confidence_threshold`: admit while a_n stays above it
    verify_cost: float | None = None  # `dspark_verify_cost`: one more verified token / a whole verify pass
    hardware: bool = False  # `dspark_schedule: "hardware"` (and a confidence head, and neither knob above)
    lookahead: bool = True  # `dspark_lookahead`: greedy rounds may choose k after seeing the whole block
    lookup_ngram_size: int = 0  # `dspark_lookup_ngram_size`: longest n-gram prompt lookup matches (0: off)
    min_gain: float = 1.0  # `dspark_min_gain`: how many times a plain step's rate a drafted round must promise
    drafter_dtype: str = "auto"  # `dspark_drafter_dtype`: "auto" (as `dspark-hf profile` measured), "as-loaded", a dtype
    packed_verification: bool = False  # `dspark_packed_verification`: batches verify each row's own tokens only

    @classmethod
    def from_drafter(cls, drafter) -> "DSparkDraftingSettings":
        """The one place the knobs are read; each bad value is one clear error naming the knob and the fix."""
        drafting, has_confidence = drafter.generation_config, drafter.confidence_head is not None
        knob = functools.partial(_checked_knob, drafting)
        threshold, verify_cost, mode = knob("dspark_confidence_threshold"), knob("dspark_verify_cost"), knob("dspark_schedule")
        if (threshold is not None or verify_cost is not None) and not has_confidence:
            raise ValueError(
                "confidence-scheduled drafting needs a confidence head; set enable_confidence_head or unset "
                "dspark_confidence_threshold / dspark_verify_cost on the drafter's generation_config."
            )
        return cls(
            num_drafts=_checked_num_drafts(getattr(drafting, "num_assistant_tokens", None), drafter.num_draft_tokens),
            confidence_threshold=None if threshold is None else float(threshold),
            verify_cost=None if verify_cost is None else float(verify_cost),
            hardware=mode == "hardware" and threshold is None and verify_cost is None and has_confidence,
            lookahead=getattr(drafting, "dspark_lookahead", True) is not False,
            lookup_ngram_size=knob("dspark_lookup_ngram_size") or 0,
            min_gain=float(knob("dspark_min_gain") or 1.0),
            drafter_dtype=knob("dspark_drafter_dtype") or "auto",
            packed_verification=bool(knob("dspark_packed_verification")),
        )


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


DRAFTER_DTYPES = ("auto", "as-loaded", "float32", "bfloat16", "float16")

# knob -> (whether a value set is good, what a bad one is not, the fix)
KNOB_RULES = {
    "dspark_confidence_threshold": (lambda v: _is_number(v) and 0 <= v <= 1, "a probability", "use a number in [0, 1] "
                                    "(e.g. 0.3: verify drafts while their predicted survival stays above it) or unset it"),
    "dspark_verify_cost": (lambda v: _is_number(v) and v >= 0, "a cost", "use a number >= 0 (one more verified token "
                           "as a share of a whole verify pass, e.g. 0.05) or unset it"),
    "dspark_schedule": (lambda v: v in ("hardware", "fixed"), "a DSpark schedule", 'use "hardware" or "fixed"'),
    "dspark_lookup_ngram_size": (lambda v: _is_number(v) and isinstance(v, int) and v >= 0, "an n-gram size",
                                 "use e.g. 3, or 0 to turn prompt lookup off"),
    "dspark_min_gain": (lambda v: _is_number(v) and v > 0, "a positive number", "use e.g. 1.1 (draft only when a "
                        "round promises 10% more than a plain step) or unset it"),
    "dspark_drafter_dtype": (lambda v: v in DRAFTER_DTYPES, "a choice", 'use "auto" (the dtype `dspark-hf profile '
                             '--drafter` measured fastest here, else as loaded), "as-loaded" or a dtype name'),
    "dspark_packed_verification": (lambda v: v in (True, False), "a switch", "use True or False, or unset it (False)"),
}


def _checked_knob(drafting: GenerationConfig, name: str):
    """The knob's value (None: unset), or one line naming it and the fix."""
    value = getattr(drafting, name, None)
    good, kind, fix = KNOB_RULES[name]
    if value is not None and not good(value):
        raise ValueError(f"{name}={value!r} is not {kind}; {fix}.")
    return value


def _checked_num_drafts(value, block_drafts: int) -> int:
    """`num_assistant_tokens`: 1..N drafts a round; more than the block is the whole block (transformers' own default
    is 20)."""
    if value is None:
        return block_drafts
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"num_assistant_tokens={value!r} is not a number of drafts; use 1 to {block_drafts} (this "
                         "drafter's block), or unset it for the whole block.")
    return min(value, block_drafts)


_PREPARING = threading.Lock()


def prepare_drafter(drafter, target: PreTrainedModel, settings: "DSparkDraftingSettings") -> None:
    """Fit the drafter to the target (`attach_to`) and run it in the dtype that pays here: `dspark_drafter_dtype`, or
    with "auto" the one `dspark-hf profile --drafter` measured fastest for this target, device (ISA included) and dtype,
    else fp32 where torch has no fast half-precision GEMM here (`unmeasured_drafter_dtype`); never measured on the call."""
    with _PREPARING:  # concurrent first calls on one drafter: one binds and casts, the others find it done
        drafter.attach_to(target)
        auto = settings.drafter_dtype == "auto"
        wanted = stored_drafter_dtype(target) or unmeasured_drafter_dtype(drafter) if auto else settings.drafter_dtype
        if wanted in (None, "as-loaded") or str(next(drafter.parameters()).dtype) == f"torch.{wanted}":
            return
        drafter.to(getattr(torch, wanted))
    logger.warning_once(f"DSpark runs the drafter in {wanted} on this machine (dspark_drafter_dtype={settings.drafter_dtype}).")


@dataclass
class DSparkDraftingState:
    """Everything a drafter keeps from one generate call to the next: `drafter.drafting_state`.

    Clear `confidence_bias` and `lookup_counts` to start learning over (e.g. after switching to another kind of
    prompt); set `verify_profile` to price rounds with a profile of your own, as given (left None, rounds are priced
    by `live_verify_profile`: the stored measured shape, refined by every round).
    """

    confidence_bias: dict[tuple, float] = field(default_factory=dict)  # hardware schedule's online bias per setting
    lookup_counts: dict[tuple, dict[int, list[float]]] = field(default_factory=dict)  # prompt-lookup outcomes
    verify_profile: DSparkVerifyProfile | None = None
    batch_verify_profile: DSparkBatchVerifyProfile | None = None  # a shape of t(B, w) of your own for batches
    # t(B, k) as this process's rounds priced it, greedy (False) and sampled (True)
    live_verify_profiles: dict[bool, DSparkLiveVerifyProfile] = field(default_factory=dict)
    bound_target: str | None = None  # the target whose embeddings `bind_target` copied
    # `last_stats` of each thread that generated, and of the newest call in any thread (see `last_stats`)
    _stats_by_thread: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    _newest_stats: "DSparkGenerationStats | None" = field(default=None, repr=False)

    @property
    def last_stats(self) -> "DSparkGenerationStats | None":
        """What the last generate call of this thread did; in a thread that has not generated (a chat UI's main thread
        reading a worker's call), the newest call's. Concurrent calls on one drafter each keep their own."""
        return self._stats_by_thread.get(threading.current_thread(), self._newest_stats)

    @last_stats.setter
    def last_stats(self, stats: "DSparkGenerationStats | None"):
        self._stats_by_thread[threading.current_thread()] = self._newest_stats = stats

    def round_costs_for(self, target: PreTrainedModel, max_drafts: int, sampling: bool = False) -> DSparkLiveVerifyProfile:
        """What rounds cost, one row or many: the live profile kept from call to call (the profiles set here where they
        belong to this target, device, dtype and torch, else the stored shapes refined live; never measured on the
        call), and the drafter's running time."""
        key, live = verify_profile_key(target), self.live_verify_profiles.get(sampling)
        mine = self.verify_profile if self.verify_profile is not None and self.verify_profile.key == key else None
        batch = given if (given := self.batch_verify_profile) is not None and given.key == batch_profile_key(target) else None
        if (live is None or live.key != key or live.max_drafts < max_drafts or live.frozen != (mine is not None)
                or (mine is not None and live.prior is not mine) or live.given_batch is not batch):
            live = self.live_verify_profiles[sampling] = live_verify_profile(target, max_drafts, mine, batch, sampling)
        return live


__all__ = ["DEFAULT_DRAFTING", "DSparkDraftingSettings", "DSparkDraftingState", "default_drafting_config",
           "prepare_drafter", "with_default_drafting"]
