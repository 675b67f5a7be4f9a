# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Packed verification: a batch round's target forward over only the tokens it verifies (design §4), and the
attention that every batch round and prefill runs.

Remote-code file (imports only torch and transformers). The rows' anchors and verified drafts run end to end as one
sequence (1, Σ_r (l_r + 1)); only attention sees the rows apart: `DSparkPackedCache` stores each layer's new keys and
values in the rows' padded layout (a shorter row's extra columns are holes), and the wrapped SDPA attention function
unpacks the queries, attends per row with the round's 4-D mask, and packs the output again. A packed prefill (each
prompt's own tokens) attends row by row instead, causal over the row's own keys. Every batch round, packed or
padded, runs the query heads that share a key/value head as that head's queries (`_folded_heads`), as transformers
does for plain decoding's single query. Serves a decoder on transformers' "sdpa" attention whose packed forward is
exact (`packs(target)`, tried once per target); others are verified padded. Sliding-window layers get masks of their own, from the rows' own positions
(`windowed_masks`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

PACKED_IMPLEMENTATION = "sdpa"  # the attention implementation whose registered function the packing wraps


class DSparkPacking:
    """Where each verified token of a round sits: row `rows[i]`, slot `slots[i]` (slot 0 is the row's anchor)."""

    def __init__(self, counts: torch.LongTensor, rows_alone: bool = False):  # (a,) drafts verified per row
        self.num_rows, self.width = counts.shape[0], int(counts.max()) + 1
        self.rows_alone = rows_alone  # a prefill: each row attends to its own tokens only (`_rows_alone`)
        self.attended = 0  # attention calls that saw this packing (`serves_packed` counts them)
        slots = torch.arange(self.width, device=counts.device)
        self.valid = slots[None, :] <= counts[:, None]  # (a, W) the verified slots of each row
        self.rows, self.slots = self.valid.nonzero(as_tuple=True)  # (N,) each, row-major

    @functools.cached_property
    def row_spans(self) -> list[tuple[int, int]]:
        """(start, length) of each row's tokens among the packed ones (read by every layer of a prefill: kept)."""
        lengths = self.valid.sum(dim=1)
        return list(zip((lengths.cumsum(0) - lengths).tolist(), lengths.tolist()))

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(a, W, ...) -> (1, N, ...)."""
        return padded[self.rows, self.slots][None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) -> (a, W, ...), zeros at the holes."""
        padded = packed.new_zeros((self.num_rows, self.width, *packed.shape[2:]))
        padded[self.rows, self.slots] = packed[0]
        return padded

    def unpack_heads(self, states: torch.Tensor) -> torch.Tensor:
        """Per-head states (1, h, N, d) -> (a, h, W, d)."""
        return self.unpack(states.transpose(1, 2)).transpose(1, 2)

    def attention_mask(self, cache_mask: torch.Tensor) -> torch.Tensor:
        """The round's 4-D mask (a, 1, W, T + W): slot s of row r sees the row's cached columns (`cache_mask` (a, T))
        and its verified new columns up to s (a hole slot's query, never read, sees the same up to its row's last)."""
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=cache_mask.device).tril()
        new = causal[None] & self.valid[:, None, :]  # (a, W, W)
        cached = cache_mask.bool()[:, None, :].expand(-1, self.width, -1)  # (a, W, T)
        return torch.cat([cached, new], dim=-1)[:, None]

    def windowed_masks(self, cache_mask: torch.Tensor, key_positions: torch.LongTensor,
                       windows: dict[str, int | None]) -> dict[str, torch.Tensor]:
        """The round's mask per attention layer type: `attention_mask`, and in a sliding layer of window n only the
        keys fewer than n of the row's own positions behind each query (`key_positions` (a, T + W), the round's last
        W columns being its queries): a row's holes make column distance no measure of it."""
        mask, queries = self.attention_mask(cache_mask), key_positions[:, -self.width :]
        behind = queries[:, None, :, None] - key_positions[:, None, None, :]  # (a, 1, W, T + W)
        return {kind: mask if window is None else mask & (behind < window) for kind, window in windows.items()}


def attention_windows(target: PreTrainedModel) -> dict[str, int | None]:
    """Each attention layer type of the target and its sliding window (None: full attention)."""
    config = target.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"]
    return {kind: window if kind == "sliding_attention" else None for kind in dict.fromkeys(kinds)}


class DSparkPackedCache(DynamicCache):
    """A `DynamicCache` that, while `packing` is set (one verify forward), stores packed new keys and values in the
    rows' padded layout: every layer's update gets (1, h, N, d) and keeps (a, h, W, d), as a padded round would."""

    packing: DSparkPacking | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.packing is not None:
            key_states, value_states = self.packing.unpack_heads(key_states), self.packing.unpack_heads(value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _OneKeyValueGroup:
    """What transformers' SDPA function reads of an attention module, with one query head per key/value head: the
    folded queries of `_folded_heads` need no copy of the keys and values."""

    num_key_value_groups = 1

    def __init__(self, module):
        self.is_causal = getattr(module, "is_causal", True)


def _folded_heads(original: Callable, module, query, key, value, attention_mask, *args, **kwargs):
    """`original` with the query heads that share a key/value head run as that head's queries (b, kv, groups·q, d).
    transformers folds them so for a single query (plain decoding); with several queries and a mask it copies every
    key and value once per query head, which on a CPU costs a batch round more than its attention does."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, h, q, d = query.shape
    if groups == 1 or q == 1 or attention_mask is None or attention_mask.shape[1] != 1 or kwargs.get("position_bias") is not None:
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    folded = query.reshape(b, h // groups, groups * q, d)
    output, weights = original(_OneKeyValueGroup(module), folded, key, value, attention_mask.repeat(1, 1, groups, 1),
                               *args, **kwargs)  # (b, groups·q, kv, d)
    return output.transpose(1, 2).reshape(b, h, q, d).transpose(1, 2).contiguous(), weights


def _rows_alone(original: Callable, module, query, key, value, packing: DSparkPacking, *args, **kwargs):
    """A packed prefill: each row's queries (1, h, L_r, d) against its own L_r keys, causal and unmasked (an empty
    cache before, full attention), instead of every row as long as the longest under a mask."""
    outputs = [original(module, query[:, :, start : start + length], key[r : r + 1, :, :length],
                        value[r : r + 1, :, :length], None, *args, **kwargs)[0]
               for r, (start, length) in enumerate(packing.row_spans)]
    return torch.cat(outputs, dim=1), None  # (1, N, h, d)


def _batch_round_attention(original: Callable) -> Callable:
    """`original` for every call but a DSpark batch round's (`dspark_batch_round` among the forward's kwargs): its
    query heads folded (`_folded_heads`); packed (`dspark_packing`), the queries (1, h, N, d) unpacked to (a, h, W, d)
    beside the rows' keys and the output (a, W, h, d) packed back to (1, N, h, d), or, a prefill, row by row."""

    @functools.wraps(original)
    def attention(module, query, key, value, attention_mask, *args, dspark_packing: DSparkPacking | None = None,
                  dspark_batch_round: bool = False, **kwargs):
        if dspark_packing is None:
            if not dspark_batch_round:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            return _folded_heads(original, module, query, key, value, attention_mask, *args, **kwargs)
        dspark_packing.attended += 1
        if dspark_packing.rows_alone:
            return _rows_alone(original, module, query, key, value, dspark_packing, *args, **kwargs)
        output, weights = _folded_heads(original, module, dspark_packing.unpack_heads(query), key, value, attention_mask,
                                        *args, **kwargs)
        return dspark_packing.pack(output), weights

    return attention


ATTENTION_VERSION = 2  # 1: packing only (no version mark); 2: folded heads and row-by-row prefills


def install_packed_attention():
    """Wrap the registered SDPA attention once per process (idempotent): a copy of this file finding the newest
    wrapper leaves it, one finding an older copy's (`_dspark_packing` without this version) wraps what that one
    wrapped. Calls without DSpark's kwargs are untouched."""
    installed = ALL_ATTENTION_FUNCTIONS[PACKED_IMPLEMENTATION]
    if getattr(installed, "_dspark_attention_version", 0) >= ATTENTION_VERSION:
        return
    original = installed.__wrapped__ if getattr(installed, "_dspark_packing", False) else installed
    wrapper = _batch_round_attention(original)
    wrapper._dspark_packing, wrapper._dspark_attention_version = True, ATTENTION_VERSION
    AttentionInterface.register(PACKED_IMPLEMENTATION, wrapper)


def packs(target: PreTrainedModel, cache) -> bool:
    """Whether a round of this target can be verified packed: SDPA attention, a packing cache whose layers keep every
    column (the batch loop makes one for every target it serves), and a target whose every layer hands the forward's
    kwargs to that attention (`serves_packed`)."""
    return (target.config._attn_implementation == PACKED_IMPLEMENTATION and isinstance(cache, DSparkPackedCache)
            and all(type(layer) is DynamicLayer for layer in cache.layers) and serves_packed(target))


_SERVES_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> `serves_packed`'s verdict


def serves_packed(target: PreTrainedModel) -> bool:
    """Whether a packed forward of this target is exact, tried once: prompts of one and two tokens packed against the
    same left-padded. Code cannot tell: StableLM and Nemotron drop the kwargs before attention, Falcon calls SDPA
    itself. Every layer that cached packed keys must have attended through the packing, and the logits must agree."""
    if target not in _SERVES_PACKED:
        install_packed_attention()
        at = target.device
        ids, mask = (torch.tensor(rows, device=at) for rows in ([[0, 1], [1, 2]], [[0, 1], [1, 1]]))
        packing, cache = DSparkPacking(mask.sum(1) - 1, rows_alone=True), DSparkPackedCache()
        cache.packing, exact = packing, 1e-4 if target.dtype == torch.float32 else 5e-2
        try:
            with torch.no_grad():
                packed = target(input_ids=ids[mask.bool()][None], position_ids=torch.tensor([[0, 0, 1]], device=at),
                                cache=cache, logits_to_keep=torch.tensor([0, 2], device=at), dspark_packing=packing,
                                dspark_batch_round=True).logits[0].float()
                padded = target(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                                use_cache=False).logits[:, -1].float()
            _SERVES_PACKED[target] = packing.attended == len(cache.layers) > 0 and torch.allclose(packed, padded, exact, exact)
        except (RuntimeError, ValueError, TypeError, IndexError):  # the shapes of rows attended apart: no packing
            _SERVES_PACKED[target] = False
    return _SERVES_PACKED[target]


__all__ = ["DSparkPackedCache", "DSparkPacking", "attention_windows", "install_packed_attention", "packs", "serves_packed"]
