"""DeepSpec dense DSpark/DFlash checkpoints (github.com/deepseek-ai/DeepSpec, `Qwen3DSparkModel`) as DSpark drafters.

Layout read from deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/{config,modeling}.py` and `common.py`:

- config.json is a deep copy of the target's Qwen3 config with the draft depth in `num_hidden_layers`, plus
  `architectures: ["Qwen3DSparkModel"]`, `num_target_layers`, `block_size`, `mask_token_id`, `target_layer_ids`,
  `num_anchors` (training only), `enable_confidence_head`, `confidence_head_with_markov` (only written when the
  confidence head is on), `markov_rank`, `markov_head_type` (only written when the rank is > 0). A DeepSpec
  "DFlash" is the same model with `markov_rank = 0` and the confidence head off.
- `target_layer_ids` index decoder-layer outputs, with -1 for the embeddings (`hidden_states[0 if i == -1 else
  i + 1]`): aux = target_layer_ids + 1 in both cases (docs/design.md §3).
- Every slot drafts: slot k predicts position p+k+1 (labels at `anchor + 1..B`), previous token of slot 0 is the
  anchor: `sample_from_anchor = True`.
- Dense: `embed_tokens` [V, d] and `lm_head` [V, d] over the full vocabulary are in the checkpoint (frozen target
  copies), Markov `W2` is [V, r]; names `markov_head.markov_w1/markov_w2/gate_proj/joint_proj`,
  `confidence_head.proj` are already this project's.
- DeepSpec's L1 loss is 2x our TV; that only matters for training, not for the weights.
"""

from __future__ import annotations

from pathlib import Path

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

WHAT = "DeepSpec checkpoint"
TRAINING_ONLY_KEYS = ("num_anchors", "_attn_implementation")


def read_deepspec(directory: str | Path) -> DraftCheckpoint:
    """A DeepSpec `Qwen3DSparkModel` directory as a DSpark checkpoint (full vocabulary, embed/head kept)."""
    directory = Path(directory)
    raw = read_json(directory / "config.json", WHAT)
    architectures = raw.get("architectures") or []
    if architectures and architectures != ["Qwen3DSparkModel"]:
        raise ValueError(
            f"{WHAT}: architectures={architectures}; only Qwen3DSparkModel (Qwen3-style draft layers) converts exactly."
        )
    for name in ("target_layer_ids", "mask_token_id", "block_size"):
        if raw.get(name) is None:
            raise ValueError(f"{WHAT}: config.json has no {name}; use the config.json DeepSpec saved with the weights.")
    reject_sliding_layers(raw, WHAT)

    tensors, prefix = strip_wrapper_prefix(load_tensors(directory, WHAT))
    vocab_size = int(raw["vocab_size"])
    tensors.update(full_vocab_maps(vocab_size))
    hidden_size = int(raw["hidden_size"])
    target_layer_ids = [int(i) for i in raw["target_layer_ids"]]
    config = build_config(
        raw, raw, tensors,
        vocab_size=vocab_size,
        draft_vocab_size=vocab_size,
        block_size=int(raw["block_size"]),
        mask_token_id=int(raw["mask_token_id"]),
        sample_from_anchor=bool(raw.get("sample_from_anchor", True)),
        aux_hidden_state_layer_ids=[i + 1 for i in target_layer_ids],
        target_hidden_size=hidden_size,
        target_num_hidden_layers=raw.get("num_target_layers"),
        bind_target_embeddings=False,
    )
    check_tensors(tensors, config, WHAT)
    conversion = {
        "source_format": "deepspec",
        "source_architectures": architectures,
        "layer_ids": {
            "source_field": "target_layer_ids",
            "source_values": target_layer_ids,
            "rule": "aux = target_layer_ids + 1 (DeepSpec reads hidden_states[i + 1]; -1 = embeddings -> 0)",
            "aux_hidden_state_layer_ids": config.aux_hidden_state_layer_ids,
        },
        "sample_from_anchor": {
            "value": config.sample_from_anchor,
            "rule": "from config.json" if "sample_from_anchor" in raw
            else "DeepSpec: every slot drafts, slot k predicts position p+k+1",
        },
        "heads": {
            "markov_rank": config.markov_rank,
            "markov_head_type": config.markov_head_type,
            "enable_confidence_head": config.enable_confidence_head,
            "confidence_head_with_markov": config.confidence_head_with_markov,
        },
        "vocabulary": "full target vocabulary (identity d2t/t2d); embed_tokens/lm_head kept from the checkpoint",
        "bind_target_embeddings": False,
        "dropped_tensors": [],
        "dropped_config_keys": sorted(k for k in TRAINING_ONLY_KEYS if k in raw),
        "stripped_prefix": prefix,
    }
    return DraftCheckpoint(config, tensors, conversion)


__all__ = ["read_deepspec"]
