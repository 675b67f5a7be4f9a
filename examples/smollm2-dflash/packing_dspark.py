# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Packed verification: a batch round's target forward over only the tokens it verifies.

Remote-code file (imports only torch and transformers). A padded round verifies B × (w + 1) tokens through every
projection, MLP and the LM head, so every row pays for the widest. A packed round lays the rows' anchors and verified
drafts end to end as one sequence (1, N), N = Σ_r (l_r + 1), each token at its own row's position, and only attention
sees the rows apart: the cache (`DSparkPackedCache`) unpacks each layer's new keys and values to the rows' padded
layout (a, kv heads, W, d) before storing them (W = the widest row's l_r + 1; a shorter row's extra columns are holes,
masked like a rejected draft's), and the attention function, wrapped around transformers' registered SDPA
implementation, unpacks the queries the same way, attends with the round's 4-D mask (exact per row over that row's
own cache) and packs the output again. Embeddings, norms, projections, MLP and the LM head run over N tokens.

This serves any decoder that goes through transformers' attention interface with the "sdpa" implementation and a
full-attention `DynamicCache` (`packs(target)`); the batch loop verifies padded otherwise, and its stats say so.
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
    """Whether a round of this target can be verified packed: SDPA attention, and a packing cache of full-attention
    layers only (the batch loop makes one for every target it serves)."""
    return (target.config._attn_implementation == PACKED_IMPLEMENTATION and isinstance(cache, DSparkPackedCache)
            and all(type(layer) is DynamicLayer for layer in cache.layers))


__all__ = ["DSparkPackedCache", "DSparkPacking", "install_packed_attention", "packs"]
