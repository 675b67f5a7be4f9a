"""LoRA adaptation: only adapter weights train; adapter save → load → merge gives the same drafts."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from test_training import tiny_args, tiny_world, trained_run
from transformers import AutoModel, LlamaForCausalLM

from dspark_hf import DSparkContextCache, DSparkForDrafting
from dspark_hf.cache import HiddenStateCache
from dspark_hf.cli import main as dspark_cli
from dspark_hf.training.lora import load_adapter, lora_target_modules
from dspark_hf.training.trainer import train


def _draft(drafter, sample, anchors=(12, 20, 31)):
    """Greedy blocks after several anchors of one cached sample: (token ids, draft logits)."""
    tokens, logits = [], []
    for p in anchors:
        cache = drafter.extend_context(DSparkContextCache(), sample["aux_hidden_states"][None, :p].float())
        out = drafter.draft_block(cache, sample["input_ids"][p])
        tokens.append(out.token_ids)
        logits.append(out.draft_logits)
    return torch.cat(tokens), torch.cat(logits)


def test_lora_trains_only_adapters_and_round_trips(tmp_path):
    world, base_dir = tiny_world(), trained_run()["drafter"]
    result = train(tiny_args(tmp_path / "lora", init_from=base_dir, lora=True, lora_rank=4, lora_fc=True,
                             merge_lora=True, max_steps=10, drafter_config={}, draft_vocab=None))
    target = LlamaForCausalLM.from_pretrained(world["target"])  # the drafters bind embed/head from it

    def base_drafter():
        drafter = DSparkForDrafting.from_pretrained(base_dir)
        drafter.bind_target(target)
        return drafter

    base = base_drafter().state_dict()

    # only LoRA parameters moved: every base tensor in the trained PEFT state equals the base checkpoint
    state = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))
    lora_keys = [k for k in state if "lora_" in k]
    assert lora_keys and any(".fc." in k for k in lora_keys)
    for key, value in state.items():
        if "lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(value, base[name]), name
    assert any(state[k].abs().sum() > 0 for k in lora_keys if "lora_B" in k)  # B starts at zero: it trained
    adapter = load_file(str(Path(result["adapter"]) / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)

    # adapter on top of the base drafter == merged plain checkpoint (AutoModel, remote code)
    sample = HiddenStateCache(world["test"])[0]
    with_adapter = load_adapter(base_drafter(), result["adapter"]).eval()
    merged = AutoModel.from_pretrained(result["drafter"], trust_remote_code=True).eval()
    merged.bind_target(target)
    tokens_a, logits_a = _draft(with_adapter.get_base_model(), sample)
    tokens_m, logits_m = _draft(merged, sample)
    assert torch.equal(tokens_a, tokens_m)
    torch.testing.assert_close(logits_a, logits_m, rtol=1e-4, atol=1e-4)
    tokens_base, _ = _draft(base_drafter(), sample)
    assert tokens_base.shape == tokens_m.shape

    # the CLI merge of a finished adapter writes the same plain checkpoint
    assert dspark_cli(["train", "--merge-adapter", base_dir, result["adapter"], "--output-dir", str(tmp_path / "m")]) == 0
    cli_merged, trained_merged = load_file(str(tmp_path / "m" / "model.safetensors")), load_file(str(Path(result["drafter"]) / "model.safetensors"))
    assert cli_merged.keys() == trained_merged.keys()
    for key in cli_merged:
        torch.testing.assert_close(cli_merged[key], trained_merged[key], rtol=0, atol=1e-6)


def test_lora_targets_draft_layer_projections_only():
    import re

    pattern = lora_target_modules(include_fc=False)
    assert re.fullmatch(pattern, "layers.0.self_attn.q_proj") and re.fullmatch(pattern, "layers.2.mlp.down_proj")
    assert not re.fullmatch(pattern, "fc") and not re.fullmatch(pattern, "lm_head")
    assert not re.fullmatch(pattern, "markov_head.markov_w2") and re.fullmatch(lora_target_modules(True), "fc")
