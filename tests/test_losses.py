"""The DSpark loss equals a direct, slow computation of docs/design.md §6; anchors, slots and metrics follow their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_drafter, make_tiny_target

from dspark_hf import DSparkContextCache
from dspark_hf.metrics import (
    accepted_length,
    brier_score,
    expected_calibration_error,
    per_position_acceptance,
    roc_auc,
    tau,
)
from dspark_hf.training import losses
from dspark_hf.training.anchors import sample_batch_anchors, slot_mask, valid_anchor_mask
from dspark_hf.training.losses import (
    BlockStatistics,
    LossConfig,
    draft_labels,
    dspark_loss,
    position_weights,
    target_probabilities,
    total_variation,
)


def test_position_weights_and_tv_scale():
    assert torch.allclose(position_weights(5, 4.0), torch.tensor([math.exp(-k / 4) for k in range(5)]))
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    p = torch.tensor([[0.0, 0.0, 0.25, 0.75]])
    assert total_variation(q, p).item() == pytest.approx(1.0)  # disjoint supports: TV = 1
    assert (q - p).abs().sum().item() == pytest.approx(2.0)  # DeepSpec's L1 is twice our TV
    assert total_variation(q, q).item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="gamma"):
        position_weights(3, 0.0)


def _reference_loss(logits, conf_logits, final_hidden, head, input_ids, anchors, anchor_mask, loss_mask, t2d, cfg):
    """docs/design.md §6 written out slot by slot with Python loops: no vectorization shared with the implementation."""
    b, J, N, V = logits.shape
    T = input_ids.shape[1]
    draft_ids = torch.nonzero(t2d).flatten().tolist()
    terms = {"ce": [0.0, 0.0], "tv": [0.0, 0.0], "bce": [0.0, 0.0]}
    for i in range(b):
        for j in range(J):
            if not anchor_mask[i, j]:
                continue
            p_anchor = int(anchors[i, j])
            for n in range(1, N + 1):
                position = p_anchor + n
                if position > T - 1 or not loss_mask[i, position]:
                    continue
                w = math.exp(-(n - 1) / cfg.gamma)
                q = torch.softmax(logits[i, j, n - 1].double(), -1)
                p = torch.softmax(head.double() @ final_hidden[i, position - 1].double(), -1)
                tv = 0.5 * (q - p).abs().sum().item()
                terms["tv"][0] += w * tv
                terms["tv"][1] += w
                token = int(input_ids[i, position])
                if token in draft_ids:
                    terms["ce"][0] += w * -math.log(q[draft_ids.index(token)].item())
                    terms["ce"][1] += w
                c = torch.sigmoid(conf_logits[i, j, n - 1].double()).item()
                soft = 1.0 - tv
                terms["bce"][0] += w * -(soft * math.log(c) + (1 - soft) * math.log(1 - c))
                terms["bce"][1] += w
    ce, tv, bce = (terms[k][0] / terms[k][1] for k in ("ce", "tv", "bce"))
    return ce, tv, bce, cfg.alpha_ce * ce + cfg.alpha_tv * tv + cfg.alpha_conf * bce


@pytest.mark.parametrize("chunk", [256, 3])
def test_loss_matches_slow_reference_on_random_tensors(chunk, monkeypatch):
    """Also with the slots cut into chunks of 3 (CPU computes the loss chunk by chunk): the same values and gradients."""
    monkeypatch.setattr(losses, "CPU_CHUNK_SLOTS", chunk)
    torch.manual_seed(0)
    b, T, d, V_t, N, J = 2, 24, 8, 30, 4, 5
    t2d = torch.zeros(V_t, dtype=torch.bool)
    t2d[torch.randperm(V_t)[:20]] = True  # a 20-token draft vocabulary; some data tokens fall outside it
    head = torch.randn(int(t2d.sum()), d)
    final_hidden = torch.randn(b, T, d)
    input_ids = torch.randint(0, V_t, (b, T))
    loss_mask = torch.rand(b, T) > 0.3
    lengths = torch.tensor([T, T - 5])
    loss_mask[1, T - 5 :] = False
    anchors, anchor_mask = sample_batch_anchors(loss_mask, lengths, torch.tensor([3, 7]), N, J, seed=0, epoch=0)
    label_positions = anchors[..., None] + torch.arange(1, N + 1)
    logits = torch.randn(b, anchors.shape[1], N, 20, requires_grad=True)
    conf_logits = torch.randn(b, anchors.shape[1], N)
    cfg = LossConfig(alpha_ce=0.3, alpha_tv=0.6, alpha_conf=0.5, gamma=2.5)

    probs = target_probabilities(final_hidden, label_positions, head)
    labels, in_vocab = draft_labels(input_ids, label_positions, t2d)
    mask = slot_mask(loss_mask, anchors, anchor_mask, N)
    result = dspark_loss(logits, conf_logits, probs, labels, in_vocab, mask, cfg)
    ce, tv, bce, total = _reference_loss(logits.detach(), conf_logits, final_hidden, head, input_ids, anchors,
                                         anchor_mask, loss_mask, t2d, cfg)
    assert result.ce.item() == pytest.approx(ce, rel=1e-5)
    assert result.tv.item() == pytest.approx(tv, rel=1e-5)
    assert result.bce.item() == pytest.approx(bce, rel=1e-5)
    assert result.loss.item() == pytest.approx(total, rel=1e-5)
    result.loss.backward()  # the soft label is detached: BCE sends no gradient into the draft logits
    assert torch.isfinite(logits.grad).all()
    direct = logits.detach().clone().requires_grad_()  # the loss on dense tensors, no chunks, no shared positions
    log_q = torch.log_softmax(direct, -1)
    tv = 1 - torch.minimum(log_q.exp(), probs.dense()).sum(-1)
    ce = -log_q.gather(-1, labels[..., None]).squeeze(-1)
    w = position_weights(N, cfg.gamma)
    ce_w, tv_w = w * (mask & in_vocab), w * mask
    (cfg.alpha_ce * (ce * ce_w).sum() / ce_w.sum() + cfg.alpha_tv * (tv * tv_w).sum() / tv_w.sum()).backward()
    torch.testing.assert_close(logits.grad, direct.grad, rtol=1e-5, atol=1e-7)
    assert probs.probs.shape[0] < mask.numel()  # overlapping blocks: each shared position computed once


@pytest.mark.parametrize("chunk", [256, 5])
def test_tv_only_slot_terms_have_autograds_gradient(chunk, monkeypatch):
    """Without labels (the rollouts' TV), the hand-written backward is still the gradient of 1 - Σ min(q, p)."""
    monkeypatch.setattr(losses, "CPU_CHUNK_SLOTS", chunk)
    torch.manual_seed(1)
    logits = (3 * torch.randn(2, 3, 4, 50)).requires_grad_()
    target = losses.TargetDistribution(torch.softmax(3 * torch.randn(7, 50), -1), torch.randint(0, 7, (2, 3, 4)))
    weights = torch.rand(2, 3, 4)
    tv, ce = losses.slot_terms(logits, target)
    assert ce is None
    (tv * weights).sum().backward()
    direct = logits.detach().clone().requires_grad_()
    direct_tv = total_variation(torch.softmax(direct, -1), target.dense())
    (direct_tv * weights).sum().backward()
    torch.testing.assert_close(tv, direct_tv.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad, direct.grad, rtol=1e-5, atol=1e-7)


def test_anchor_rules_and_sampling():
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    valid = valid_anchor_mask(loss_mask, num_drafts=3, lengths=torch.tensor([10]))
    # assistant anchor with p + 3 <= 9: positions 1..5 (6 is not assistant); 7 and 8 run past the sample
    assert valid[0].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    anchors, mask = sample_batch_anchors(loss_mask, torch.tensor([10]), torch.tensor([0]), 3, max_anchors=3, seed=1, epoch=0)
    chosen = anchors[0][mask[0]].tolist()
    assert len(chosen) == 3 == len(set(chosen)) and chosen == sorted(chosen) and set(chosen) <= {1, 2, 3, 4, 5}
    again, _ = sample_batch_anchors(loss_mask, torch.tensor([10]), torch.tensor([0]), 3, max_anchors=3, seed=1, epoch=0)
    assert torch.equal(anchors, again)  # a pure function of (seed, epoch, sample)
    every, _ = sample_batch_anchors(loss_mask, torch.tensor([10]), torch.tensor([0]), 3, max_anchors=99, seed=1, epoch=0)
    assert every[0].tolist() == [1, 2, 3, 4, 5]
    # slot labels outside the assistant span are masked: anchor 4 predicts 5, 6, 7 and 6 is a user token
    slots = slot_mask(loss_mask, torch.tensor([[4]]), torch.tensor([[True]]), 3)
    assert slots[0, 0].tolist() == [True, False, True]
    with pytest.raises(ValueError, match="max_anchors"):
        sample_batch_anchors(loss_mask, torch.tensor([10]), torch.tensor([0]), 3, max_anchors=0, seed=1, epoch=0)


def test_tau_and_calibration_metrics():
    accept = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    # block 1: 1 + .5 + .25 + .25; block 2: 1 + 1 + 0 + 0
    assert accepted_length(accept).tolist() == [2.0, 2.0]
    assert tau(accept) == pytest.approx(2.0)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    assert accepted_length(accept, mask).tolist() == [1.5, 2.0]  # a masked slot ends survival
    assert per_position_acceptance(accept, mask).tolist() == [0.75, 0.0, 1.0]
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    labels = torch.tensor([0, 0, 1, 1])
    assert roc_auc(scores, labels) == pytest.approx(0.75)
    assert expected_calibration_error(torch.full((4,), 0.5), labels.float()) == pytest.approx(0.0)
    assert expected_calibration_error(torch.ones(4), labels.float()) == pytest.approx(0.5)
    assert brier_score(torch.ones(4), labels.float()) == pytest.approx(0.5)


def test_block_statistics_tau_matches_metric():
    torch.manual_seed(1)
    tv = torch.rand(2, 3, 4)
    mask = torch.rand(2, 3, 4) > 0.2
    anchor_mask = torch.tensor([[True, True, False], [True, True, True]])
    mask &= anchor_mask[..., None]
    from dspark_hf.training.losses import DSparkLoss

    result = DSparkLoss(loss=torch.zeros(()), ce=torch.zeros(()), tv=torch.zeros(()), bce=torch.zeros(()), slot_tv=tv,
                        slot_ce=torch.zeros_like(tv), confidence=1 - tv, slot_mask=mask, ce_mask=mask)
    stats = BlockStatistics(4)
    stats.update(result, anchor_mask)
    metrics = stats.compute()
    assert metrics["tau"] == pytest.approx(tau(1 - tv, mask, anchor_mask))
    assert metrics["calibration/abs_error"] == pytest.approx(0.0, abs=1e-9)  # c = 1 - TV exactly
    assert metrics["accept/slot_1"] == pytest.approx(per_position_acceptance(1 - tv, mask)[0].item())


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_training_slots_line_up_with_draft_block(sample_from_anchor):
    """Draft n of the training forward is the n-th token `draft_block` drafts after the same anchor, and its target
    distribution is the one the target's verify pass uses for it (logits at position p+n-1)."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, sample_from_anchor=sample_from_anchor, draft_vocab_size=64)
    N, m = drafter.num_draft_tokens, len(drafter.config.aux_hidden_state_layer_ids)
    torch.manual_seed(3)
    T, p = 20, 9
    input_ids = torch.randint(3, 90, (1, T))
    aux = torch.randn(1, T, m * 64)

    cache = drafter.extend_context(DSparkContextCache(), aux[:, :p])
    draft = drafter.draft_block(cache, input_ids[0, p])  # greedy, context t < p, anchor x_p at position p
    assert draft.token_ids.shape[1] == N
    input_ids[0, p + 1 : p + 1 + N] = draft.token_ids[0]  # teacher forcing then feeds exactly the drafted prefix
    with torch.no_grad():
        out = drafter(aux_hidden_states=aux, input_ids=input_ids, anchor_positions=torch.tensor([[p]]))
    assert out.label_positions[0, 0].tolist() == list(range(p + 1, p + N + 1))
    torch.testing.assert_close(out.logits[0, 0], draft.draft_logits[0], rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        target_out = target(input_ids, output_hidden_states=True)
    final_hidden = target_out.hidden_states[-1]  # post-norm
    probs = target_probabilities(final_hidden, out.label_positions, drafter.lm_head.weight)
    rows = drafter.draft_to_target_ids
    for n in range(1, N + 1):
        verify_logits = target_out.logits[0, p + n - 1, rows]  # the target's prediction for position p+n
        torch.testing.assert_close(probs.dense()[0, 0, n - 1], torch.softmax(verify_logits, -1), rtol=1e-4, atol=1e-5)
    labels, in_vocab = draft_labels(input_ids, out.label_positions, drafter.t2d)
    assert torch.equal(rows[labels[0, 0]][in_vocab[0, 0]], input_ids[0, p + 1 : p + 1 + N][in_vocab[0, 0]])
