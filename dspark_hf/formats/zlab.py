"""z-lab DFlash checkpoints (github.com/z-lab/dflash) as DSpark drafters with both heads off.

Layout read from z-lab/dflash `dflash/model.py` (`DFlashDraftModel`, `_draft_value`, `extract_context_feature`) and
`model/dflash.py` (the first release):

- config.json is a Qwen3 config (geometry top level, `vocab_size` = target vocab) plus `block_size` and
  `dflash_config {mask_token_id, target_layer_ids}`; newer releases may also put `block_size` inside `dflash_config`
  (it wins, as in `_draft_value`).
- `target_layer_ids` index decoder-layer outputs: context features are `hidden_states[i + 1]`, so
  aux = target_layer_ids + 1 (docs/design.md §3).
- Slot 0 holds the anchor and predicts nothing; slots 1..B-1 draft (`[:, 1 - B:]`): `sample_from_anchor = False`.
- Tensors: `layers.*`, `fc`, `hidden_norm`, `norm` only; embeddings and LM head are the target's (full vocabulary).
- Not convertible exactly: sliding/causal draft layers, an input-embedding scale, logit multipliers or softcapping,
  DFlash2 (`candidate_selector`, per-layer convolutions) and the `muse_glimmer_assistant` layout (`encoder.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .toolkit import (
    DraftCheckpoint,
    build_config,
    check_tensors,
    full_vocab_maps,
    load_tensors,
    read_json,
    reject_sliding_layers,
    strip_wrapper_prefix,
)

WHAT = "z-lab DFlash checkpoint"


def read_zlab_dflash(directory: str | Path) -> DraftCheckpoint:
    """A z-lab DFlash directory as a DSpark checkpoint (heads off, full vocabulary, embed/head bound from the target)."""
    directory = Path(directory)
    raw = read_json(directory / "config.json", WHAT)
    _check_convertible(raw)
    target_layer_ids = _dflash_value(raw, "target_layer_ids")
    tensors, prefix = strip_wrapper_prefix(load_tensors(directory, WHAT))
    vocab_size = int(raw["vocab_size"])
    tensors.update(full_vocab_maps(vocab_size))
    hidden_size = int(raw["hidden_size"])
    config = build_config(
        raw, raw, tensors,
        vocab_size=vocab_size,
        draft_vocab_size=vocab_size,
        block_size=int(_dflash_value(raw, "block_size", 16)),  # z-lab's default when absent
        mask_token_id=int(_dflash_value(raw, "mask_token_id")),
        sample_from_anchor=False,
        aux_hidden_state_layer_ids=[int(i) + 1 for i in target_layer_ids],
        target_hidden_size=hidden_size,
        target_num_hidden_layers=_dflash_value(raw, "num_target_layers"),
        bind_target_embeddings=True,
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )
    check_tensors(tensors, config, WHAT)
    conversion = _conversion_record(raw, target_layer_ids, config, prefix)
    return DraftCheckpoint(config, tensors, conversion)


def _dflash_value(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """A setting in z-lab's lookup order (`_draft_value`): `dflash_config` first, then the top level."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def _check_convertible(raw: dict[str, Any]) -> None:
    """Refuse what has no exact DSpark equivalent, and a config missing the layer ids or the mask token."""
    if raw.get("model_type") == "muse_glimmer_assistant":
        raise ValueError(
            f"{WHAT}: model_type 'muse_glimmer_assistant' is transformers' built-in DFlash drafter (encoder.* tensors); "
            "load it with transformers and generate(..., speculation_type='dflash') instead of converting."
        )
    if not _dflash_value(raw, "target_layer_ids"):
        raise ValueError(f"{WHAT}: config.json has no dflash_config.target_layer_ids; add the target layers it was trained on.")
    if _dflash_value(raw, "mask_token_id") is None:
        raise ValueError(f"{WHAT}: config.json has no dflash_config.mask_token_id; add the mask token id it was trained with.")
    reject_sliding_layers(raw, WHAT)
    for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0.0)):
        value = _dflash_value(raw, name)
        if value is not None and float(value) != neutral:
            raise ValueError(f"{WHAT}: {name}={value} has no DSpark equivalent; only unscaled DFlash drafters convert exactly.")


def _conversion_record(raw: dict[str, Any], target_layer_ids: list[int], config, prefix) -> dict[str, Any]:
    """What the conversion kept, derived and dropped (`conversion.json` next to the converted checkpoint)."""
    return {
        "source_format": "zlab-dflash",
        "source_architectures": raw.get("architectures"),
        "layer_ids": {
            "source_field": "dflash_config.target_layer_ids",
            "source_values": list(target_layer_ids),
            "rule": "aux = target_layer_ids + 1 (z-lab reads hidden_states[i + 1])",
            "aux_hidden_state_layer_ids": config.aux_hidden_state_layer_ids,
        },
        "sample_from_anchor": {"value": False, "rule": "z-lab: slot 0 is the anchor, slots 1..B-1 draft"},
        "heads": {"markov_rank": 0, "enable_confidence_head": False, "rule": "DFlash has neither head"},
        "vocabulary": "full target vocabulary (identity d2t/t2d); embed_tokens/lm_head bound from the target",
        "bind_target_embeddings": True,
        "dropped_tensors": [],
        "stripped_prefix": prefix,
    }


__all__ = ["read_zlab_dflash"]
