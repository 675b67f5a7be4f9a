# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""The target's verify cost t(k): how long one verify pass over k drafts takes on this machine.

Remote-code file (imports only torch and transformers). The hardware-aware schedule (`scheduling_dspark.py`) ranks
draft lengths by expected committed tokens per second, so it needs t(k) for the target as it runs here, per target,
device (with its ISA), dtype and torch version (the profile key). Generation never waits for a measurement: it prices
rounds by a live profile learned from its own verify passes (`live_profiling_dspark.py`), shaped by the measured
profile stored here when `dspark-hf profile` measured one (the measuring itself is the library's, never the remote
code's). Reading order: key and device probe → the measured profile → load and store → the drafter dtype measured
fastest → the batch axis.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

logger = logging.get_logger(__name__)

PROFILE_FORMAT = "dspark-verify-profile/2"  # /2: every k measured, no envelope (older files are re-measured)
PROFILE_CONTEXT_LENGTHS = (128, 512)  # context lengths measured; others are interpolated


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The first `field` line of /proc/cpuinfo (Linux), None where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith(field)), None)
    except OSError:
        return None


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows of it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "cpu"


# Environment variables that cap the instruction set the CPU kernels use (ATen, oneDNN, MKL): a capped run is
# another machine as far as timings go.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def bf16_matmuls_native() -> bool:
    """Whether this CPU's bf16 matmuls have hardware (AVX512-BF16 or AMX) that the kernels may use (no ISA cap)."""
    capped = any(os.environ.get(name, "").upper().startswith(("AVX2", "AVX_", "SSE")) for name in ISA_CAPS[1:])
    has_units = bool({"avx512_bf16", "amx_bf16"} & set((_cpuinfo("flags") or "").split()))
    return has_units and torch.backends.cpu.get_cpu_capability().startswith("AVX512") and not capped


def cpu_isa_description() -> str:
    """The vector ISA the CPU kernels run with here, e.g. "AVX512, bf16 native" or "AVX2, bf16 emulated,
    capped ONEDNN_MAX_CPU_ISA=AVX2": whether bf16 matmuls have hardware decides which dtype pays."""
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    text = f"{torch.backends.cpu.get_cpu_capability()}, bf16 {'native' if bf16_matmuls_native() else 'emulated'}"
    return text + (f", capped {' '.join(caps)}" if caps else "")


def _device_description(device: torch.device) -> str:
    """What the timings belong to: the accelerator's name, or the CPU model, its ISA and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    return f"{cpu_name()} ({cpu_isa_description()}), {torch.get_num_threads()} thread(s)"


def verify_profile_key(target: PreTrainedModel) -> dict[str, str]:
    """Everything a verify timing depends on; a profile whose key differs is never used."""
    config = target.config.to_dict()
    for volatile in ("_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"):
        config.pop(volatile, None)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    device = target.device
    return {
        "target": str(target.config.name_or_path or type(target).__name__),
        "revision": str(getattr(target.config, "_commit_hash", None) or ""),
        "config_sha256": config_hash,
        "device": device.type,
        "device_name": _device_description(device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


def verify_profile_path(key: dict[str, str]) -> str:
    """`<HF_HOME>/dspark/profiles/<target>-<hash of the key>.json` (HF_HOME read at call time)."""
    from huggingface_hub import constants  # ships with transformers

    home = os.path.expanduser(os.environ.get("HF_HOME") or constants.HF_HOME)
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in key["target"].split("/")[-1])[:64]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(home, "dspark", "profiles", f"{slug}-{digest}.json")


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """ys at x, linear between the measured xs, the nearest one outside them."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (x - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1])
    return ys[-1]


class _DSparkTimings:
    """A stored table of verify seconds, `verify_time_s[i][j]` with a spread each, one row per entry of the axis
    `AXIS`, written as JSON under the format `FORMAT`."""

    FORMAT = AXIS = ""

    @property
    def num_columns(self) -> int:
        return len(self.verify_time_s[0])

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.FORMAT, **{name: getattr(self, name) for name in self.__dataclass_fields__}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Raises ValueError on anything that is not a well-formed table of this kind."""
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            raise ValueError(f"not a {cls.FORMAT} profile")
        profile = cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})
        axis, rows = getattr(profile, cls.AXIS), profile.verify_time_s + profile.spread_s
        if (not axis or len(profile.verify_time_s) != len(axis) or len(profile.spread_s) != len(axis)
                or len({len(row) for row in rows}) != 1 or len(rows[0]) != profile.num_columns
                or not all(isinstance(t, (int, float)) and t >= 0 for row in rows for t in row)):
            raise ValueError("malformed timings")
        return profile


@dataclass
class DSparkVerifyProfile(_DSparkTimings):
    """t(k): seconds of one verify pass over k drafts (a forward of k+1 tokens on a cached context), per context."""

    FORMAT, AXIS = PROFILE_FORMAT, "context_lengths"
    key: dict[str, str]
    context_lengths: list[int]
    verify_time_s: list[list[float]]  # [context][k] median over repeats
    spread_s: list[list[float]]  # [context][k] interquartile range over repeats
    noisy: bool = False
    measured_in_s: float = 0.0

    @property
    def max_drafts(self) -> int:
        return len(self.verify_time_s[0]) - 1

    def verify_time(self, num_drafts: int, context_length: int) -> float:
        """t(k) at this context length: linear between measured lengths, the nearest one outside them."""
        return _interpolate(self.context_lengths, [row[num_drafts] for row in self.verify_time_s], context_length)


def _read_stored_profile(path: str, key: dict[str, str], kind: type = DSparkVerifyProfile):
    """The `kind` of profile stored at `path` if it is well formed and belongs to `key`; None (with one warning)
    otherwise."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as file:
            profile = kind.from_dict(json.load(file))
    except (OSError, ValueError, TypeError, KeyError) as error:
        logger.warning(f"DSpark verify profile {path} is unreadable ({error}); not used.")
        return None
    if profile.key != key:
        logger.warning(f"DSpark verify profile {path} belongs to another target/device/dtype/torch; not used.")
        return None
    return profile


def store_json(record: dict[str, Any], path: str, what: str = "the verify profile") -> None:
    """Write `record` (a profile's `to_dict()`) under a temporary name, then rename: an unwritable cache home costs
    one warning line and the reuse, never the profile."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staging = f"{path}.{os.getpid()}.tmp"
        with open(staging, "w") as file:
            json.dump(record, file, indent=1)
        os.replace(staging, path)
    except OSError as error:
        logger.warning(f"DSpark could not store {what} at {path} ({error}); it is not kept for later processes.")


DRAFTER_DTYPE_FORMAT = "dspark-drafter-dtype/1"


def drafter_dtype_path(target: PreTrainedModel) -> str:
    return verify_profile_path({**verify_profile_key(target), "axis": "drafter-dtype"})


def stored_drafter_dtype(target: PreTrainedModel) -> str | None:
    """The drafter dtype measured fastest with this target, device and dtype, if one was measured."""
    path = drafter_dtype_path(target)
    try:
        with open(path) as file:
            record = json.load(file)
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("format") == DRAFTER_DTYPE_FORMAT and record.get("key") == verify_profile_key(target)
    return record.get("drafter_dtype") if ok and record.get("drafter_dtype") in ("float32", "bfloat16", "float16") else None


def unmeasured_drafter_dtype(drafter) -> str | None:
    """Where none was measured: fp32 for a half-precision CPU drafter whose matmuls torch cannot hand to oneDNN (no
    AVX512 or fp16 units), as torch's own GEMM costs 3.4x fp32's over 28 rows on an AVX2 EPYC; else as loaded (None)."""
    weight = drafter.lm_head.weight
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(weight.dtype)
    if weight.device.type != "cpu" or check is None:
        return None
    return None if torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, check)() else "float32"


# ------------------------------------------------------------------------------------------------------------------
# The batch axis: t(B, w), one verify pass of a padded width w for B rows, at one context length.

BATCH_PROFILE_FORMAT = "dspark-batch-verify-profile/2"  # /2: widths measured sparsely, interpolated
BATCH_PROFILE_SIZES = (1, 4, 16)  # batch sizes measured; others are interpolated (beyond: proportional)
BATCH_PROFILE_WIDTHS = (0, 1, 3, 7)  # widths measured (capped at the drafter's block); others are interpolated
BATCH_PROFILE_CONTEXT = 64  # short: a batch's prefill of long contexts would cost more than the timings
# The prior shape of a pass where none is measured, 1 + slope · (tokens − 1): each token of a pass costs this fraction
# of a one-token step. Measured on a 2-core EPYC (1 thread): 0.016-0.02 in bf16 with bf16 matmul units, 0.037-0.04 in fp32, and 0.4 at batch 1 in bf16 without the
# units (AVX2-capped: bf16 is converted for every matmul); an accelerator's pass stays memory-bound far longer.
PRIOR_TOKEN_SLOPES = {"bf16 native": 0.02, "fp32": 0.04, "half emulated": 0.4, "accelerator": 0.005}


@dataclass
class DSparkBatchVerifyProfile(_DSparkTimings):
    """t(B, w): seconds of one verify pass over w drafts for each of B rows (a forward of B × (w + 1) tokens)."""

    FORMAT, AXIS = BATCH_PROFILE_FORMAT, "batch_sizes"
    key: dict[str, str]
    batch_sizes: list[int]
    widths: list[int]
    context_length: int
    verify_time_s: list[list[float]]  # [batch size][width] median over repeats
    spread_s: list[list[float]]
    noisy: bool = False
    measured_in_s: float = 0.0

    @property
    def max_drafts(self) -> int:
        return self.widths[-1]

    def verify_time(self, batch_size: int, width: int) -> float:
        """t(B, w): linear between measured widths and batch sizes, proportional to B beyond the largest."""
        by_size = [_interpolate(self.widths, row, min(width, self.max_drafts)) for row in self.verify_time_s]
        if batch_size > self.batch_sizes[-1]:
            return by_size[-1] * batch_size / self.batch_sizes[-1]
        return _interpolate(self.batch_sizes, by_size, batch_size)

    @property
    def num_columns(self) -> int:
        return len(self.widths)


def batch_profile_key(target: PreTrainedModel) -> dict[str, str]:
    """The verify profile's key, marked as the batch axis (stored beside it, never mistaken for it)."""
    return {**verify_profile_key(target), "axis": "batch"}


def batch_verify_profile(target: PreTrainedModel, max_drafts: int) -> DSparkBatchVerifyProfile | None:
    """The stored batch profile for this target, device, dtype and torch (`dspark-hf profile --batch-sizes`), or None
    (none stored, too noisy, or too narrow): the live profile's prior shape serves then, and its level is learned live
    either way."""
    key = batch_profile_key(target)
    profile = _read_stored_profile(verify_profile_path(key), key, DSparkBatchVerifyProfile)
    return None if profile is None or profile.noisy or profile.max_drafts < max_drafts else profile


def prior_token_slope(key: dict[str, str]) -> float:
    """The prior's cost of one more token in a pass, for the device and dtype of the key (PRIOR_TOKEN_SLOPES)."""
    if key["device"] != "cpu":
        return PRIOR_TOKEN_SLOPES["accelerator"]
    if key["dtype"] == "float32":
        return PRIOR_TOKEN_SLOPES["fp32"]
    native = key["dtype"] == "bfloat16" and "bf16 native" in key["device_name"]
    return PRIOR_TOKEN_SLOPES["bf16 native" if native else "half emulated"]


__all__ = ["DSparkBatchVerifyProfile", "DSparkVerifyProfile", "batch_verify_profile", "drafter_dtype_path",
           "store_json", "stored_drafter_dtype", "unmeasured_drafter_dtype", "verify_profile_key", "verify_profile_path"]
