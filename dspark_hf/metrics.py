"""Drafter metrics shared by training, calibration and evaluation: τ, per-position acceptance, calibration.

Definitions follow the Kimi-K2.6 DSpark card (docs/design.md §3) so offline numbers are comparable with it: the acceptance
of draft k given that drafts 1..k-1 were accepted is 1 - TV_k (teacher-forced, draft-vocab restricted), the
survival of draft k is a_k = Π_{i≤k} (1 - TV_i), and the accepted length of a block is τ = 1 + Σ_k a_k (the target's
bonus token always counts). Pure torch; every function takes and returns tensors or floats.
"""

from __future__ import annotations

import torch


def survival(accept: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Prefix survival a_k = Π_{i≤k} accept_i : (..., N) -> (..., N).

    A masked slot (label outside the sample or the assistant span) counts as rejected: verification never gets past
    it, so later drafts of that block cannot survive either.
    """
    accept = accept.float()
    if mask is not None:
        accept = accept * mask.to(accept.dtype)
    return torch.cumprod(accept, dim=-1)


def accepted_length(accept: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """τ of each block: 1 + Σ_k a_k : (..., N) -> (...)."""
    return 1.0 + survival(accept, mask).sum(dim=-1)


def tau(accept: torch.Tensor, mask: torch.Tensor | None = None, block_mask: torch.Tensor | None = None) -> float:
    """Mean accepted length over blocks (the card's τ, out of N+1). accept (..., N); block_mask (...) selects blocks."""
    lengths = accepted_length(accept, mask)
    if block_mask is not None:
        lengths = lengths[block_mask.bool()]
    return float(lengths.mean()) if lengths.numel() else float("nan")


def per_position_acceptance(accept: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean conditional acceptance 1 - TV of each draft position over its valid slots : (..., N) -> (N,)."""
    accept = accept.float().reshape(-1, accept.shape[-1])
    mask = torch.ones_like(accept) if mask is None else mask.float().reshape(-1, accept.shape[-1])
    return (accept * mask).sum(0) / mask.sum(0).clamp(min=1)


# ---------------------------------------------------------------------------------------------- calibration
def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, num_bins: int = 15) -> float:
    """ECE with equal-width bins: Σ_bins (|bin|/n) · |mean(predicted) - mean(observed)|.

    `observed` may be binary events or soft probabilities; both give the usual ECE.
    """
    predicted, observed = predicted.flatten().double(), observed.flatten().double()
    if predicted.numel() == 0:
        return float("nan")
    bins = torch.clamp((predicted * num_bins).long(), max=num_bins - 1)  # [n]
    count = torch.bincount(bins, minlength=num_bins).double()
    gap = torch.bincount(bins, weights=predicted, minlength=num_bins) - torch.bincount(bins, weights=observed, minlength=num_bins)
    return float(gap.abs().sum() / predicted.numel()) if count.sum() else float("nan")


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of binary `labels` ranked by `scores` (Mann-Whitney U, ties count one half)."""
    scores, labels = scores.flatten().double(), labels.flatten().bool()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average ranks over ties
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts + 1  # first rank of each tie group
    mean_rank = first.double() + (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def log_loss(predicted: torch.Tensor, observed: torch.Tensor, eps: float = 1e-6) -> float:
    """Mean binary negative log-likelihood of `observed` outcomes (events or frequencies) under `predicted`: a proper
    score, so it is minimal only at the true probabilities (ECE is not: a constant at the base rate scores 0)."""
    p = predicted.double().clamp(eps, 1 - eps)
    o = observed.double()
    return float(-(o * p.log() + (1 - o) * (1 - p).log()).mean())


def brier_score(predicted: torch.Tensor, observed: torch.Tensor) -> float:
    """Mean squared error between predicted probabilities and observed outcomes."""
    return float(((predicted.double() - observed.double()) ** 2).mean())


def confidence_calibration(
    confidence: torch.Tensor, accept: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """How well the confidence head predicts acceptance. confidence c_k and accept 1-TV_k: (..., N).

    abs_error: mean |c_k - (1 - TV_k)| over valid slots (the per-draft fit the BCE trains).
    cumulative_bias: mean over blocks and positions of Π c_i - Π (1 - TV_i) (> 0: the head is overconfident about
    survival, which makes a threshold-scheduled block too long).
    """
    mask = torch.ones_like(accept, dtype=torch.bool) if mask is None else mask.bool()
    valid = mask.float()
    abs_error = float(((confidence - accept).abs() * valid).sum() / valid.sum().clamp(min=1))
    predicted, actual = survival(confidence, mask), survival(accept, mask)
    reached = torch.cumprod(valid, dim=-1)  # positions a block can reach at all
    cumulative_bias = float(((predicted - actual) * reached).sum() / reached.sum().clamp(min=1))
    return {"abs_error": abs_error, "cumulative_bias": cumulative_bias}


__all__ = [
    "accepted_length",
    "brier_score",
    "confidence_calibration",
    "expected_calibration_error",
    "log_loss",
    "per_position_acceptance",
    "roc_auc",
    "survival",
    "tau",
]
