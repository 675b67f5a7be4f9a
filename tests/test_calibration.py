"""Sequential Temperature Scaling lowers the ECE of a trained tiny drafter's survival predictions on held-out rollouts."""

from __future__ import annotations


import pytest
import torch
from test_training import tiny_world, trained_run
from transformers import AutoModel, LlamaForCausalLM

from dspark_hf.calibration import calibrate, collect_rollouts, sequential_temperature_scaling, survival_predictions
from dspark_hf.cache import HiddenStateCache


def test_sts_lowers_ece_on_held_out_rollouts(tmp_path):
    world, run = tiny_world(), trained_run()
    result = calibrate(run["drafter"], world["eval"], output_dir=tmp_path / "calibrated", eval_cache_dir=world["test"],
                       target=world["target"])  # the trained drafter binds embed/head from the target
    before, after = result["before"]["ece"], result["after"]["ece"]
    print(f"temperatures {[round(t, 3) for t in result['temperatures']]}; held-out ECE per position "
          f"{[round(e, 4) for e in before]} -> {[round(e, 4) for e in after]}")
    assert sum(after) < sum(before)
    assert all(a <= b + 0.01 for a, b in zip(after, before))
    # temperatures are in the checkpoint, the weights untouched, and draft_block applies them
    drafter = AutoModel.from_pretrained(tmp_path / "calibrated", trust_remote_code=True)
    assert drafter.config.confidence_temperatures == pytest.approx(result["temperatures"])


def test_sts_picks_temperatures_left_to_right():
    """On rollouts whose logits are 3× too sharp, position 1's temperature is found first and is ≈ 3."""
    world, run = tiny_world(), trained_run()
    drafter = AutoModel.from_pretrained(run["drafter"], trust_remote_code=True)
    drafter.bind_target(LlamaForCausalLM.from_pretrained(world["target"]))
    rollouts = collect_rollouts(drafter, HiddenStateCache(world["eval"]), draws=32)
    true_logits = rollouts.confidence_logits.clone()
    # replace the events by ones drawn from a known calibrated model, then sharpen the logits 3×
    generator = torch.Generator().manual_seed(0)
    accepted = torch.rand(rollouts.survived.shape, generator=generator) < torch.sigmoid(true_logits)[:, None, :]
    rollouts.survived = torch.cumprod((accepted & rollouts.slot_mask[:, None, :]).long(), -1).bool()
    rollouts.confidence_logits = 3.0 * true_logits
    temperatures = sequential_temperature_scaling(rollouts)
    assert temperatures[0] == pytest.approx(3.0, rel=0.35)
    assert survival_predictions(rollouts, temperatures).shape == true_logits.shape


def _synthetic_rollouts(logits: torch.Tensor, survive_probability: torch.Tensor, draws: int = 16, seed: int = 0):
    """Rollouts whose survival events are drawn with the given per-block, per-position probabilities."""
    from dspark_hf.rollouts import Rollouts

    generator = torch.Generator().manual_seed(seed)
    survived = torch.rand(logits.shape[0], draws, logits.shape[1], generator=generator) < survive_probability[:, None, :]
    survived = torch.cumprod(survived.long(), dim=-1).bool()
    ones = torch.ones_like(logits, dtype=torch.bool)
    return Rollouts(logits, survive_probability, ones, survived)


def test_sts_minimizes_a_proper_score_within_bounds():
    """ECE once pushed T_1 to 31.6 (c_1 ≈ 0.5 for every input); a proper score keeps informative confidences."""
    generator = torch.Generator().manual_seed(1)
    informative = torch.randn(4000, 2, generator=generator) * 2.0
    uninformative = torch.randn(4000, 2, generator=generator) * 2.0
    truth = torch.cumprod(torch.sigmoid(informative), dim=-1)
    temperatures = sequential_temperature_scaling(_synthetic_rollouts(informative, truth))
    assert temperatures[0] == pytest.approx(1.0, rel=0.2) and temperatures[1] == pytest.approx(1.0, rel=0.3)
    # logits that carry no information: the bounded grid stops at T = 4 instead of flattening c to a constant
    coin = torch.full_like(uninformative, 0.5).cumprod(dim=-1)
    flat = sequential_temperature_scaling(_synthetic_rollouts(uninformative, coin))
    assert flat[0] == pytest.approx(4.0) and max(flat) <= 4.0 and min(flat) >= 0.25
    predicted = survival_predictions(_synthetic_rollouts(uninformative, coin), flat)[:, 0]
    assert predicted.std() > 0.05, "no position collapses to a constant"


def test_sts_leaves_a_position_nobody_reached_uncalibrated():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(500, 3, generator=generator)
    probability = torch.sigmoid(logits).cumprod(dim=-1)
    probability[:, 2] = 0.0  # no draft 3 of the calibration set survives
    said = []
    temperatures = sequential_temperature_scaling(_synthetic_rollouts(logits, probability), log=said.append)
    assert temperatures[2] == 1.0
    assert said == ["position 3: no draft survived to it in the calibration set; left uncalibrated (T = 1)"]
