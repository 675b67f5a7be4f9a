# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""The drafter's context cache: per-layer K/V of the committed positions, the rows a block's attention reads.

Remote-code file (imports only torch and transformers). `DSparkForDrafting.extend_context` fills it; the batch loop
also keeps its rows and columns aligned with the target's cache (`batch_rows_dspark.py`).
"""

from __future__ import annotations

import torch


class DSparkContextCache:
    """Per-layer K/V of the committed context, computed once per position. The drafted block is never stored."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        if layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=2)

    def crop(self, max_length: int):
        """Keep the first `max_length` context positions (e.g. to reuse a prefix)."""
        self.keys = [k[:, :, :max_length] for k in self.keys]
        self.values = [v[:, :, :max_length] for v in self.values]

    def select_rows(self, rows: torch.LongTensor):
        """Keep only these batch rows (a batch whose other rows finished)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]

    def gather_columns(self, columns: torch.LongTensor):
        """Row b keeps columns[b] (b, t') in that order: a batch's ragged context compacted."""
        index = columns[:, None, :, None]
        self.keys = [k.gather(2, index.expand(-1, k.shape[1], -1, k.shape[3])) for k in self.keys]
        self.values = [v.gather(2, index.expand(-1, v.shape[1], -1, v.shape[3])) for v in self.values]

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    def __iter__(self):
        """Per-layer (keys, values), the form the block pass reads context K/V in."""
        return zip(self.keys, self.values)


__all__ = ["DSparkContextCache"]
