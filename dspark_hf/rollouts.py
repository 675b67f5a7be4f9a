"""The teacher-forced pass over a hidden-state cache that evaluation and calibration both read (docs/design.md §2, §7).

For every valid anchor (as in training: up to `max_anchors` per sample, fixed seed) the drafter's Markov-corrected
q_k is compared with the target's p_k, both restricted to the draft vocabulary and teacher-forced with the data
tokens as previous tokens; 1 - TV_k is the probability that speculative sampling accepts draft k given that the
drafts before it were. Calibration needs binary events, so `Rollouts` also holds **sampled** survival: each draw
accepts draft k with probability 1 - TV_k and survival ends at the first rejection; a slot whose label lies outside
the assistant span counts as a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import IndexedCache, collate_samples
from .progress import progress as progress_bar
from .training.anchors import sample_batch_anchors, slot_mask
from .training.losses import slot_terms, target_probabilities


@dataclass
class Rollouts:
    """Teacher-forced blocks of a held-out cache."""

    confidence_logits: torch.Tensor  # (M, N) raw (temperature 1) confidence logits
    accept: torch.Tensor  # (M, N) 1 - TV_k
    slot_mask: torch.Tensor  # (M, N) bool, label inside the assistant span
    survived: torch.Tensor  # (M, R, N) bool sampled survival events

    def reachable(self) -> torch.Tensor:
        """(M, N) bool: block can get to position k at all (no masked slot before or at k)."""
        return torch.cumprod(self.slot_mask.long(), dim=-1).bool()


def sampled_survival(accept: torch.Tensor, mask: torch.Tensor, draws: int = 8, seed: int = 0) -> torch.Tensor:
    """(M, R, N) bool: R draws per block, draft k accepted with probability 1 - TV_k, survival ends at the first
    rejection or masked slot."""
    generator = torch.Generator().manual_seed(seed)
    accepted = torch.rand(accept.shape[0], draws, accept.shape[1], generator=generator) < accept[:, None, :]
    return torch.cumprod((accepted & mask[:, None, :]).long(), dim=-1).bool()


def rollouts_from_blocks(confidence_logits: torch.Tensor, accept: torch.Tensor, mask: torch.Tensor,
                         draws: int = 8, seed: int = 0) -> Rollouts:
    """Rollouts of already computed blocks, with `draws` sampled survival events each."""
    return Rollouts(confidence_logits, accept, mask, sampled_survival(accept, mask, draws, seed))


def _block_acceptance(model, batch: dict[str, torch.Tensor], max_anchors: int, seed: int):
    """(accept, greedy accept, mask, confidence logits or None) of the sampled anchors of one collated batch, each
    (J_valid, N). Greedy accept: the drafter's argmax is the target's (both over the draft vocabulary)."""
    N = model.num_draft_tokens
    anchors, anchor_mask = sample_batch_anchors(batch["loss_mask"], batch["lengths"], batch["index"], N,
                                                max_anchors, seed, epoch=-1)  # (b, J) each
    out = model(aux_hidden_states=batch["aux_hidden_states"], input_ids=batch["input_ids"],
                anchor_positions=anchors, attention_mask=batch["attention_mask"])
    target = target_probabilities(batch["final_hidden_state"], out.label_positions, model.lm_head.weight)
    tv = slot_terms(out.logits, target)[0]  # (b, J, N)
    keep = anchor_mask.bool()
    accept = (1.0 - tv).clamp(0, 1)[keep].cpu()
    greedy = (out.logits.argmax(-1) == target.probs.argmax(-1)[target.rows]).float()[keep].cpu()
    mask = slot_mask(batch["loss_mask"], anchors, anchor_mask, N)[keep].cpu()
    confidence = out.confidence_logits.float()[keep].cpu() if out.confidence_logits is not None else None
    return accept, greedy, mask, confidence


@torch.no_grad()
def offline_acceptance(model, cache, max_anchors: int = 10_000, batch_size: int = 4, max_samples: int | None = None,
                       seed: int = 0, progress: bool = True, desc: str = "eval") -> dict[str, torch.Tensor]:
    """Teacher-forced 1 - TV_k of every (sampled) anchor block of `cache`: accept (M, N), greedy_accept (M, N, 0/1),
    mask (M, N), and the raw confidence logits (M, N) when the drafter has a confidence head. `progress`: a bar, else
    log lines."""
    model.eval()
    dataset = IndexedCache(cache)
    count = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    device = model.fc.weight.device
    accepts, greedy_accepts, masks, confidences = [], [], [], []
    bar = progress_bar(total=count, desc=desc, unit="sample", enabled=progress)
    for start in range(0, count, batch_size):
        batch = collate_samples([dataset[i] for i in range(start, min(start + batch_size, count))])
        accept, greedy, mask, confidence = _block_acceptance(model, {k: v.to(device) for k, v in batch.items()}, max_anchors, seed)
        accepts.append(accept)
        greedy_accepts.append(greedy)
        masks.append(mask)
        if confidence is not None:
            confidences.append(confidence)
        bar.update(min(batch_size, count - start))
    bar.close()
    if not accepts or sum(a.shape[0] for a in accepts) == 0:
        raise ValueError("the cache has no valid anchors (assistant tokens with a full block after them); use a larger cache.")
    result = {"accept": torch.cat(accepts), "greedy_accept": torch.cat(greedy_accepts), "mask": torch.cat(masks)}
    if confidences:
        result["confidence_logits"] = torch.cat(confidences)
    return result


def collect_rollouts(model, cache, max_anchors: int = 256, draws: int = 8, seed: int = 0, batch_size: int = 4,
                     progress: bool = True) -> Rollouts:
    """Run the drafter teacher-forced over `cache` and record confidence logits, 1 - TV and sampled survival."""
    if model.confidence_head is None:
        raise ValueError("this drafter has no confidence head (enable_confidence_head=False); there is nothing to calibrate.")
    blocks = offline_acceptance(model, cache, max_anchors=max_anchors, batch_size=batch_size, seed=seed,
                                progress=progress, desc="calibrate")
    return rollouts_from_blocks(blocks["confidence_logits"], blocks["accept"], blocks["mask"], draws, seed)


__all__ = ["Rollouts", "collect_rollouts", "offline_acceptance", "rollouts_from_blocks", "sampled_survival"]
