"""The DSpark model package: checkpoint layout, save/load, incremental context, slot conventions, heads, config errors."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_tiny_target
from safetensors import safe_open

from dspark_hf.presets import preset_config
from dspark_hf import DSparkConfig, DSparkContextCache, DSparkForDrafting
from dspark_hf.remote_code.configuration_dspark import REMOTE_CODE_FILES

REPO_ROOT = Path(__file__).resolve().parents[1]

# docs/design.md §3: the Kimi-K2.6 DSpark checkpoint (novita/kimi-k2.6-dspark).
KIMI_LAYER_TENSORS = {
    "self_attn.q_proj.weight": (7168, 7168),
    "self_attn.k_proj.weight": (1024, 7168),
    "self_attn.v_proj.weight": (1024, 7168),
    "self_attn.o_proj.weight": (7168, 7168),
    "self_attn.q_norm.weight": (128,),
    "self_attn.k_norm.weight": (128,),
    "mlp.gate_proj.weight": (18432, 7168),
    "mlp.up_proj.weight": (18432, 7168),
    "mlp.down_proj.weight": (7168, 18432),
    "input_layernorm.weight": (7168,),
    "post_attention_layernorm.weight": (7168,),
}
KIMI_OTHER_TENSORS = {
    "fc.weight": ((7168, 3 * 7168), torch.bfloat16),
    "hidden_norm.weight": ((7168,), torch.bfloat16),
    "norm.weight": ((7168,), torch.bfloat16),
    "embed_tokens.weight": ((163840, 7168), torch.bfloat16),
    "lm_head.weight": ((32000, 7168), torch.bfloat16),
    "d2t": ((32000,), torch.int64),
    "t2d": ((163840,), torch.bool),
    "markov_head.markov_w1.weight": ((163840, 256), torch.bfloat16),
    "markov_head.markov_w2.weight": ((32000, 256), torch.bfloat16),
    "confidence_head.proj.weight": ((1, 7168 + 256), torch.bfloat16),
    "confidence_head.proj.bias": ((1,), torch.bfloat16),
}
KIMI_PARAMETERS = 3_149_529_089  # every floating tensor above, summed (d2t/t2d are index buffers)


def test_kimi_preset_has_exactly_the_44_published_tensors():
    config = preset_config("kimi-k2.6")
    with torch.device("meta"):
        model = DSparkForDrafting._from_config(config, dtype=torch.bfloat16)
    state = model.state_dict()
    expected = {f"layers.{i}.{name}": (shape, torch.bfloat16) for i in range(3) for name, shape in KIMI_LAYER_TENSORS.items()}
    expected.update(KIMI_OTHER_TENSORS)
    assert len(expected) == 44
    assert set(state) == set(expected)
    for name, (shape, dtype) in expected.items():
        assert tuple(state[name].shape) == shape, name
        assert state[name].dtype == dtype, name
    parameters = sum(t.numel() for t in state.values() if t.is_floating_point())
    assert parameters == KIMI_PARAMETERS  # ≈3.15 B; bf16 ≈ 5.87 GiB
    assert config.num_draft_tokens == 7 and config.target_layer_ids == [0, 28, 56]
    assert config.speculators_config()["proposal_methods"][0]["speculative_tokens"] == 7


def _draft_all(drafter, aux, anchor):
    cache = drafter.extend_context(DSparkContextCache(), aux)
    return drafter.draft_block(cache, anchor)


@pytest.mark.parametrize("markov_head_type", ["vanilla", "rnn"])
def test_one_drafting_loop_drafts_each_row_of_a_padded_batch_as_that_row_alone(markov_head_type):
    """`draft` over a left-padded batch (each row its own context columns and positions) gives every row the drafts,
    logits and confidences `draft_block` gives it alone: the two drivers share one loop, one chooser, one schedule."""
    from dspark_hf.remote_code.scheduling_dspark import DSparkDraftSchedule
    from dspark_hf.remote_code.token_choice_dspark import DSparkTokenChooser

    target = make_tiny_target("llama")
    drafter = make_drafter(target, markov_head_type=markov_head_type, enable_confidence_head=True)
    torch.manual_seed(2)
    lengths, anchors = [5, 8, 3], torch.tensor([9, 4, 17])
    alone = [_draft_all(drafter, torch.randn(1, n, 3 * 64), a) for n, a in zip(lengths, anchors.tolist())]
    torch.manual_seed(2)
    rows = [torch.randn(1, n, 3 * 64) for n in lengths]
    mask = torch.tensor([[0] * (8 - n) + [1] * n for n in lengths])
    aux = torch.cat([torch.cat([r.new_zeros(1, 8 - r.shape[1], r.shape[2]), r], dim=1) for r in rows])
    positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    cache = drafter.extend_context(DSparkContextCache(), aux, positions)
    chooser = DSparkTokenChooser(drafter.draft_to_target_ids, drafter.config.vocab_size)
    batch = drafter.draft(cache, anchors, drafter.num_draft_tokens, chooser, DSparkDraftSchedule(),
                          mask.sum(-1), mask.bool())
    for row, own in enumerate(alone):
        assert torch.equal(batch.token_ids[row], own.token_ids[0])
        torch.testing.assert_close(batch.draft_logits[row], own.draft_logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch.confidences[row], own.confidences[0], rtol=1e-5, atol=1e-5)


def test_a_config_written_before_the_drafting_file_names_it_and_saves_every_auto_class_alike(tmp_path):
    """Configs saved when the drafter class lived in modeling_dspark load with the class where this code has it, and
    saving rewrites AutoModelForCausalLM with AutoModel (transformers' save sets AutoModel's entry alone)."""
    target = make_tiny_target("llama")
    make_drafter(target, draft_vocab_size=64).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": "modeling_dspark.DSparkForDrafting"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert DSparkConfig.from_pretrained(tmp_path).auto_map["AutoModelForCausalLM"] == "drafting_dspark.DSparkForDrafting"
    DSparkForDrafting.from_pretrained(tmp_path).save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())["auto_map"]
    assert saved["AutoModel"] == saved["AutoModelForCausalLM"] == "drafting_dspark.DSparkForDrafting"


def test_save_and_reload_with_trust_remote_code_in_a_fresh_process(tmp_path):
    target = make_tiny_target("llama")
    drafter = make_drafter(target, draft_vocab_size=64).to(torch.bfloat16)
    drafter.save_pretrained(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dspark.DSparkConfig",
        "AutoModel": "drafting_dspark.DSparkForDrafting",
        "AutoModelForCausalLM": "drafting_dspark.DSparkForDrafting",  # the habit for assistant models
    }
    assert config["model_type"] == "dspark" and config["speculators_model_type"] == "dspark"
    assert config["vocab_size"] == target.config.vocab_size
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert {p.name for p in tmp_path.glob("*.py")} == set(REMOTE_CODE_FILES)  # every file the model imports
    target.save_pretrained(tmp_path / "target")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}

    torch.manual_seed(1)
    aux = torch.randn(1, 9, 3 * 64)
    torch.save({"aux": aux}, tmp_path / "probe.pt")
    expected = _draft_all(drafter, aux.to(torch.bfloat16), 5)

    # A fresh interpreter in which the library itself cannot be imported: only torch + transformers + the copied files.
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class BlockLibrary(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "dspark_hf" or name.startswith("dspark_hf."):
                    raise ImportError("the remote code must not import dspark_hf")
        sys.meta_path.insert(0, BlockLibrary())
        import torch
        from transformers import AutoModel
        from safetensors.torch import load_file
        path = {str(tmp_path)!r}
        model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype="auto")
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        saved = load_file(path + "/model.safetensors")
        state = model.state_dict()
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor) and state[name].dtype == tensor.dtype, name
        inv_freq = 1.0 / (model.config.rope_theta ** (torch.arange(0, model.config.head_dim, 2).float() / model.config.head_dim))
        assert torch.equal(model.rotary_emb.inv_freq, inv_freq)
        aux = torch.load(path + "/probe.pt")["aux"].to(torch.bfloat16)
        cache = model.extend_context(type(model).__module__ and sys.modules[type(model).__module__].DSparkContextCache(), aux)
        out = model.draft_block(cache, 5)
        torch.save({{"tokens": out.token_ids, "logits": out.draft_logits, "conf": out.confidences}}, path + "/out.pt")
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(path + "/target", dtype=torch.float32)
        prompt = torch.tensor({prompt.tolist()!r})
        plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
        drafted = target.generate(prompt, assistant_model=model.float(), max_new_tokens=12, do_sample=False)
        assert torch.equal(plain, drafted) and model.last_generation_stats.rounds > 0, (plain, drafted)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    reloaded = torch.load(tmp_path / "out.pt")
    assert torch.equal(reloaded["tokens"], expected.token_ids)
    assert torch.equal(reloaded["logits"], expected.draft_logits)
    assert torch.equal(reloaded["conf"], expected.confidences)


def test_remote_code_files_import_only_torch_transformers_and_each_other():
    # the standard library, torch and transformers (safetensors/huggingface_hub/packaging come with it), nothing else
    allowed = {"torch", "transformers", "huggingface_hub", "safetensors", "packaging"} | set(sys.stdlib_module_names)
    for name in REMOTE_CODE_FILES:
        tree = ast.parse((REPO_ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{name} imports {roots - allowed}"


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated", "rnn"])
def test_incremental_context_cache_equals_full_recompute(markov_head_type):
    """Random accept patterns: appending committed positions round by round == building the context at once."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, markov_head_type=markov_head_type, block_size=5)
    generator = torch.Generator().manual_seed(0)
    for pattern in range(4 if markov_head_type == "vanilla" else 3):  # ≥ 10 patterns over the three variants
        total = 60
        aux = torch.randn(1, total, 3 * 64, generator=generator)
        tokens = torch.randint(3, 90, (total,), generator=generator)
        cache, committed = DSparkContextCache(), int(torch.randint(1, 10, (1,), generator=generator))
        drafter.extend_context(cache, aux[:, :committed])
        while committed < total - 6:
            incremental = drafter.draft_block(cache, tokens[committed])
            full = _draft_all(drafter, aux[:, :committed], tokens[committed])
            torch.testing.assert_close(incremental.draft_logits, full.draft_logits, rtol=1e-5, atol=1e-5)
            assert torch.equal(incremental.token_ids, full.token_ids)
            step = int(torch.randint(1, drafter.num_draft_tokens + 2, (1,), generator=generator))  # accepted + bonus
            drafter.extend_context(cache, aux[:, committed : committed + step])
            committed += step
        assert cache.get_seq_length() == committed


@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("markov_head_type", ["vanilla", "rnn"])
def test_training_forward_lines_up_with_inference_drafts(sample_from_anchor, markov_head_type):
    """Draft n of the training forward (label position p+n) is exactly inference draft n after anchor p."""
    target = make_tiny_target("qwen3")
    drafter = make_drafter(target, sample_from_anchor=sample_from_anchor, markov_head_type=markov_head_type)
    N = drafter.num_draft_tokens
    assert N == (4 if sample_from_anchor else 3)
    torch.manual_seed(3)
    T = 24
    aux = torch.randn(1, T, 3 * 64)
    input_ids = torch.randint(3, 90, (1, T))
    anchors = torch.tensor([[2, 7, 11, 15]])
    # Teacher forcing with the drafter's own greedy drafts makes both paths see the same previous tokens.
    for p in anchors[0].tolist():
        draft = _draft_all(drafter, aux[:, :p], input_ids[0, p])
        input_ids[0, p + 1 : p + 1 + N] = draft.token_ids[0]
    out = drafter(aux_hidden_states=aux, input_ids=input_ids, anchor_positions=anchors)
    assert out.logits.shape == (1, 4, N, drafter.config.draft_vocab_size)
    assert torch.equal(out.label_positions[0], anchors[0, :, None] + torch.arange(1, N + 1))
    for j, p in enumerate(anchors[0].tolist()):
        draft = _draft_all(drafter, aux[:, :p], input_ids[0, p])
        torch.testing.assert_close(out.logits[0, j], draft.draft_logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0, j]), draft.confidences[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(input_ids[0, out.label_positions[0, j]], draft.token_ids[0])


def test_eager_attention_reads_the_same_masks_as_sdpa():
    """transformers' eager kernel adds its mask to the scores: the drafter's bool masks (training's blocks and
    padding, a padded batch's context columns) become additive ones for it, and both kernels give the same rows."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, markov_head_type="vanilla", enable_confidence_head=True)
    torch.manual_seed(4)
    aux, ids, anchors = torch.randn(2, 20, 3 * 64), torch.randint(3, 90, (2, 20)), torch.tensor([[4, 12], [3, 9]])
    padding = torch.tensor([[1] * 20, [1] * 14 + [0] * 6])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cache = drafter.extend_context(DSparkContextCache(), aux[:, :5], (mask.cumsum(-1) - 1).clamp(min=0))
    outputs = {}
    for kernel in ("sdpa", "eager"):
        drafter.set_attn_implementation(kernel)
        training = drafter(aux_hidden_states=aux, input_ids=ids, anchor_positions=anchors, attention_mask=padding)
        outputs[kernel] = (training.logits, drafter.block_rows(cache, ids[:, 5], mask.sum(-1), mask.bool()))
    for sdpa, eager in zip(*outputs.values()):
        torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outputs["eager"][1][0], drafter.block_rows(cache, ids[:, 5], mask.sum(-1))[0], atol=1e-3)


def test_training_mask_hides_the_future_and_other_blocks():
    """Changing positions ≥ p (or another block's anchor) never changes block p's logits."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    torch.manual_seed(4)
    aux = torch.randn(1, 20, 3 * 64)
    ids = torch.randint(3, 90, (1, 20))
    anchors = torch.tensor([[4, 12]])
    base = drafter(aux_hidden_states=aux, input_ids=ids, anchor_positions=anchors).base_logits
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[:, 4:] += 1.0  # the future of anchor 4 (and the context of anchor 12)
    ids2[0, 12] = 7  # anchor 12's token
    changed = drafter(aux_hidden_states=aux2, input_ids=ids2, anchor_positions=anchors).base_logits
    torch.testing.assert_close(changed[0, 0], base[0, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[0, 1], base[0, 1])


@pytest.mark.parametrize("markov_head_type, markov_input_vocab", [
    ("vanilla", "target"), ("gated", "target"), ("rnn", "target"), ("vanilla", "draft"), ("rnn", "draft")])
def test_greedy_drafting_is_argmax_of_parallel_logits_plus_markov_bias(markov_head_type, markov_input_vocab):
    target = make_tiny_target("llama")
    drafter = make_drafter(target, markov_head_type=markov_head_type, draft_vocab_size=48,
                           markov_input_vocab=markov_input_vocab)
    with torch.no_grad():  # make the bias large enough to matter
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
        drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    torch.manual_seed(5)
    aux = torch.randn(1, 10, 3 * 64)
    cache = drafter.extend_context(DSparkContextCache(), aux)
    draft = drafter.draft_block(cache, 9)

    rows = drafter.block_rows(cache, torch.tensor([9]))
    hidden = drafter.block_hidden_states(cache, torch.tensor([9]))
    U = drafter.lm_head(hidden)
    head, prev, tokens = drafter.markov_head, torch.tensor([9]), []
    state = drafter._markov_start_state(rows, prev)  # rnn: slot 0 has stepped the recurrence
    for n in range(drafter.num_draft_tokens):
        bias, state = head.step(hidden[:, n], head.embed_previous(drafter.markov_rows(prev)), state)
        prev = drafter.draft_to_target_ids[(U[:, n] + bias).argmax(-1)]
        tokens.append(prev)
    assert torch.equal(draft.token_ids[0], torch.cat(tokens))
    no_bias = drafter.draft_to_target_ids[U.argmax(-1)][0]
    assert not torch.equal(draft.token_ids[0], no_bias), "the Markov bias should change some drafts here"
    assert draft.token_ids.max() < 96 and bool(drafter.t2d[draft.token_ids].all())


def test_a_markov_table_over_the_draft_vocabulary_has_a_row_per_draft_token_and_one_shared_by_the_rest():
    target = make_tiny_target("llama")  # vocabulary 96, draft vocabulary 48: the even ids
    drafter = make_drafter(target, draft_vocab_size=48, markov_input_vocab="draft")
    assert drafter.markov_head.markov_w1.weight.shape == (49, 8)
    rows = drafter.markov_rows(torch.tensor([[0, 2, 94], [1, 3, 95]]))
    assert rows.tolist() == [[0, 1, 47], [48, 48, 48]]
    assert torch.equal(drafter.markov_rows(drafter.draft_to_target_ids), torch.arange(48))
    with pytest.raises(ValueError, match="markov_input_vocab 'mixed'"):
        make_drafter(target, markov_input_vocab="mixed")


def test_vanilla_bias_depends_on_the_previous_token_only():
    target = make_tiny_target("llama")
    head = make_drafter(target).markov_head
    h1, h2 = torch.randn(2, 64), torch.randn(2, 64)
    prev = head.embed_previous(torch.tensor([5, 6]))
    assert torch.equal(head.block_bias(h1[:, None], prev[:, None]), head.block_bias(h2[:, None], prev[:, None]))
    other = head.embed_previous(torch.tensor([7, 6]))
    changed = head.block_bias(h1[:, None], other[:, None])
    assert not torch.equal(changed[0], head.block_bias(h1[:, None], prev[:, None])[0])
    assert torch.equal(changed[1], head.block_bias(h1[:, None], prev[:, None])[1])


def test_inference_reuses_a_recent_tokens_bias_row_until_the_weights_change():
    """The vanilla bias is a function of the previous token: drafting reuses the row computed for it (bit-identical,
    no read of W2), keeps at most `bias_cache_bytes` of rows, and recomputes after any change to W1 or W2."""
    target = make_tiny_target("llama")
    head = make_drafter(target).markov_head
    h1, h2 = torch.randn(1, 64), torch.randn(1, 64)
    prev = head.embed_previous(torch.tensor([5]))
    with torch.no_grad():
        first, _ = head.token_step(h1, torch.tensor([5]), prev, None)
        kept = head._bias_rows[5]
        again, _ = head.token_step(h2, torch.tensor([5]), prev, None)
        assert head._bias_rows[5] is kept and torch.equal(again, first) and torch.equal(first, head.step(h1, prev, None)[0])
        rows = torch.tensor([5, 7, 5])  # a batch's rows: each gets its own previous token's row
        batch, _ = head.token_step(h1.expand(3, -1), rows, head.embed_previous(rows), None)
        assert torch.equal(batch[0], first[0]) and torch.equal(batch[2], first[0])
        torch.testing.assert_close(batch[1], head.step(h1, head.embed_previous(torch.tensor([7])), None)[0][0])
        head.markov_w2.weight.mul_(2.0)  # an optimizer step or a load changes the weights in place
        changed, _ = head.token_step(h1, torch.tensor([5]), prev, None)
        assert not torch.equal(changed, first) and torch.equal(changed, head.step(h1, prev, None)[0])
        head.markov_w2.weight = torch.nn.Parameter(head.markov_w2.weight * 0.5)  # a new tensor in its place
        replaced, _ = head.token_step(h1, torch.tensor([5]), prev, None)
        assert torch.equal(replaced, head.step(h1, prev, None)[0]) and not torch.equal(replaced, changed)
        head.bias_cache_bytes = 3 * changed.numel() * changed.element_size()
        for token in range(10):
            head.token_step(h1, torch.tensor([token]), head.embed_previous(torch.tensor([token])), None)
        assert list(head._bias_rows) == [7, 8, 9]  # least recently used rows go first
        gated = make_drafter(target, markov_head_type="gated").markov_head
        prev = gated.embed_previous(torch.tensor([5]))
        assert not torch.equal(gated.token_step(h1, torch.tensor([5]), prev, None)[0], gated.token_step(h2, torch.tensor([5]), prev, None)[0])


def test_bias_rows_are_not_reused_when_an_adapter_wraps_the_markov_head():
    """A PEFT adapter on W2 can change (training) or switch without touching W2 itself: no row is reused then."""
    from peft import LoraConfig, get_peft_model

    target = make_tiny_target("llama")
    model = get_peft_model(make_drafter(target), LoraConfig(r=2, target_modules=["markov_w2"]))
    head = model.base_model.model.markov_head
    h, prev = torch.randn(1, 64), head.embed_previous(torch.tensor([5]))
    with torch.no_grad():
        before, _ = head.token_step(h, torch.tensor([5]), prev, None)
        head.markov_w2.lora_B["default"].weight.normal_()  # an adapter update; W2's own weight is untouched
        after, _ = head.token_step(h, torch.tensor([5]), prev, None)
    assert not torch.equal(before, after) and torch.equal(after, head.step(h, prev, None)[0])


def test_rnn_bias_carries_state_and_gated_bias_reads_the_hidden_row():
    target = make_tiny_target("llama")
    rnn = make_drafter(target, markov_head_type="rnn").markov_head
    hidden, prev = torch.randn(1, 3, 64), rnn.embed_previous(torch.tensor([[4, 5, 6]]))
    bias = rnn.block_bias(hidden, prev)
    prev_changed = prev.clone()
    prev_changed[0, 0] = rnn.embed_previous(torch.tensor(9))
    later = rnn.block_bias(hidden, prev_changed)
    assert not torch.allclose(later[0, 2], bias[0, 2])  # an earlier token reaches draft 3 through the state
    gated = make_drafter(target, markov_head_type="gated").markov_head
    prev = gated.embed_previous(torch.tensor([[4]]))
    assert not torch.allclose(gated.block_bias(hidden[:, :1], prev), gated.block_bias(hidden[:, :1] + 1, prev))


def reference_rnn_logits(drafter, rows: torch.Tensor, block_tokens: list[int]) -> torch.Tensor:
    """Slow, literal rnn Markov recurrence over every slot 0..B-1 of one block, as speculators 0.9.0 runs it.

    rows (B, d) are the block's normalized rows; block_tokens [x_p, x_p+1, ...] the anchor and the tokens after it.
    Slot k's previous token is x_p+k-1 (x_p for slot 0) with `sample_from_anchor`, else x_p+k-2 (x_p for slots 0, 1);
    the state starts at zero on slot 0 and every slot updates it. Returns the logits of the drafting slots (N, V_d).
    """
    head, B = drafter.markov_head, drafter.config.block_size
    shift = 1 if drafter.config.sample_from_anchor else 2
    r = head.markov_rank
    state, logits = torch.zeros(r), []
    for k in range(B):
        prev = block_tokens[max(k + 1 - shift, 0)]
        z = torch.cat([state, head.markov_w1.weight[prev], rows[k]])
        projected = head.joint_proj.weight @ z + head.joint_proj.bias
        gate, candidate, output = torch.sigmoid(projected[:r]), torch.tanh(projected[r : 2 * r]), projected[2 * r :]
        state = gate * state + (1 - gate) * candidate
        logits.append(drafter.lm_head.weight @ rows[k] + head.markov_w2.weight @ torch.tanh(output))
    logits = torch.stack(logits)
    return logits if drafter.config.sample_from_anchor else logits[1:]


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_rnn_markov_head_runs_the_recurrence_over_every_slot(sample_from_anchor):
    """Training forward and `draft_block` both equal the slow slot-0..B-1 recurrence (speculators' rnn semantics)."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, markov_head_type="rnn", sample_from_anchor=sample_from_anchor, block_size=5)
    with torch.no_grad():  # a strong recurrence, so that skipping slot 0 would show in every draft
        drafter.markov_head.joint_proj.weight.normal_(0, 0.5)
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
        drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    torch.manual_seed(7)
    T, p = 16, 9
    aux, input_ids = torch.randn(1, T, 3 * 64), torch.randint(3, 90, (1, T))
    draft = _draft_all(drafter, aux[:, :p], input_ids[0, p])
    N = drafter.num_draft_tokens
    input_ids[0, p + 1 : p + 1 + N] = draft.token_ids[0]  # teacher-force the drafter's own drafts
    cache = drafter.extend_context(DSparkContextCache(), aux[:, :p])
    rows = drafter.block_rows(cache, input_ids[0, p : p + 1])[0]
    with torch.no_grad():
        expected = reference_rnn_logits(drafter, rows, input_ids[0, p : p + 1 + N].tolist())
    torch.testing.assert_close(draft.draft_logits[0], expected, rtol=1e-5, atol=1e-5)
    out = drafter(aux_hidden_states=aux, input_ids=input_ids, anchor_positions=torch.tensor([[p]]))
    torch.testing.assert_close(out.logits[0, 0], expected, rtol=1e-5, atol=1e-5)


def test_confidence_head_and_temperatures_shape_the_survival():
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=6)
    torch.manual_seed(6)
    aux = torch.randn(1, 8, 3 * 64)
    draft = _draft_all(drafter, aux, 3)
    c = draft.confidences[0]
    torch.testing.assert_close(draft.survival[0], torch.cumprod(c, 0))
    drafter.config.confidence_temperatures = [2.0] * drafter.num_draft_tokens
    warmer = _draft_all(drafter, aux, 3).confidences[0]
    logits = torch.logit(c.double())
    torch.testing.assert_close(warmer.double(), torch.sigmoid(logits / 2.0), rtol=1e-5, atol=1e-6)
    # A survival threshold cuts the block at the first draft whose survival drops below it.
    threshold = float(draft.survival[0, 2])
    drafter.config.confidence_temperatures = [1.0] * drafter.num_draft_tokens
    cache = drafter.extend_context(DSparkContextCache(), aux)
    cut = drafter.draft_block(cache, 3, confidence_threshold=threshold + 1e-6)
    assert cut.token_ids.shape[1] == 2 and torch.equal(cut.token_ids, draft.token_ids[:, :2])


def test_confidence_head_without_markov_features():
    target = make_tiny_target("llama")
    drafter = make_drafter(target, confidence_head_with_markov=False)
    assert drafter.confidence_head.proj.weight.shape == (1, 64)
    drafter = make_drafter(target, markov_rank=0, enable_confidence_head=True)
    assert drafter.markov_head is None and drafter.confidence_head.proj.weight.shape == (1, 64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"markov_head_type": "lstm"}, "unknown markov_head_type 'lstm'"),
        ({"mask_token_id": 96}, "mask_token_id=96 is outside the vocabulary"),
        ({"mask_token_id": -1}, "mask_token_id=-1 is outside the vocabulary"),
        ({"draft_vocab_size": 97}, "draft_vocab_size=97 is larger than the vocabulary"),
        ({"hidden_size": 32}, "differs from target_hidden_size"),
        ({"aux_hidden_state_layer_ids": [1, 5]}, "beyond the target's 4 layers"),
        ({"confidence_temperatures": [1.0]}, "confidence_temperatures needs 3 positive values"),
        ({"markov_rank": 0, "markov_head_type": "rnn"}, "needs markov_rank > 0"),
    ],
)
def test_config_errors_are_one_clear_line(overrides, message):
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match=message) as error:
        make_drafter(target, **{"target_hidden_size": overrides.get("target_hidden_size", 64), **overrides})
    assert "\n" not in str(error.value)


def test_checkpoint_whose_shapes_disagree_with_its_config_is_refused(tmp_path):
    target = make_tiny_target("llama")
    make_drafter(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 128
    config["transformer_layer_config"]["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight has shape \(64, 128\) in the checkpoint but \(64, 96\)") as error:
        DSparkForDrafting.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)


def test_checkpoint_without_target_copies_binds_them_from_the_target(tmp_path):
    target = make_tiny_target("llama")
    drafter = make_drafter(target, draft_vocab_size=50, bind_target_embeddings=True)
    drafter.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in f.keys() and "lm_head.weight" not in f.keys()
    reloaded = DSparkForDrafting.from_pretrained(tmp_path)
    reloaded.bind_target(target)
    assert torch.equal(reloaded.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(reloaded.lm_head.weight, target.lm_head.weight[reloaded.t2d])


@pytest.mark.parametrize("checkpoint", sorted(p.parent.name for p in (REPO_ROOT / "examples").glob("*/config.json")))
def test_shipped_checkpoints_carry_the_current_remote_code(checkpoint):
    """A shipped drafter loads with its own copy of the code: it must be the code in this repository."""
    for name in REMOTE_CODE_FILES:
        assert (REPO_ROOT / "examples" / checkpoint / name).read_bytes() == (REPO_ROOT / name).read_bytes(), name
