"""The toolkit every layout shares: a checkpoint in our conventions, tensor loading and checking, the Qwen3 geometry,
one config builder, and the writer.

Why one module: the importers (speculators, z-lab DFlash, DeepSpec) translate their checkpoints into a
`DraftCheckpoint` and then go through the same shape check and the same writer, so every converted or exported
directory is byte-for-byte the layout that `save_pretrained`, speculators and vLLM read (docs/design.md §3). Expected tensor
shapes come from the model file (`expected_tensor_shapes`), so the check and the model never disagree.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..remote_code.configuration_dspark import DSparkConfig
from ..remote_code.drafting_dspark import DSparkForDrafting
from ..remote_code.modeling_dspark import expected_tensor_shapes
from ..vocab import full_draft_vocab

BOUND_TENSORS = ("embed_tokens.weight", "lm_head.weight")
VOCAB_MAPS = ("d2t", "t2d")

# Why a tensor has the shape it has, so a mismatch names the config field to fix.
_SHAPE_HINTS = (
    (r"^embed_tokens\.", "[vocab_size, hidden_size]"),
    (r"^lm_head\.", "[draft_vocab_size, hidden_size]"),
    (r"^fc\.", "[hidden_size, number of aux layers × target_hidden_size]"),
    (r"^d2t$", "[draft_vocab_size]"),
    (r"^t2d$", "[vocab_size]"),
    (r"\.(q|k)_norm\.", "[head_dim]"),
    (r"\.q_proj\.", "[num_attention_heads × head_dim, hidden_size]"),
    (r"\.(k|v)_proj\.", "[num_key_value_heads × head_dim, hidden_size]"),
    (r"\.o_proj\.", "[hidden_size, num_attention_heads × head_dim]"),
    (r"\.mlp\.(gate|up)_proj\.", "[intermediate_size, hidden_size]"),
    (r"\.mlp\.down_proj\.", "[hidden_size, intermediate_size]"),
    (r"markov_w1\.", "[vocab_size, markov_rank], or [draft_vocab_size + 1, markov_rank] with markov_input_vocab=draft"),
    (r"markov_w2\.", "[draft_vocab_size, markov_rank]"),
    (r"gate_proj\.", "[markov_rank, hidden_size + markov_rank]"),
    (r"joint_proj\.", "[3 × markov_rank, 2 × markov_rank + hidden_size]"),
    (r"^confidence_head\.", "[1, hidden_size (+ markov_rank with confidence_head_with_markov)]"),
    (r"norm\.weight$", "[hidden_size]"),
)

@dataclass
class DraftCheckpoint:
    """A drafter translated into this project's conventions: config, tensors by final name, and how it was translated."""

    config: DSparkConfig
    tensors: dict[str, torch.Tensor]
    conversion: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# Reading helpers shared by every importer


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path.name} not found in {path.parent}; point to the checkpoint directory.")
    return json.loads(path.read_text())


def load_tensors(directory: str | Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a directory: `model.safetensors`, a sharded index, or the `*.safetensors` files it holds."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{what}: no safetensors weights in {directory}; convert .bin weights to safetensors first."
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(directory / name))
    return tensors


def strip_wrapper_prefix(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Drop a prefix every name shares (`model.` from a wrapped save, `module.` from DDP, `_orig_mod.` from compile)."""
    for prefix in ("model.", "module.", "_orig_mod."):
        if tensors and all(name.startswith(prefix) for name in tensors):
            stripped, _ = strip_wrapper_prefix({name[len(prefix):]: t for name, t in tensors.items()})
            return stripped, prefix
    return tensors, None


def full_vocab_maps(vocab_size: int) -> dict[str, torch.Tensor]:
    """Identity draft vocabulary (V_d = V_t) for layouts that draft over the whole target vocabulary."""
    return dict(zip(VOCAB_MAPS, full_draft_vocab(vocab_size)))


def rope_parameters_of(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from a transformers 5 (`rope_parameters`) or 4.x (`rope_theta` + `rope_scaling`) config."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 1_000_000.0))}
    scaling = config.get("rope_scaling") or {}
    if scaling:
        rope.update(scaling)
        rope["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return rope


def reject_sliding_layers(config: dict[str, Any], what: str):
    """DSpark draft layers are full, non-causal attention; a sliding/causal layer would draft something else."""
    layer_types = config.get("layer_types") or []
    if "sliding_attention" in layer_types:
        raise ValueError(
            f"{what}: layer_types has sliding_attention layers ({layer_types}); DSpark draft layers are full "
            "non-causal attention, so this drafter cannot be converted exactly (retrain with full_attention layers)."
        )


# ----------------------------------------------------------------------------------------------------------------
# Checking tensors against the config


def _hint(name: str) -> str:
    return next((hint for pattern, hint in _SHAPE_HINTS if re.search(pattern, name)), "see docs/design.md §3")


def check_tensors(tensors: dict[str, torch.Tensor], config: DSparkConfig, what: str):
    """One clear error for an unknown, missing or wrong-shaped tensor (docs/design.md §9), before anything is written."""
    expected = expected_tensor_shapes(config)
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(
            f"{what}: unexpected tensors {unknown[:5]}{' …' if len(unknown) > 5 else ''}; this layout variant is not "
            "supported (only Qwen3-style DFlash/DSpark layers, fc, norms, Markov and confidence heads are)."
        )
    optional = set(BOUND_TENSORS) if config.bind_target_embeddings else set()
    missing = sorted(set(expected) - set(tensors) - optional)
    if missing:
        raise ValueError(
            f"{what}: missing tensors {missing[:5]}{' …' if len(missing) > 5 else ''}; the weights do not match "
            "config.json (number of layers, heads) — use the config that was saved with these weights."
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{what}: tensor `{name}` has shape {list(tensor.shape)} but config.json implies {list(expected[name])} "
                f"({_hint(name)}); fix those config fields or re-export the weights that belong to this config."
            )


def infer_heads(raw: dict[str, Any], tensors: dict[str, torch.Tensor], hidden_size: int) -> tuple[int, bool, bool]:
    """(markov_rank, enable_confidence_head, confidence_head_with_markov): from config.json, else from the tensors."""
    w1 = tensors.get("markov_head.markov_w1.weight")
    markov_rank = int(raw["markov_rank"]) if "markov_rank" in raw else (w1.shape[1] if w1 is not None else 0)
    proj = tensors.get("confidence_head.proj.weight")
    confidence = bool(raw["enable_confidence_head"]) if "enable_confidence_head" in raw else proj is not None
    if "confidence_head_with_markov" in raw:
        with_markov = bool(raw["confidence_head_with_markov"])
    else:
        with_markov = proj is not None and markov_rank > 0 and proj.shape[-1] == hidden_size + markov_rank
    return markov_rank, confidence, with_markov


def markov_head_type_of(raw: dict[str, Any], tensors: dict[str, torch.Tensor], markov_rank: int) -> str:
    """The Markov variant from config.json, else from which extra projection the checkpoint carries."""
    if not markov_rank:
        return "vanilla"
    if raw.get("markov_head_type"):
        return str(raw["markov_head_type"]).lower()
    if "markov_head.joint_proj.weight" in tensors:
        return "rnn"
    return "gated" if "markov_head.gate_proj.weight" in tensors else "vanilla"


def qwen3_geometry(layer: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 draft-layer fields DSparkConfig stores flat, from any layout that spells them the Qwen3 way."""
    return {
        "hidden_size": int(layer["hidden_size"]),
        "intermediate_size": int(layer["intermediate_size"]),
        "num_hidden_layers": int(layer["num_hidden_layers"]),
        "num_attention_heads": int(layer["num_attention_heads"]),
        "num_key_value_heads": int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        "head_dim": int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 32768)),
        "rope_parameters": rope_parameters_of(layer),
        "hidden_act": layer.get("hidden_act", "silu"),
        "attention_bias": bool(layer.get("attention_bias", False)),
    }


def build_config(layer: dict[str, Any], raw: dict[str, Any], tensors: dict[str, torch.Tensor], **fields) -> DSparkConfig:
    """A DSparkConfig from a Qwen3-style layer description, with the heads inferred from config.json or the tensors;
    `fields` (vocabulary, block, slots, layer ids, ...) are the reader's own and win."""
    markov_rank, confidence, with_markov = infer_heads(raw, tensors, int(layer["hidden_size"]))
    settings = dict(
        **qwen3_geometry(layer),
        markov_rank=markov_rank,
        markov_head_type=markov_head_type_of(raw, tensors, markov_rank),
        enable_confidence_head=confidence,
        confidence_head_with_markov=with_markov,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
    settings.update(fields)
    return DSparkConfig(**settings)


# ----------------------------------------------------------------------------------------------------------------
# Writing the layout


def normalize_dtypes(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating weights to `dtype` (None keeps them); `d2t` int64 and `t2d` bool as vLLM and speculators read them."""
    out = {}
    for name, tensor in tensors.items():
        if name == "d2t":
            out[name] = tensor.to(torch.int64)
        elif name == "t2d":
            out[name] = tensor.to(torch.bool)
        elif dtype is not None and tensor.is_floating_point():
            out[name] = tensor.to(dtype)
        else:
            out[name] = tensor
        out[name] = out[name].contiguous()
    return out


def write_checkpoint(checkpoint: DraftCheckpoint, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the docs/design.md §3 layout with the drafter's own `save_pretrained` (single safetensors file, config.json,
    generation_config.json, both remote-code files), plus `conversion.json` when the source used other conventions.

    The model is assembled on the meta device with the given tensors assigned, so a multi-GiB drafter is never copied.
    """
    directory = Path(directory)
    check_tensors(checkpoint.tensors, checkpoint.config, "checkpoint")
    tensors = normalize_dtypes(checkpoint.tensors, dtype)
    float_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(float_dtypes) == 1:
        checkpoint.config.dtype = next(iter(float_dtypes))
    with torch.device("meta"):
        model = DSparkForDrafting(checkpoint.config)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.save_pretrained(directory, max_shard_size="1000GB")
    if checkpoint.conversion:
        (directory / "conversion.json").write_text(json.dumps(checkpoint.conversion, indent=2, sort_keys=True) + "\n")
    return directory


# ----------------------------------------------------------------------------------------------------------------
# Writing an output directory once: a rerun of the same command finds it finished and leaves it


def write_output(destination: str | Path, write, what: str) -> bool:
    """`write(folder)` into a temporary folder beside `destination`, then renamed into place, so a killed run leaves
    no directory that looks finished. A `destination` that already holds exactly those files is left as it is
    (False: nothing to do, so rerunning a finished `export` or `convert` is a no-op); one that holds anything else is
    refused (`what` names the output in that line)."""
    destination = Path(destination)
    occupied = destination.exists() and (not destination.is_dir() or any(destination.iterdir()))
    if occupied and not (destination / "config.json").is_file():
        raise FileExistsError(f"{destination} is not empty; choose a new output directory.")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.partial-"))
    try:
        write(staging)
        if occupied:
            if _same_files(staging, destination):
                return False
            raise FileExistsError(f"{destination} holds another {what} (other files than this command writes); choose a "
                                  "new output directory, or delete it to write it again.")
        if destination.is_dir():
            destination.rmdir()  # empty
        os.replace(staging, destination)
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _same_files(left: Path, right: Path) -> bool:
    """Whether two folders hold the same file names with the same bytes."""
    names = sorted(str(p.relative_to(left)) for p in left.rglob("*") if p.is_file())
    if names != sorted(str(p.relative_to(right)) for p in right.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(left / name, right / name, shallow=False) for name in names)


__all__ = [
    "BOUND_TENSORS",
    "DraftCheckpoint",
    "build_config",
    "check_tensors",
    "full_vocab_maps",
    "infer_heads",
    "load_tensors",
    "markov_head_type_of",
    "normalize_dtypes",
    "qwen3_geometry",
    "read_json",
    "reject_sliding_layers",
    "rope_parameters_of",
    "strip_wrapper_prefix",
    "write_checkpoint",
    "write_output",
]
