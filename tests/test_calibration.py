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
