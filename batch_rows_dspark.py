# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""What a batched generate call keeps per row: the rows still generating with the layout of their caches, every
row's ids as plain batched `generate` holds them, and the scores and logits a call asks for.

Remote-code file (imports only torch and transformers); the batch loop (`batching_dspark.py`) drives them.
"""

from __future__ import annotations

import torch

COMPACT_WHEN_WASTED = 0.15  # compact the caches once this share of their columns are holes


class DSparkBatchRows:
    """The rows still generating and the layout of their caches: column t of the target's cache and of the drafter's
    context cache is the same token of the same row; `mask` (a, T) says which columns each row really has."""

    def __init__(self, rows: torch.LongTensor, mask: torch.LongTensor, target_cache, drafter_cache):
        self.rows = rows  # (a,) batch index of each active row
        self.mask = mask  # (a, T) 1 = a committed token of that row
        self.target_cache, self.drafter_cache = target_cache, drafter_cache
        self.next_position = mask.sum(dim=1)  # (a,) the anchor's position: tokens committed before it
        self.anchor = None  # (a,) the last committed token, not yet in the target's cache
        # (aux hidden states (a, n, m·d), positions (a, n)) of the target cache's last columns that the drafter's
        # context does not hold yet: rounds the drafter rests add them, the next round it runs takes them at once
        self.pending_context: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, keep: torch.Tensor):
        """Drop the rows where `keep` (a,) is False: finished rows cost no more work."""
        index = keep.nonzero().squeeze(1)
        self.rows, self.mask, self.next_position = self.rows[index], self.mask[index], self.next_position[index]
        self.anchor = self.anchor[index]
        self.pending_context = [(aux[index], positions[index]) for aux, positions in self.pending_context]
        self.target_cache.batch_select_indices(index)
        self.drafter_cache.select_rows(index)

    def tidy(self, catch_up):
        """Crop the trailing columns no row needs; compact when holes fill COMPACT_WHEN_WASTED of the columns.
        `catch_up()` first brings the drafter's context level with the target's cache where columns move."""
        if not self.rows.numel():
            return
        used = self.mask.any(dim=0)
        trailing = int(used.shape[0] - (used.nonzero().max() + 1)) if used.any() else 0
        width, longest = self.mask.shape[1] - trailing, int(self.mask.sum(dim=1).max())
        compact = width - longest > COMPACT_WHEN_WASTED * width
        if trailing or compact:
            catch_up()
        if trailing:
            self.target_cache.crop(-trailing)
            self.drafter_cache.crop(width)
            self.mask = self.mask[:, :width]
        if compact:
            self._compact(longest)

    def _compact(self, width: int):
        """Move every row's valid columns to the right end of `width` columns (left padding again), in both caches."""
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, -width:]  # (a, width) holes first, then tokens
        for layer in self.target_cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.drafter_cache.gather_columns(order)
        self.mask = self.mask.gather(1, order)


class DSparkBatchIds:
    """Every row's ids as plain batched `generate` holds them (its padded prompt, then its tokens) in one tensor, row r
    at index r. Processors and stopping criteria are called on `columns(n)`, the whole batch's first n ids, exactly as
    plain generate calls them once its rows are n long: a processor that reads a row's batch index
    (`prefix_allowed_tokens_fn`) or holds state per row (the repetition penalty's padding lengths) needs the whole
    batch in its order. Only the rows that are n long read what that call returns. A call per length, not per row
    and slot, and a view, not a copy, keeps ids-reading processors affordable."""

    def __init__(self, prompt: torch.LongTensor):
        self.prompt_length = prompt.shape[1]
        self.tokens = prompt.clone()
        self.lengths = [self.prompt_length] * prompt.shape[0]

    def lengths_of(self, rows: torch.LongTensor) -> torch.LongTensor:
        """How many ids each of `rows` holds (a,)."""
        return torch.tensor([self.lengths[r] for r in rows.tolist()], device=rows.device)

    def sequence(self, row: int) -> torch.LongTensor:
        """Row `row` as plain batched generate holds it: its padded prompt and every token committed since."""
        return self.tokens[row, : self.lengths[row]]

    def columns(self, length: int) -> torch.LongTensor:
        return self.tokens[:, :length]

    def append(self, rows: list[int], tokens: list[list[int]]):
        """Each of `rows` gets its new `tokens` after its own, in one write for the whole batch."""
        at = torch.tensor([(row, self.lengths[row] + j) for row, new in zip(rows, tokens) for j in range(len(new))]).T
        self._reserve(int(at[1].max()) + 1)
        self.tokens[at[0], at[1]] = self.tokens.new_tensor([t for new in tokens for t in new])
        for row, new in zip(rows, tokens):
            self.lengths[row] += len(new)

    def stage(self, rows: torch.LongTensor, drafts: torch.LongTensor):
        """Write each row's drafts (a, w) after its tokens without counting them: slot j then reads the row's tokens
        and its first j drafts as `columns(length + j)`."""
        starts = self.lengths_of(rows)
        self._reserve(int(starts.max()) + drafts.shape[1])
        self.tokens[rows[:, None], starts[:, None] + torch.arange(drafts.shape[1], device=starts.device)] = drafts

    def _reserve(self, length: int):
        if length > self.tokens.shape[1]:
            more = max(length, 2 * self.tokens.shape[1]) - self.tokens.shape[1]
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros((self.tokens.shape[0], more))], dim=1)


class DSparkBatchScores:
    """What `output_scores` / `output_logits` return for a batch, as plain batched `generate` does: per generated step
    a (batch, V) tensor holding, for each row, what the target computed for the token that row committed there (the
    processed scores or the raw logits, fp32). A row that has finished gets a filler at the later steps: -inf except
    0 at the pad token, so `compute_transition_scores` gives its padding 0 (normalized or not) where plain generate
    gives the scores of a pad token it fed (which mean nothing)."""

    def __init__(self, batch_size: int):
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]  # per row: (n, V) per round
        self.kept = [0] * batch_size  # steps of each row that are real

    def append(self, row: int, chunk: torch.Tensor):
        self.chunks[row].append(chunk)
        self.kept[row] += chunk.shape[0]

    def truncate(self, row: int, steps: int):
        self.kept[row] = min(self.kept[row], steps)

    def steps(self, num_steps: int, pad_token_id: int) -> tuple[torch.Tensor, ...]:
        rows = [torch.cat(chunks)[: min(kept, num_steps)] for chunks, kept in zip(self.chunks, self.kept)]
        filler = torch.full_like(rows[0][0], float("-inf"))
        filler[pad_token_id] = 0.0
        padded = torch.stack([torch.cat([r, filler.expand(num_steps - r.shape[0], -1)]) for r in rows], dim=1)
        return tuple(padded)  # num_steps × (batch, V)


__all__ = ["COMPACT_WHEN_WASTED", "DSparkBatchIds", "DSparkBatchRows", "DSparkBatchScores"]
