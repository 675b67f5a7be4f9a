"""The speculators/vLLM layout (DESIGN §3), which is also this project's own checkpoint layout.

Why one module for reading, checking and writing: the other importers (z-lab DFlash, DeepSpec) translate their
checkpoints into a `DraftCheckpoint` and then go through the same shape check and the same writer, so every
converted or exported directory is byte-for-byte the layout that `save_pretrained`, speculators and vLLM read.

speculators conventions handled here (read from vllm-project/speculators `models/dflash/config.py`,
`models/dflash/core.py`, `models/dspark/{config,core,model_definitions}.py`):

- `transformer_layer_config` is saved with `to_diff_dict()`, so missing keys mean Qwen3Config defaults.
- `aux_hidden_state_layer_ids` already index HF `hidden_states` (0 = embeddings): kept as is.
- `sample_from_anchor` defaults differ per algorithm when the key is absent: `dflash` False, `dspark` True.
- `embed_tokens` is never saved (rebuilt from the verifier); `lm_head` only with a reduced draft vocabulary;
  `verifier_norm`/`verifier_lm_head` are training-time copies of the verifier and are dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from ..remote_code.configuration_dspark import DSparkConfig
from ..remote_code.modeling_dspark import DSparkForDrafting, expected_tensor_shapes

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
    (r"markov_w1\.", "[vocab_size, markov_rank]"),
    (r"markov_w2\.", "[draft_vocab_size, markov_rank]"),
    (r"gate_proj\.", "[markov_rank, hidden_size + markov_rank]"),
    (r"joint_proj\.", "[3 × markov_rank, 2 × markov_rank + hidden_size]"),
    (r"^confidence_head\.", "[1, hidden_size (+ markov_rank with confidence_head_with_markov)]"),
    (r"norm\.weight$", "[hidden_size]"),
)

# Training-only speculators fields: meaningless for inference, recorded as dropped.
_SPECULATORS_TRAINING_KEYS = {
    "num_anchors", "ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha", "loss_decay_gamma",
    "lambda_base_start", "lambda_base_decay_ratio", "auf", "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len",
}


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
    return {"d2t": torch.zeros(vocab_size, dtype=torch.int64), "t2d": torch.ones(vocab_size, dtype=torch.bool)}


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
    return next((hint for pattern, hint in _SHAPE_HINTS if re.search(pattern, name)), "see DESIGN §3")


def check_tensors(tensors: dict[str, torch.Tensor], config: DSparkConfig, what: str):
    """One clear error for an unknown, missing or wrong-shaped tensor (DESIGN §9), before anything is written."""
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


# ----------------------------------------------------------------------------------------------------------------
# Reading speculators `dspark` / `dflash` directories (and this project's own checkpoints)


def read_speculators(directory: str | Path) -> DraftCheckpoint:
    """A speculators DFlash or DSpark directory as a DSpark checkpoint (DFlash = both heads off)."""
    directory = Path(directory)
    what = "speculators checkpoint"
    raw = read_json(directory / "config.json", what)
    algorithm = raw.get("speculators_model_type") or (raw.get("speculators_config") or {}).get("algorithm")
    if algorithm not in ("dspark", "dflash"):
        raise ValueError(
            f"{what}: speculators_model_type={algorithm!r}; only 'dspark' and 'dflash' drafters can be converted."
        )
    if raw.get("projector_type", "dflash") != "dflash" or raw.get("shift_label"):
        raise ValueError(
            f"{what}: projector_type={raw.get('projector_type')!r}/shift_label={raw.get('shift_label')} is a Domino "
            "variant with a correction head; only plain DFlash/DSpark drafters can be converted."
        )
    layer = _full_layer_config(raw.get("transformer_layer_config") or {}, what)
    reject_sliding_layers(layer, what)

    sample_default = algorithm == "dspark"  # speculators: DSpark defaults to DeepSpec slots, DFlash to z-lab slots
    sample_from_anchor = bool(raw.get("sample_from_anchor", sample_default))
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    draft_vocab_size = int(raw.get("draft_vocab_size") or layer["vocab_size"])

    tensors, prefix = strip_wrapper_prefix(load_tensors(directory, what))
    dropped = sorted(name for name in tensors if name.startswith(("verifier_norm.", "verifier_lm_head.")))
    for name in dropped:
        tensors.pop(name)
    if "d2t" not in tensors and "t2d" not in tensors and draft_vocab_size == layer["vocab_size"]:
        tensors.update(full_vocab_maps(layer["vocab_size"]))
    bind = "embed_tokens.weight" not in tensors
    if bind and "lm_head.weight" in tensors:
        # Our drafter binds embed and head together from the target; the stored head is those same frozen rows.
        dropped.append("lm_head.weight")
        tensors.pop("lm_head.weight")

    markov_rank, confidence, with_markov = infer_heads(raw, tensors, layer["hidden_size"])
    if algorithm == "dflash" and (markov_rank or confidence):
        raise ValueError(f"{what}: a 'dflash' checkpoint carries Markov/confidence head tensors; label it 'dspark'.")
    config = DSparkConfig(
        **qwen3_geometry(layer),
        vocab_size=layer["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        block_size=int(raw.get("block_size", 8)),
        mask_token_id=raw.get("mask_token_id"),
        sample_from_anchor=sample_from_anchor,
        aux_hidden_state_layer_ids=list(raw["aux_hidden_state_layer_ids"]),
        target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
        target_num_hidden_layers=raw.get("target_num_hidden_layers"),
        bind_target_embeddings=bind,
        verifier_name_or_path=verifier.get("name_or_path"),
        verifier_architectures=verifier.get("architectures") or None,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type_of(raw, tensors, markov_rank),
        enable_confidence_head=confidence,
        confidence_head_with_markov=with_markov,
        confidence_temperatures=raw.get("confidence_temperatures"),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
    conversion = {
        "source_format": f"speculators-{algorithm}",
        "layer_ids": {
            "source_field": "aux_hidden_state_layer_ids",
            "source_values": list(raw["aux_hidden_state_layer_ids"]),
            "rule": "kept: speculators already index HF hidden_states (0 = embeddings)",
            "aux_hidden_state_layer_ids": config.aux_hidden_state_layer_ids,
        },
        "sample_from_anchor": {
            "value": sample_from_anchor,
            "rule": "from config.json" if "sample_from_anchor" in raw
            else f"absent: speculators default for {algorithm} ({sample_default})",
        },
        "heads": {"markov_rank": config.markov_rank, "enable_confidence_head": config.enable_confidence_head},
        "bind_target_embeddings": bind,
        "dropped_tensors": dropped,
        "dropped_config_keys": sorted(_SPECULATORS_TRAINING_KEYS & set(raw)),
        "stripped_prefix": prefix,
    }
    check_tensors(tensors, config, what)
    return DraftCheckpoint(config, tensors, conversion)


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


def _full_layer_config(layer_config: dict[str, Any], what: str) -> dict[str, Any]:
    """speculators saves `transformer_layer_config` as a diff against the model type's defaults: fill them back in."""
    model_type = layer_config.get("model_type", "qwen3")
    try:
        full = AutoConfig.for_model(model_type, **{k: v for k, v in layer_config.items() if k != "model_type"})
    except ValueError as error:
        raise ValueError(f"{what}: transformer_layer_config.model_type={model_type!r} is unknown ({error}).") from None
    values = full.to_dict()
    values.setdefault("head_dim", full.hidden_size // full.num_attention_heads)
    values["rope_parameters"] = rope_parameters_of(values)
    return values


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
    """Write the DESIGN §3 layout with the drafter's own `save_pretrained` (single safetensors file, config.json,
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


__all__ = [
    "BOUND_TENSORS",
    "DraftCheckpoint",
    "check_tensors",
    "full_vocab_maps",
    "infer_heads",
    "load_tensors",
    "markov_head_type_of",
    "normalize_dtypes",
    "read_speculators",
    "write_checkpoint",
]
