# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""DSpark drafter configuration.

Remote-code file: it is copied next to every checkpoint and imports only torch and transformers.

One `config.json` serves three loaders: transformers (`model_type`, `auto_map`, `vocab_size` = target vocab), the
speculators library and vLLM (`speculators_model_type`, `transformer_layer_config`, `speculators_config`, ...).
The draft geometry is stored flat on the object and mirrored into `transformer_layer_config` when serialized.
"""

from __future__ import annotations

import copy
from typing import Any

import transformers
from packaging.version import Version  # a dependency of transformers
from transformers.utils import logging

# The transformers releases this code was tested on (>= low, < high; fp32 greedy identity checked by tests/test_install.py).
# 5.24 renamed `past_key_values` to `cache`, which this code uses throughout, so an older release is refused; a newer
# one runs with one warning (a drafter on the Hub is loaded by whatever transformers its user has).
TRANSFORMERS_RANGE = ("5.24", "5.25")

# One logger name for every copy of this file (the library's, each checkpoint's): the warning is given once a process.
_version_logger = logging.get_logger("dspark_remote_code")


def check_transformers_version(version: str = transformers.__version__):
    """One line naming the version needed, raised on import, before an older release fails somewhere confusing; one
    warning line for a release newer than the tested range."""
    low, high = TRANSFORMERS_RANGE
    found = Version(Version(version).base_version)
    if found < Version(low):
        raise ImportError(f"dspark drafter remote code needs transformers >={low} (found {version}); "
                          f"pip install 'transformers>={low}'")
    if found >= Version(high):
        _version_logger.warning_once(f"dspark drafter remote code was tested with transformers >={low},<{high} "
                                     f"(found {version}); it runs, but pin 'transformers<{high}' if something breaks.")


check_transformers_version()

from huggingface_hub.dataclasses import strict  # noqa: E402 (after the version check: older releases lack these)
from transformers import PreTrainedConfig, PreTrainedModel  # noqa: E402


# The remote-code files, written once: each checkpoint carries all of them (`save_pretrained` copies every file that
# `drafting_dspark.py` imports; `make sync-remote-code` and the wheel build read this list).
REMOTE_CODE_FILES = (
    "configuration_dspark.py", "drafting_dspark.py", "modeling_dspark.py", "heads_dspark.py",
    "context_cache_dspark.py", "token_choice_dspark.py", "generation_dspark.py", "settings_dspark.py",
    "batching_dspark.py", "batch_rows_dspark.py", "packing_dspark.py", "routing_dspark.py", "scheduling_dspark.py",
    "profiling_dspark.py", "live_profiling_dspark.py",
)

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
MARKOV_INPUT_VOCABS = ("target", "draft")  # which ids index the Markov input table W1

# The auto classes that load a drafter (`auto_map`): AutoModel, and AutoModelForCausalLM as users load assistants.
DRAFTER_AUTO_CLASSES = ("AutoModel", "AutoModelForCausalLM")

DRAFTER_CLASS = "drafting_dspark.DSparkForDrafting"
FORMER_DRAFTER_CLASS = "modeling_dspark.DSparkForDrafting"  # where configs written before the drafting file name it


def drafter_auto_map(auto_map: dict | None) -> dict:
    """`auto_map` with every drafter auto class (AutoModelForCausalLM too: the habit for assistant models) naming the
    same class as AutoModel. A config written when the class lived in `modeling_dspark` names this code's file, since
    this code is what saving it copies (a Hub load prefixes each entry with its repo, kept as it is)."""
    auto_map = dict(auto_map or {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": DRAFTER_CLASS})
    drafter = auto_map.get("AutoModel", DRAFTER_CLASS).replace(FORMER_DRAFTER_CLASS, DRAFTER_CLASS)
    return {**auto_map, **{name: drafter for name in DRAFTER_AUTO_CLASSES}}


# Draft transformer fields that live both flat on the config and inside `transformer_layer_config`.
_GEOMETRY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}

@strict
class DSparkConfig(PreTrainedConfig):
    r"""
    Configuration of a DSpark drafter: a parallel block drafter conditioned on fused target hidden states, with a
    Markov logit-bias head (semi-autoregressive block) and a confidence head (predicted survival of each draft).

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        rms_norm_eps, rope_parameters, max_position_embeddings: the Qwen3-style draft layers. `hidden_size` must
            equal the target's hidden size (the drafter reads the target's embedding table).
        vocab_size (`int`): the **target** vocabulary size (transformers refuses an assistant whose vocab differs).
        draft_vocab_size (`int`): size of the draft vocabulary (rows of `lm_head`); defaults to `vocab_size`.
        block_size (`int`): slots per drafted block (anchor included).
        aux_hidden_state_layer_ids (`list[int]`): target layers fused into the context, in the speculators/vLLM
            convention (index into HF `hidden_states`: 0 = embeddings, k = output of decoder layer k-1).
        target_hidden_size (`int`): hidden size of the target.
        target_num_hidden_layers (`int`, *optional*): depth of the target, used to reject impossible layer ids early.
        mask_token_id (`int`): id filling block slots 1..B-1.
        sample_from_anchor (`bool`): `False` = DFlash/Kimi convention (slot 0 predicts nothing, B-1 drafts);
            `True` = DSpark paper/DeepSpec convention (slot k predicts position p+k+1, B drafts).
        markov_rank (`int`): rank r of the Markov head; 0 disables it.
        markov_head_type (`str`): `vanilla`, `gated` or `rnn`.
        markov_input_vocab (`str`): which ids index the Markov input table W1: `target` (one row per target token,
            the speculators/vLLM layout) or `draft` (one row per draft token plus one shared by every token outside
            the draft vocabulary: a third of the rows for a 16k draft vocabulary; export expands it to `target`).
        enable_confidence_head (`bool`), confidence_head_with_markov (`bool`): the confidence head and whether it
            also reads the Markov embedding of the previous token.
        confidence_temperatures (`list[float]`): per-draft temperatures from Sequential Temperature Scaling (1.0 =
            uncalibrated).
        bind_target_embeddings (`bool`): the checkpoint omits `embed_tokens`/`lm_head`; they are bound from the target
            model at attach time.
    """

    model_type = "dspark"

    # Draft transformer geometry (None = take it from `transformer_layer_config` or the defaults).
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float | None = None
    max_position_embeddings: int | None = None
    rope_parameters: dict | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    # Vocabularies and the block.
    vocab_size: int | None = None
    draft_vocab_size: int | None = None
    block_size: int = 8
    mask_token_id: int | None = None
    sample_from_anchor: bool = False

    # Target coupling.
    aux_hidden_state_layer_ids: list[int] | None = None
    target_hidden_size: int | None = None
    target_num_hidden_layers: int | None = None
    bind_target_embeddings: bool = False
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] | None = None
    # The target tokenizer's special tokens: `pipeline(..., assistant_model=drafter)` shares the target's tokenizer
    # with an assistant only when these and `vocab_size` equal the target's (None in older checkpoints: `attach_to`
    # fills them from the target).
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    # DSpark heads.
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    markov_input_vocab: str = "target"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None

    speculators_model_type: str = "dspark"

    def __post_init__(self, **kwargs):
        # speculators/vLLM layout: geometry nested in `transformer_layer_config`; derived blocks are re-created on save.
        layer_config = kwargs.pop("transformer_layer_config", None) or {}
        self._read_verifier(kwargs.pop("speculators_config", None))
        if "rope_theta" in layer_config and "rope_parameters" not in layer_config:
            layer_config = {**layer_config, "rope_parameters": {"rope_type": "default", "rope_theta": layer_config["rope_theta"]}}
        for name, default in {**_GEOMETRY_DEFAULTS, "rope_parameters": None, "vocab_size": 32000}.items():
            flat, nested = getattr(self, name), layer_config.get(name)
            if flat is not None and nested is not None and flat != nested:
                raise ValueError(
                    f"DSparkConfig: `{name}`={flat} disagrees with transformer_layer_config.{name}={nested}; "
                    "keep one value (the flat field wins on save)."
                )
            setattr(self, name, flat if flat is not None else nested if nested is not None else copy.copy(default))
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 1_000_000.0)}
        self.rope_parameters.setdefault("rope_type", "default")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.aux_hidden_state_layer_ids is None:
            target_layer_ids = kwargs.pop("target_layer_ids", None)  # z-lab / DeepSpec convention
            self.aux_hidden_state_layer_ids = [i + 1 for i in target_layer_ids] if target_layer_ids else [1]
        if self.confidence_temperatures is None:
            self.confidence_temperatures = [1.0] * self.num_draft_tokens
        if self.architectures is None:
            self.architectures = ["DSparkForDrafting"]
        kwargs["auto_map"] = drafter_auto_map(kwargs.pop("auto_map", None))
        super().__post_init__(**kwargs)
        self._check()

    def _read_verifier(self, speculators_config: dict | None):
        """Take the verifier identity from a loaded speculators block (the rest of it is derived on save)."""
        verifier = (speculators_config or {}).get("verifier") or {}
        self.verifier_name_or_path = self.verifier_name_or_path or verifier.get("name_or_path")
        self.verifier_architectures = self.verifier_architectures or verifier.get("architectures") or None

    def _check(self):
        """One clear error per impossible combination (docs/design.md §9): the first (condition, message) that holds is raised."""
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        rank, head_type, inputs = self.markov_rank, self.markov_head_type, self.markov_input_vocab
        vocab, draft_vocab, mask = self.vocab_size, self.draft_vocab_size, self.mask_token_id
        aux_ids, target_layers = self.aux_hidden_state_layer_ids, self.target_num_hidden_layers
        drafts, temperatures = self.num_draft_tokens, self.confidence_temperatures
        checks = (
            (self.hidden_size != self.target_hidden_size,
             f"hidden_size={self.hidden_size} differs from target_hidden_size={self.target_hidden_size}; "
             "the drafter reads the target's embeddings, so set hidden_size to the target's hidden size."),
            (not kv_heads or heads % kv_heads != 0,
             f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; "
             "choose a divisor for the KV heads."),
            (head_type not in MARKOV_HEAD_TYPES,
             f"unknown markov_head_type {head_type!r}; use one of {', '.join(MARKOV_HEAD_TYPES)}."),
            (rank < 0, f"markov_rank={rank} is negative; use 0 to disable the Markov head."),
            (inputs not in MARKOV_INPUT_VOCABS, f"unknown markov_input_vocab {inputs!r}; use one of {', '.join(MARKOV_INPUT_VOCABS)}."),
            (rank == 0 and head_type != "vanilla",
             f"markov_head_type={head_type!r} needs markov_rank > 0; set a rank or use 'vanilla'."),
            (not 1 <= draft_vocab <= vocab,
             f"draft_vocab_size={draft_vocab} is larger than the vocabulary (vocab_size={vocab}); use at most vocab_size."),
            (mask is None or not 0 <= mask < vocab,
             f"mask_token_id={mask} is outside the vocabulary [0, {vocab}); "
             "pick an unused or reserved token id of the target tokenizer."),
            (self.block_size < 2 - int(self.sample_from_anchor),
             f"block_size={self.block_size} drafts no token with sample_from_anchor={self.sample_from_anchor}; "
             "use block_size >= 2."),
            (not aux_ids or min(aux_ids) < 0,
             f"aux_hidden_state_layer_ids={aux_ids} must be non-empty and >= 0 "
             "(speculators convention: 0 = embeddings, k = output of decoder layer k-1)."),
            (target_layers is not None and max(aux_ids, default=0) > target_layers,
             f"aux layer id {max(aux_ids, default=0)} is beyond the target's {target_layers} layers; "
             f"use ids in [0, {target_layers}]."),
            (len(temperatures) != drafts or min(temperatures, default=0) <= 0,
             f"confidence_temperatures needs {drafts} positive values (one per draft), got {temperatures}; "
             "use 1.0 for uncalibrated positions."),
        )
        for message in [message for failed, message in checks if failed][:1]:
            raise ValueError(f"DSparkConfig: {message}")

    # ----------------------------------------------------------------------------------------------------------------
    # Derived views

    @property
    def num_draft_tokens(self) -> int:
        """Drafts per block: B-1 when slot 0 only carries the anchor, B when the anchor slot also predicts."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def target_layer_ids(self) -> list[int]:
        """Decoder-layer indices (z-lab / DeepSpec / transformers-DFlash convention) = aux ids - 1."""
        return [i - 1 for i in self.aux_hidden_state_layer_ids]

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 1_000_000.0))

    def transformer_layer_config(self) -> dict[str, Any]:
        """The Qwen3 config dict speculators and vLLM read for the draft layers."""
        return {
            "model_type": "qwen3",
            **{name: getattr(self, name) for name in _GEOMETRY_DEFAULTS},
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "rope_theta": self.rope_theta,
            "rope_parameters": dict(self.rope_parameters),
            "vocab_size": self.vocab_size,
        }

    def speculators_config(self) -> dict[str, Any]:
        return {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.num_draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": self.verifier_name_or_path, "architectures": self.verifier_architectures or []},
        }

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["transformer_layer_config"] = self.transformer_layer_config()
        output["speculators_config"] = self.speculators_config()
        output["auto_map"] = drafter_auto_map(output.get("auto_map"))  # saving sets AutoModel's alone
        return output


def check_target_compatibility(config: DSparkConfig, target: PreTrainedModel):
    """One clear error per way a drafter cannot serve this target (docs/design.md §9): the first that holds."""
    text_config = target.config.get_text_config()
    hidden, vocab, depth = text_config.hidden_size, text_config.vocab_size, text_config.num_hidden_layers
    deepest, trained_depth = max(config.aux_hidden_state_layer_ids), config.target_num_hidden_layers
    checks = (
        (hidden != config.target_hidden_size, f"expects target hidden size {config.target_hidden_size} but the target "
         f"has {hidden}; use a drafter trained for this target."),
        (vocab != config.vocab_size, f"vocab_size={config.vocab_size} differs from the target's {vocab}; use a drafter "
         "trained for this target's tokenizer."),
        (deepest > depth, f"aux layer id {deepest} is beyond the target's {depth} layers; use "
         f"aux_hidden_state_layer_ids within [0, {depth}]."),
        (trained_depth is not None and trained_depth != depth, f"was trained for a target of {trained_depth} layers "
         f"but this target has {depth}; use a drafter trained for this target (target_num_hidden_layers={depth})."),
    )
    for failed, message in checks:
        if failed:
            raise ValueError(f"DSpark drafter {message}")


SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def adopt_special_tokens(config: DSparkConfig, target: PreTrainedModel, overwrite: bool = False):
    """The target's bos/eos/pad ids on the drafter's config (all of them where `overwrite`, else the unset ones): a
    pipeline hands the drafter the target's tokenizer only when they agree."""
    text_config = target.config.get_text_config()
    for name in SPECIAL_TOKEN_FIELDS:
        if overwrite or getattr(config, name) is None:
            setattr(config, name, getattr(text_config, name, None))


__all__ = ["DSparkConfig", "MARKOV_HEAD_TYPES", "REMOTE_CODE_FILES", "SPECIAL_TOKEN_FIELDS",
           "TRANSFORMERS_RANGE", "adopt_special_tokens", "check_target_compatibility", "check_transformers_version"]
