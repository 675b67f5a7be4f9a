"""Anchors: where in a training sample a block is drafted, and which of its draft slots carry a label.

docs/design.md §6. An anchor p plays the role of the last token the target committed at inference time; the block drafted
from it predicts positions p+1..p+N (draft n predicts p+n in both `sample_from_anchor` conventions).

Validity rule chosen here:
  * the anchor is an assistant token (`loss_mask[p] = 1`), and
  * the whole block of predicted positions p+1..p+N lies inside the sample (p + N ≤ T - 1), so every slot has a
    real label and a real target distribution (computed at p+n-1 ≤ T - 2);
  * labels do NOT have to be assistant tokens for the anchor to be valid: a slot whose label position is outside
    the assistant span (e.g. the block runs past the end of a reply into the next user turn) is masked per slot
    (`slot_mask`), which is also how it counts as a rejection in τ.

Sampling is `min(max_anchors, #valid)` positions uniformly without replacement, sorted. The random stream of
sample i is seeded from (seed, epoch, i) rather than taken from one shared generator, so anchors depend only on which
sample is drawn in which epoch: a resumed run, a 2-process DDP run and a single-process run draw the same anchors
for the same samples.
"""

from __future__ import annotations

import numpy as np
import torch


def valid_anchor_mask(loss_mask: torch.Tensor, num_drafts: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Valid anchor positions: loss_mask (b, T) bool, lengths (b,) real tokens per row -> (b, T) bool."""
    b, T = loss_mask.shape
    if lengths is None:
        lengths = torch.full((b,), T, dtype=torch.long, device=loss_mask.device)
    positions = torch.arange(T, device=loss_mask.device)[None, :]  # (1, T)
    return loss_mask.bool() & (positions + num_drafts <= lengths[:, None] - 1)


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A well-mixed 63-bit seed for the anchors of one sample in one epoch."""
    state = np.random.SeedSequence([seed, epoch + 1, sample_index]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & ((1 << 63) - 1)


def sample_anchors(
    valid: torch.Tensor,  # (b, T) bool
    max_anchors: int,
    generators: list[torch.Generator],  # one per row
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Draw min(max_anchors, #valid) anchors per row uniformly without replacement, sorted.

    Returns anchor_positions (b, J) long and anchor_mask (b, J) bool, J = max over rows (at least 1); rows with
    fewer valid positions are padded with position 0 and mask False.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors={max_anchors} must be >= 1; it is the number of blocks drafted per sample per step.")
    rows = []
    for row, generator in zip(valid.cpu(), generators):
        candidates = row.nonzero().flatten()  # (#valid,)
        keep = min(max_anchors, candidates.numel())
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:keep]]
        rows.append(torch.sort(chosen).values)
    J = max(1, max(r.numel() for r in rows))
    positions = torch.zeros(len(rows), J, dtype=torch.long)
    mask = torch.zeros(len(rows), J, dtype=torch.bool)
    for i, chosen in enumerate(rows):
        positions[i, : chosen.numel()] = chosen
        mask[i, : chosen.numel()] = True
    return positions.to(valid.device), mask.to(valid.device)


def sample_batch_anchors(
    loss_mask: torch.Tensor,  # (b, T) bool
    lengths: torch.Tensor,  # (b,)
    sample_indices: torch.Tensor,  # (b,) dataset index of each row
    num_drafts: int,
    max_anchors: int,
    seed: int,
    epoch: int,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Anchors of a batch, each row drawn from its own (seed, epoch, sample) stream."""
    valid = valid_anchor_mask(loss_mask, num_drafts, lengths)
    generators = [torch.Generator().manual_seed(anchor_seed(seed, epoch, int(i))) for i in sample_indices.tolist()]
    return sample_anchors(valid, max_anchors, generators)


def slot_mask(
    loss_mask: torch.Tensor,  # (b, T) bool
    anchor_positions: torch.LongTensor,  # (b, J)
    anchor_mask: torch.BoolTensor,  # (b, J)
    num_drafts: int,
) -> torch.BoolTensor:
    """Which draft slots carry a label: anchor valid and label position p+n an assistant token -> (b, J, N)."""
    b, T = loss_mask.shape
    label_positions = anchor_positions[..., None] + torch.arange(1, num_drafts + 1, device=anchor_positions.device)
    inside = label_positions <= T - 1
    labelled = loss_mask.bool().gather(1, label_positions.clamp(max=T - 1).reshape(b, -1)).reshape(label_positions.shape)
    return labelled & inside & anchor_mask[..., None]


__all__ = ["anchor_seed", "sample_anchors", "sample_batch_anchors", "slot_mask", "valid_anchor_mask"]
