"""The speculators/vLLM layout (docs/design.md §3), which is also this project's own checkpoint layout.

Reading, checking and writing go through `formats.toolkit`, shared with the z-lab DFlash and DeepSpec importers.

speculators conventions handled here (read from vllm-project/speculators `models/dflash/config.py`,
`models/dflash/core.py`, `models/dspark/{config,core,model_definitions}.py`):

- `transformer_layer_config` is saved with `to_diff_dict()`, so missing keys mean Qwen3Config defaults.
- `aux_hidden_state_layer_ids` already index HF `hidden_states` (0 = embeddings): kept as is.
- `sample_from_anchor` defaults differ per algorithm when the key is absent: `dflash` False, `dspark` True.
- `embed_tokens` is never saved (rebuilt from the verifier); `lm_head` only with a reduced draft vocabulary;
  `verifier_norm`/`verifier_lm_head` are training-time copies of the verifier and are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoConfig

from .toolkit import (
    DraftCheckpoint,
    build_config,
    check_tensors,
    full_vocab_maps,
    load_tensors,
    read_json,
    reject_sliding_layers,
    rope_parameters_of,
    strip_wrapper_prefix,
    write_checkpoint,
)

# Training-only speculators fields: meaningless for inference, recorded as dropped.
_SPECULATORS_TRAINING_KEYS = {
    "num_anchors", "ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha", "loss_decay_gamma",
    "lambda_base_start", "lambda_base_decay_ratio", "auf", "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len",
}


# ----------------------------------------------------------------------------------------------------------------
# Reading speculators `dspark` / `dflash` directories (and this project's own checkpoints)


def read_speculators(directory: str | Path) -> DraftCheckpoint:
    """A speculators DFlash or DSpark directory as a DSpark checkpoint (DFlash = both heads off)."""
    directory = Path(directory)
    what = "speculators checkpoint"
    raw = read_json(directory / "config.json", what)
    algorithm = _convertible_algorithm(raw, what)
    layer = _full_layer_config(raw.get("transformer_layer_config") or {}, what)
    reject_sliding_layers(layer, what)

    sample_default = algorithm == "dspark"  # speculators: DSpark defaults to DeepSpec slots, DFlash to z-lab slots
    sample_from_anchor = bool(raw.get("sample_from_anchor", sample_default))
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    draft_vocab_size = int(raw.get("draft_vocab_size") or layer["vocab_size"])
    tensors, prefix, dropped = _speculators_tensors(directory, draft_vocab_size, layer["vocab_size"], what)
    bind = "embed_tokens.weight" not in tensors
    config = build_config(
        layer, raw, tensors,
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
        confidence_temperatures=raw.get("confidence_temperatures"),
        markov_input_vocab=raw.get("markov_input_vocab", "target"),  # ours only: export writes the `target` table
    )
    if algorithm == "dflash" and (config.markov_rank or config.enable_confidence_head):
        raise ValueError(f"{what}: a 'dflash' checkpoint carries Markov/confidence head tensors; label it 'dspark'.")
    conversion = _conversion_record(raw, algorithm, config, sample_default, prefix, dropped)
    check_tensors(tensors, config, what)
    return DraftCheckpoint(config, tensors, conversion)


def _convertible_algorithm(raw: dict[str, Any], what: str) -> str:
    """`dspark` or `dflash`, refusing other speculators algorithms and the Domino variants with a correction head."""
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
    return algorithm


def _conversion_record(raw: dict[str, Any], algorithm: str, config, sample_default: bool, prefix, dropped) -> dict:
    """What the conversion kept, derived and dropped (`conversion.json` next to the converted checkpoint)."""
    return {
        "source_format": f"speculators-{algorithm}",
        "layer_ids": {
            "source_field": "aux_hidden_state_layer_ids",
            "source_values": list(raw["aux_hidden_state_layer_ids"]),
            "rule": "kept: speculators already index HF hidden_states (0 = embeddings)",
            "aux_hidden_state_layer_ids": config.aux_hidden_state_layer_ids,
        },
        "sample_from_anchor": {
            "value": config.sample_from_anchor,
            "rule": "from config.json" if "sample_from_anchor" in raw
            else f"absent: speculators default for {algorithm} ({sample_default})",
        },
        "heads": {"markov_rank": config.markov_rank, "enable_confidence_head": config.enable_confidence_head},
        "bind_target_embeddings": config.bind_target_embeddings,
        "dropped_tensors": dropped,
        "dropped_config_keys": sorted(_SPECULATORS_TRAINING_KEYS & set(raw)),
        "stripped_prefix": prefix,
    }


def _speculators_tensors(directory: Path, draft_vocab_size: int, vocab_size: int, what: str):
    """(tensors in our names, stripped prefix, dropped tensor names): verifier copies dropped, an identity
    vocabulary added for a full-vocabulary drafter, and a stored head dropped when the embedding is bound."""
    tensors, prefix = strip_wrapper_prefix(load_tensors(directory, what))
    dropped = sorted(name for name in tensors if name.startswith(("verifier_norm.", "verifier_lm_head.")))
    for name in dropped:
        tensors.pop(name)
    if "d2t" not in tensors and "t2d" not in tensors and draft_vocab_size == vocab_size:
        tensors.update(full_vocab_maps(vocab_size))
    if "embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
        # Our drafter binds embed and head together from the target; the stored head is those same frozen rows.
        dropped.append("lm_head.weight")
        tensors.pop("lm_head.weight")
    return tensors, prefix, dropped


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


__all__ = ["DraftCheckpoint", "read_speculators", "write_checkpoint"]
