"""Published drafters' exact configurations, for building a drafter like one of them (`preset_config`).

A checkpoint never needs them to load or run, so they live in the library, not in the remote code.
"""

from __future__ import annotations

import copy
from typing import Any

from .remote_code.configuration_dspark import DSparkConfig

# The published Kimi-K2.6 DSpark drafter (novita/kimi-k2.6-dspark), reproduced tensor for tensor.
PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k2.6": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 3,
        "num_attention_heads": 56,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "max_position_embeddings": 20000,
        "vocab_size": 163840,
        "draft_vocab_size": 32000,
        "block_size": 8,
        "sample_from_anchor": False,
        "aux_hidden_state_layer_ids": [1, 29, 57],
        "target_hidden_size": 7168,
        "target_num_hidden_layers": 61,
        "mask_token_id": 163608,
        "markov_rank": 256,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "verifier_name_or_path": "moonshotai/Kimi-K2.6",
        "verifier_architectures": ["DeepseekV3ForCausalLM"],
        "dtype": "bfloat16",
    },
}


def preset_config(name: str, **overrides) -> DSparkConfig:
    """A published drafter's exact configuration, e.g. `preset_config("kimi-k2.6")`."""
    if name not in PRESETS:
        raise ValueError(f"unknown DSpark preset {name!r}; available: {', '.join(PRESETS)}.")
    return DSparkConfig(**{**copy.deepcopy(PRESETS[name]), **overrides})


__all__ = ["PRESETS", "preset_config"]
