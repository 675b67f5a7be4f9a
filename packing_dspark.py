# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Packed verification: a batch round's target forward over only the tokens it verifies (design §4).

Remote-code file (imports only torch and transformers). The rows' anchors and verified drafts run end to end as one
sequence (1, Σ_r (l_r + 1)); only attention sees the rows apart: `DSparkPackedCache` stores each layer's new keys and
values in the rows' padded layout (a shorter row's extra columns are holes), and the wrapped SDPA attention function
unpacks the queries, attends per row with the round's 4-D mask, and packs the output again. Serves any decoder on
transformers' "sdpa" attention (`packs(target)`); others are verified padded. Sliding-window layers get masks of
their own, from the rows' own positions (`windowed_masks`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

PACKED_IMPLEMENTATION = "sdpa"  # the attention implementation whose registered function the packing wraps


class DSparkPacking:
    """Where each verified token of a round sits: row `rows[i]`, slot `slots[i]` (slot 0 is the row's anchor)."""

    def __init__(self, counts: torch.LongTensor):  # (a,) drafts verified per row
        self.num_rows, self.width = counts.shape[0], int(counts.max()) + 1
        slots = torch.arange(self.width, device=counts.device)
        self.valid = slots[None, :] <= counts[:, None]  # (a, W) the verified slots of each row
        self.rows, self.slots = self.valid.nonzero(as_tuple=True)  # (N,) each, row-major

    @property
    def num_tokens(self) -> int:
        return int(self.rows.shape[0])

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


def _packed_attention(original: Callable) -> Callable:
    """`original` for every call, but for a packed round's (`dspark_packing` among the forward's kwargs): queries
    (1, h, N, d) unpacked to (a, h, W, d) beside the rows' keys, the output (a, W, h, d) packed back to (1, N, h, d)."""

    @functools.wraps(original)
    def attention(module, query, key, value, attention_mask, *args, dspark_packing: DSparkPacking | None = None, **kwargs):
        if dspark_packing is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        output, weights = original(module, dspark_packing.unpack_heads(query), key, value, attention_mask, *args, **kwargs)
        return dspark_packing.pack(output), weights

    return attention


def install_packed_attention():
    """Wrap the registered SDPA attention once per process, whichever copy of this file comes first (idempotent: the
    wrapper is marked, and a copy finding it marked leaves it); calls without `dspark_packing` are untouched."""
    original = ALL_ATTENTION_FUNCTIONS[PACKED_IMPLEMENTATION]
    if not getattr(original, "_dspark_packing", False):
        wrapper = _packed_attention(original)
        wrapper._dspark_packing = True
        AttentionInterface.register(PACKED_IMPLEMENTATION, wrapper)


def packs(target: PreTrainedModel, cache) -> bool:
    """Whether a round of this target can be verified packed: SDPA attention, and a packing cache whose layers keep
    every column (the batch loop makes one for every target it serves)."""
    return (target.config._attn_implementation == PACKED_IMPLEMENTATION and isinstance(cache, DSparkPackedCache)
            and all(type(layer) is DynamicLayer for layer in cache.layers))


__all__ = ["DSparkPackedCache", "DSparkPacking", "attention_windows", "install_packed_attention", "packs"]
