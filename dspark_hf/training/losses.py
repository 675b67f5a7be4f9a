"""DSpark training losses (docs/design.md §6): CE + TV + confidence BCE per draft slot, weighted by position.

For draft n (1..N) of the block anchored at p:
  q_n  = softmax(U_n + Markov bias(prev = x_{p+n-1}))   the drafter, teacher-forced, over the draft vocab V_d
  p_n  = softmax(lm_head(h_final[p+n-1]))                 the target at p+n-1 (which predicts position p+n),
                                                          restricted to V_d and renormalized (lm_head holds V_d rows)
  CE_n = -log q_n(x_{p+n})                                against the data token (slots whose token is outside V_d
                                                          have no CE, only TV)
  TV_n = ½‖q_n - p_n‖₁ = 1 - Σ_v min(q_n, p_n)            in [0, 1]; 1 - TV_n is the probability that speculative
                                                          sampling accepts draft n. DeepSpec's "L1" loss is
                                                          ‖q - p‖₁ = 2·TV, so its weights read half as large here.
  BCE_n = BCE(c_n, c*_n), c*_n = 1 - TV_n (detached)      the confidence head learns the acceptance it will predict
Each term is a weighted mean over labelled slots with w_n = exp(-(n-1)/γ) (γ = 4): early drafts matter most because
a late draft only counts if every earlier one survived. Total = α_ce·CE + α_tv·TV + α_conf·BCE (0.1 / 0.9 / 1.0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..metrics import accepted_length, survival


@dataclass
class LossConfig:
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    gamma: float = 4.0  # position decay of w_n = exp(-(n-1)/γ)


@dataclass
class DSparkLoss:
    """The scalar loss, its terms, and detached per-slot tensors for metrics."""

    loss: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor  # scalar terms (weighted means), detached
    tv: torch.Tensor
    bce: torch.Tensor
    slot_tv: torch.Tensor  # (b, J, N) detached TV_n
    slot_ce: torch.Tensor  # (b, J, N) detached CE_n (0 where no CE)
    confidence: torch.Tensor | None  # (b, J, N) detached c_n
    slot_mask: torch.Tensor  # (b, J, N) bool
    ce_mask: torch.Tensor  # (b, J, N) bool


def position_weights(num_drafts: int, gamma: float = 4.0, device=None) -> torch.Tensor:
    """w_n = exp(-(n-1)/γ), n = 1..N -> (N,)."""
    if gamma <= 0:
        raise ValueError(f"gamma={gamma} must be > 0 (the position decay of the loss weights; the documented default 4).")
    return torch.exp(-torch.arange(num_drafts, dtype=torch.float32, device=device) / gamma)


@dataclass
class TargetDistribution:
    """p_n of every slot, each distinct target position computed and stored once: the blocks of a batch overlap, so
    slots share positions (32 blocks of 7 drafts per sample: about two slots per position)."""

    probs: torch.Tensor  # (U, V_d) one row per distinct (sequence, position)
    rows: torch.LongTensor  # (b, J, N) the row of `probs` each slot reads

    def dense(self) -> torch.Tensor:
        return self.probs[self.rows]  # (b, J, N, V_d)


@torch.no_grad()
def target_probabilities(
    final_hidden_state: torch.Tensor,  # (b, T, d) cached post-norm target states
    label_positions: torch.LongTensor,  # (b, J, N) position p+n each draft predicts
    lm_head_weight: torch.Tensor,  # (V_d, d) frozen target LM-head rows of the draft vocabulary
) -> TargetDistribution:
    """p_n: the target's distribution for position p+n, read at p+n-1, restricted to V_d and renormalized."""
    b, T, d = final_hidden_state.shape
    source = (label_positions - 1).clamp(0, T - 1)  # (b, J, N)
    flat_source = source + T * torch.arange(b, device=source.device)[:, None, None]
    positions, rows = torch.unique(flat_source, return_inverse=True)
    states = final_hidden_state.reshape(b * T, d)[positions]  # (U, d)
    probs = torch.softmax(F.linear(states.float(), lm_head_weight.float()), dim=-1)  # (U, V_d)
    return TargetDistribution(probs, rows)


def draft_labels(
    input_ids: torch.LongTensor,  # (b, T) target ids
    label_positions: torch.LongTensor,  # (b, J, N)
    t2d: torch.BoolTensor,  # (V_t,) draft-vocab membership
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """The data token of each slot as a draft id, and whether it is in the draft vocab at all -> (b, J, N) each."""
    b, T = input_ids.shape
    tokens = input_ids.gather(1, label_positions.clamp(max=T - 1).reshape(b, -1)).reshape(label_positions.shape)
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1  # (V_t,) draft id of a member (ids ascend in both vocabs)
    return target_to_draft[tokens].clamp(min=0), t2d[tokens]


def total_variation(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """TV = ½‖q - p‖₁ = 1 - Σ min(q, p) over the last dim."""
    return 1.0 - torch.minimum(q, p).sum(dim=-1)


CPU_CHUNK_SLOTS = 256


def _chunks(num_slots: int, device: torch.device) -> list[slice]:
    """Slot ranges the loss streams through: a few hundred at a time on CPU, where every elementwise op moves the
    (slots × V_d) float32 intermediates through memory (60 MB at 896 slots × 16k) and a chunk stays in cache (2.3×
    faster, the same values: every op is row-wise); one chunk on an accelerator, where launches cost more."""
    size = CPU_CHUNK_SLOTS if device.type == "cpu" else max(num_slots, 1)
    return [slice(start, min(start + size, num_slots)) for start in range(0, num_slots, size)]


class _SlotTerms(torch.autograd.Function):
    """TV_n and CE_n of every slot with one hand-written backward: autograd through `minimum`, `log_softmax` and the
    chunks' `cat` made about twice the passes over the (slots × V_d) logits that this makes, and kept their
    intermediates; this keeps only the logits. With q = softmax(x), b_v = [q_v < p_v] (where min(q, p) follows q)
    and S = Σ_v b_v q_v:
      ∂TV/∂x = q ⊙ (S - b),   ∂CE/∂x = q - onehot(label)."""

    @staticmethod
    def forward(ctx, logits, probs, rows, labels):  # logits (M, V_d), probs (U, V_d), rows (M,), labels (M,) or None
        tv = logits.new_empty(logits.shape[0], dtype=torch.float32)
        ce = torch.empty_like(tv) if labels is not None else None
        for part in _chunks(logits.shape[0], logits.device):
            log_q = torch.log_softmax(logits[part].float(), dim=-1)
            tv[part] = total_variation(log_q.exp(), probs[rows[part]].float())
            if labels is not None:
                ce[part] = -log_q.gather(-1, labels[part, None]).squeeze(-1)
        ctx.save_for_backward(logits, probs, rows, labels)
        return tv, ce

    @staticmethod
    def backward(ctx, grad_tv, grad_ce):
        logits, probs, rows, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for part in _chunks(logits.shape[0], logits.device):
            q = torch.softmax(logits[part].float(), dim=-1)
            below = q < probs[rows[part]].float()
            scale = grad_tv[part] * (q * below).sum(-1)  # g_tv · S
            if grad_ce is not None:
                scale = scale + grad_ce[part]
            chunk_grad = q * (scale[:, None] - below * grad_tv[part, None])
            if grad_ce is not None:
                chunk_grad.scatter_add_(-1, labels[part, None], -grad_ce[part, None])
            grad[part] = chunk_grad
        return grad, None, None, None


def slot_terms(
    logits: torch.Tensor,  # (b, J, N, V_d) draft logits
    target: TargetDistribution,
    labels: torch.LongTensor | None = None,  # (b, J, N) draft ids; None: TV only
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TV_n and CE_n of every slot -> (b, J, N) each (CE None without labels), computed chunk by chunk."""
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat_labels = labels.reshape(-1) if labels is not None else None
    tv, ce = _SlotTerms.apply(logits.reshape(-1, vocab), target.probs, target.rows.reshape(-1), flat_labels)
    return tv.reshape(shape), (ce.reshape(shape) if labels is not None else None)


def _weighted_mean(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w = weights * mask.to(weights.dtype)  # (b, J, N)
    return (values * w).sum() / w.sum().clamp(min=1e-8)


def dspark_loss(
    logits: torch.Tensor,  # (b, J, N, V_d) Markov-corrected draft logits
    confidence_logits: torch.Tensor | None,  # (b, J, N)
    target: TargetDistribution,
    labels: torch.LongTensor,  # (b, J, N) draft ids
    label_in_vocab: torch.BoolTensor,  # (b, J, N)
    slot_mask: torch.BoolTensor,  # (b, J, N)
    config: LossConfig = LossConfig(),
) -> DSparkLoss:
    """CE + TV + confidence BCE, position-weighted means over labelled slots (see the module docstring)."""
    N = logits.shape[-2]
    weights = position_weights(N, config.gamma, logits.device)  # (N,)
    tv, ce = slot_terms(logits, target, labels)  # (b, J, N) each
    ce_mask = slot_mask & label_in_vocab
    ce_term = _weighted_mean(ce, ce_mask, weights)
    tv_term = _weighted_mean(tv, slot_mask, weights)
    loss = config.alpha_ce * ce_term + config.alpha_tv * tv_term
    confidence = None
    bce_term = torch.zeros((), device=logits.device)
    if confidence_logits is not None:
        soft_label = (1.0 - tv).detach().clamp(0.0, 1.0)  # c* = 1 - TV, no gradient into the drafter through it
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_label, reduction="none")
        bce_term = _weighted_mean(bce, slot_mask, weights)
        loss = loss + config.alpha_conf * bce_term
        confidence = torch.sigmoid(confidence_logits.detach().float())
    return DSparkLoss(
        loss=loss,
        ce=ce_term.detach(),
        tv=tv_term.detach(),
        bce=bce_term.detach(),
        slot_tv=tv.detach(),
        slot_ce=(ce * ce_mask).detach(),
        confidence=confidence,
        slot_mask=slot_mask,
        ce_mask=ce_mask,
    )


class BlockStatistics:
    """Running sums of the logged metrics over many batches, as one flat tensor so processes reduce it in one call.

    Per-slot accept rate (mean 1 - TV_n), τ (mean over blocks of 1 + Σ_k Π_{i≤k}(1 - TV_i); masked slots count as
    rejected), CE, and confidence calibration (mean |c_n - (1 - TV_n)|, and cumulative bias Π c - Π (1 - TV)).
    """

    def __init__(self, num_drafts: int, device=None):
        self.N = num_drafts
        # [accept_sum(N), slot_count(N), ce_sum, ce_count, tau_sum, block_count, abs_err_sum, cum_bias_sum, reached]
        self.sums = torch.zeros(2 * num_drafts + 7, dtype=torch.float64, device=device)

    def update(self, result: DSparkLoss, anchor_mask: torch.Tensor):
        N, s = self.N, self.sums
        mask = result.slot_mask.double()
        accept = (1.0 - result.slot_tv).double()
        s[:N] += (accept * mask).sum(dim=(0, 1))
        s[N : 2 * N] += mask.sum(dim=(0, 1))
        s[2 * N] += result.slot_ce.double().sum()
        s[2 * N + 1] += result.ce_mask.double().sum()
        blocks = anchor_mask.bool()
        s[2 * N + 2] += accepted_length(accept, result.slot_mask)[blocks].sum()
        s[2 * N + 3] += blocks.double().sum()
        if result.confidence is not None:
            confidence = result.confidence.double()
            s[2 * N + 4] += ((confidence - accept).abs() * mask).sum()
            reached = torch.cumprod(mask, dim=-1)
            s[2 * N + 5] += ((survival(confidence, result.slot_mask) - survival(accept, result.slot_mask)) * reached).sum()
            s[2 * N + 6] += reached.sum()

    def compute(self, sums: torch.Tensor | None = None) -> dict[str, float]:
        """Metrics from (possibly cross-process reduced) sums."""
        N = self.N
        s = (self.sums if sums is None else sums).double().cpu()
        accept = s[:N] / s[N : 2 * N].clamp(min=1)
        metrics = {f"accept/slot_{n + 1}": float(accept[n]) for n in range(N)}
        metrics["accept/mean"] = float(s[:N].sum() / s[N : 2 * N].sum().clamp(min=1))
        metrics["ce"] = float(s[2 * N] / s[2 * N + 1].clamp(min=1))
        metrics["tau"] = float(s[2 * N + 2] / s[2 * N + 3].clamp(min=1))
        if s[2 * N + 6] > 0:
            metrics["calibration/abs_error"] = float(s[2 * N + 4] / s[N : 2 * N].sum().clamp(min=1))
            metrics["calibration/cumulative_bias"] = float(s[2 * N + 5] / s[2 * N + 6])
        return metrics


class MetricWindow:
    """Everything logged since the last report: block statistics, the loss terms, tokens and wall time.

    Training reports one window every `--logging-steps`; validation is one window over the held-out cache. Sums are
    kept as tensors so `compute(reduce)` adds them across processes in one call each.
    """

    TERMS = ("loss", "ce_term", "tv", "bce")

    def __init__(self, num_drafts: int, device=None):
        self.num_drafts, self.device = num_drafts, device
        self.reset()

    def reset(self):
        self.blocks = BlockStatistics(self.num_drafts, self.device)
        self.sums = torch.zeros(len(self.TERMS) + 2, dtype=torch.float64, device=self.device)  # terms, batches, tokens
        self.start = time.perf_counter()

    def update(self, result: DSparkLoss, anchor_mask: torch.Tensor, tokens=0):
        self.blocks.update(result, anchor_mask)
        one = torch.ones((), dtype=torch.float64, device=self.sums.device)
        self.sums += torch.stack([result.loss.detach().double(), result.ce.double(), result.tv.double(),
                                  result.bce.double(), one, torch.as_tensor(tokens, device=one.device).double()])

    def compute(self, reduce=lambda tensor: tensor) -> dict[str, float]:
        """Block metrics and mean loss terms per micro-batch, and tokens/s, over (reduced) sums."""
        metrics = self.blocks.compute(reduce(self.blocks.sums))
        sums = reduce(self.sums)
        count = max(float(sums[len(self.TERMS)]), 1.0)
        metrics.update({name: float(sums[i]) / count for i, name in enumerate(self.TERMS)})
        metrics["tokens_per_s"] = float(sums[-1]) / max(time.perf_counter() - self.start, 1e-9)
        return metrics


__all__ = [
    "BlockStatistics",
    "MetricWindow",
    "DSparkLoss",
    "LossConfig",
    "TargetDistribution",
    "draft_labels",
    "dspark_loss",
    "position_weights",
    "slot_terms",
    "target_probabilities",
    "total_variation",
]
