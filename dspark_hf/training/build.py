"""The drafter `dspark-hf train` starts from: fitted to the target from scratch, or warm-started from a checkpoint.

From scratch the config copies the target's geometry (one draft layer by default) and the embedding and LM head
are bound from the target: the drafter's directory holds no copy of them (`bind_target_embeddings`) unless
`--embed-target-copies` asks for one. A warm start reads a DSpark directory as it is and a z-lab DFlash directory through
`formats.zlab` — the same mapping `dspark-hf convert --from zlab-dflash` uses — then adds the Markov and confidence
heads if the checkpoint has none, and grows it (`growth.py`) where the config asks for more layers or a higher Markov
rank. The embedding and LM head stay frozen either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import DSparkConfig, DSparkForDrafting
from ..remote_code.configuration_dspark import SPECIAL_TOKEN_FIELDS
from ..formats.toolkit import DraftCheckpoint, load_tensors
from ..formats.zlab import read_zlab_dflash
from ..targets import load_target_heads, load_target_tokenizer
from ..vocab import full_draft_vocab, load_draft_vocab
from .growth import grow_state

DEFAULT_MARKOV_RANK = 256
# Config keys that describe where a checkpoint came from, not the drafter being trained.
_PROVENANCE_KEYS = ("transformer_layer_config", "speculators_config", "auto_map", "architectures", "model_type",
                    "transformers_version", "_name_or_path", "confidence_temperatures")


def drafter_config_from_target(target, aux_layer_ids: list[int], **overrides) -> DSparkConfig:
    """A DSpark config fitted to `target`: its hidden size, attention geometry and vocab; one draft layer by default."""
    text = target.config.get_text_config()
    heads = text.num_attention_heads
    if overrides.get("mask_token_id") is None:
        overrides["mask_token_id"] = _pad_as_mask_token(text)
    settings = dict(
        hidden_size=text.hidden_size,
        target_hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
        vocab_size=text.vocab_size,
        aux_hidden_state_layer_ids=list(aux_layer_ids),
        target_num_hidden_layers=text.num_hidden_layers,
        block_size=8,
        markov_rank=DEFAULT_MARKOV_RANK,
        enable_confidence_head=True,
        verifier_name_or_path=getattr(target, "name_or_path", None) or target.config.name_or_path,
        verifier_architectures=list(target.config.architectures or []),
        **{name: getattr(text, name, None) for name in SPECIAL_TOKEN_FIELDS},
    )
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        settings["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}
    settings.update(overrides)
    return DSparkConfig(**settings)


def _pad_as_mask_token(text_config) -> int:
    pad, eos = getattr(text_config, "pad_token_id", None), getattr(text_config, "eos_token_id", None)
    if pad is None or pad == eos or (isinstance(eos, list) and pad in eos):
        raise ValueError(
            "the target has no dedicated pad token to use as the drafter's mask token; pass "
            "--mask-token-id (an unused or reserved token id of the target tokenizer)."
        )
    return pad


SPECIAL_ROLES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id")
RESERVED_NAMES = ("mask", "reserved", "unused")


def default_mask_token(tokenizer, target, used_ids: set[int]) -> int:
    """The mask token a new drafter fills its block with: a special token the data never contains.

    In order: the tokenizer's own mask token, else the first special token named reserved/unused/mask, else the
    added special token with the highest id. Never bos/eos/pad/unk/sep/cls (of the tokenizer, the target config or
    its generation config) and never an id in `used_ids` (the training cache's tokens, which holds every end-of-turn
    and template token the data pipeline treats specially).
    """
    excluded = set(used_ids)
    for source in (tokenizer, target.config.get_text_config(), getattr(target, "generation_config", None)):
        for role in SPECIAL_ROLES:
            value = getattr(source, role, None)
            excluded.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    vocab_size = target.config.get_text_config().vocab_size
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id not in excluded:
        return int(tokenizer.mask_token_id)
    added = tokenizer.added_tokens_decoder
    special = sorted(i for i, token in added.items() if token.special and i not in excluded and i < vocab_size)
    reserved = [i for i in special if any(name in added[i].content.lower() for name in RESERVED_NAMES)]
    if reserved or special:
        return (reserved or special[::-1])[0]
    raise ValueError(
        "the target tokenizer has no special token that is not bos/eos/pad/unk and never occurs in the training cache; "
        "pass --mask-token-id (an unused or reserved token id of the target tokenizer)."
    )


def _target_tokenizer(name_or_path: str):
    try:
        return load_target_tokenizer(name_or_path)
    except (OSError, ValueError):
        raise ValueError(
            f"--target {name_or_path} has no tokenizer to choose the drafter's mask token from; pass --mask-token-id "
            "(an unused or reserved token id of the target tokenizer)."
        ) from None


def read_warm_start(source: Path) -> DraftCheckpoint:
    """A z-lab DFlash directory through `formats.zlab` (one mapping with `convert`); a DSpark directory as it is."""
    config_file = source / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--init-from {source} is not a checkpoint directory (no config.json); pass a DSpark or DFlash drafter directory.")
    if "dflash_config" in json.loads(config_file.read_text()):
        return read_zlab_dflash(source)
    tensors = load_tensors(source, f"--init-from {source}")
    return DraftCheckpoint(DSparkConfig.from_pretrained(source), tensors)


def warm_start_config(config: DSparkConfig, overrides: dict[str, Any]) -> DSparkConfig:
    """The checkpoint's config with its provenance dropped, both heads added if absent, and `overrides` applied."""
    settings = {k: v for k, v in config.to_dict().items() if k not in _PROVENANCE_KEYS}
    if not settings.get("markov_rank"):
        settings["markov_rank"] = DEFAULT_MARKOV_RANK
    settings["enable_confidence_head"] = True
    settings.update(overrides)
    return DSparkConfig(**settings)


def _check_shapes(drafter, state: dict[str, torch.Tensor], source: Path) -> None:
    own = drafter.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items() if k in own and v.shape != own[k].shape]
    if wrong:
        raise ValueError(
            f"--init-from {source}: tensor shapes disagree with the drafter config ({'; '.join(wrong[:3])}); "
            "drop the conflicting --drafter overrides or start from scratch."
        )


def _markov_table_to_draft_rows(state: dict[str, torch.Tensor], drafter, t2d: torch.Tensor | None) -> None:
    """A full-vocabulary Markov input table starting a draft-vocabulary one (`markov_input_vocab="draft"`): each draft
    token (`t2d`) keeps its trained row, and the shared row starts as the mean of the others."""
    name = "markov_head.markov_w1.weight"
    table = state.get(name)
    if drafter.config.markov_input_vocab != "draft" or table is None or t2d is None or table.shape[0] != t2d.numel():
        return
    t2d = t2d.bool()
    state[name] = torch.cat([table[t2d], table[~t2d].float().mean(0, keepdim=True).to(table.dtype)])


def _same_draft_vocab(state: dict[str, torch.Tensor], vocab) -> bool:
    """Whether `--draft-vocab` is the checkpoint's own mapping (a continued run), not a new vocabulary."""
    d2t = state.get("d2t")
    return d2t is not None and d2t.shape == vocab[0].shape and torch.equal(d2t.long(), vocab[0].long())


def warm_start(source: Path, overrides: dict[str, Any], vocab, target, log=print) -> DSparkForDrafting:
    """A drafter initialised from `source`; a new draft vocabulary replaces the old head rows and maps."""
    checkpoint = read_warm_start(source)
    drafter = DSparkForDrafting(warm_start_config(checkpoint.config, overrides))
    state = dict(checkpoint.tensors)
    if vocab is not None and _same_draft_vocab(state, vocab):
        vocab = None  # continuing on the checkpoint's own vocabulary: its trained Markov rows stay
    if vocab is not None and checkpoint.config.markov_input_vocab == "draft":
        state.pop("markov_head.markov_w1.weight", None)  # its rows are the old draft vocabulary's
    _markov_table_to_draft_rows(state, drafter, vocab[1] if vocab is not None else state.get("t2d"))
    if vocab is not None:
        for key in ("lm_head.weight", "d2t", "t2d", "markov_head.markov_w2.weight"):
            state.pop(key, None)
    grown = grow_state(state, drafter, source)
    _check_shapes(drafter, state, source)
    missing = set(drafter.load_state_dict(state, strict=False).missing_keys)
    log(f"warm start from {source}: {len(set(state) & set(drafter.state_dict()))} tensors loaded, "
        f"{len(missing)} initialised fresh ({', '.join(sorted(missing)[:6])}{'...' if len(missing) > 6 else ''})"
        + (f"; grown without changing its drafts: {', '.join(grown)}" if grown else ""))
    if vocab is not None:
        drafter.set_draft_vocab(*vocab)
    elif "d2t" not in state and drafter.config.draft_vocab_size == drafter.config.vocab_size:
        drafter.set_draft_vocab(*full_draft_vocab(drafter.config.vocab_size))
    if {"embed_tokens.weight", "lm_head.weight"} & missing or vocab is not None:
        if target is None:
            raise ValueError(
                f"--init-from {source} has no embedding/LM-head copy for this draft vocabulary; pass --target "
                "so they can be copied from the target model."
            )
        drafter.bind_target(target)
    return drafter


def from_scratch(args, target, aux_layer_ids: list[int], overrides: dict[str, Any], vocab, cache=None) -> DSparkForDrafting:
    """A new drafter fitted to `target`, with its embedding and LM-head rows bound from it."""
    if target is None:
        raise ValueError("training from scratch needs --target (the target model directory) to copy its embeddings and LM head.")
    if overrides.get("mask_token_id") is None:
        used = cache.token_ids() if cache is not None else set()
        overrides = {**overrides, "mask_token_id": default_mask_token(_target_tokenizer(args.target), target, used)}
    d2t, t2d = vocab if vocab is not None else full_draft_vocab(target.config.get_text_config().vocab_size)
    drafter = DSparkForDrafting(drafter_config_from_target(target, aux_layer_ids, **{**overrides, "draft_vocab_size": d2t.numel()}))
    drafter.set_draft_vocab(d2t, t2d)
    drafter.bind_target(target)
    return drafter


def build_drafter(args, aux_layer_ids: list[int], log=print, target=None, cache=None) -> DSparkForDrafting:
    """From scratch (embed/head bound from the target, vocab from `load_draft_vocab`, mask token checked against
    `cache`) or a warm start (`--init-from`)."""
    overrides = dict(args.drafter_config)
    vocab = load_draft_vocab(args.draft_vocab) if args.draft_vocab else None
    if vocab is not None:
        overrides["draft_vocab_size"] = vocab[0].numel()
    if target is None and args.target:
        target = load_target_heads(args.target)  # the two tables a drafter copies, not the model
    # New drafters bind embed_tokens/lm_head from the target at attach time unless a runtime needs the copies.
    overrides.setdefault("bind_target_embeddings", not args.embed_target_copies)
    if args.init_from:
        drafter = warm_start(Path(args.init_from), overrides, vocab, target, log)
    else:
        drafter = from_scratch(args, target, aux_layer_ids, overrides, vocab, cache)
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.lm_head.weight.requires_grad_(False)
    return drafter


__all__ = ["DEFAULT_MARKOV_RANK", "build_drafter", "default_mask_token", "drafter_config_from_target", "read_warm_start", "warm_start_config"]
