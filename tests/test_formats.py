"""Interop: drafters trained elsewhere load here with identical drafts, and ours export in exactly docs/design.md §3's layout.

Source directories are built in tmp_path with the other projects' own key names (z-lab DFlash `dflash_config`,
DeepSpec `Qwen3DSparkModel`, speculators `transformer_layer_config` diffs), holding the weights of a drafter we know,
so "identical drafts after conversion" is a real check of every convention translated on the way.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from conftest import make_drafter, make_tiny_target
from dspark_hf.presets import preset_config
from dspark_hf import DSparkConfig, DSparkContextCache, DSparkForDrafting
from dspark_hf.cli import main as cli_main
from dspark_hf.formats.convert import convert
from dspark_hf.formats.export import export
from dspark_hf.formats.speculators import read_speculators, write_checkpoint
from dspark_hf.remote_code.configuration_dspark import REMOTE_CODE_FILES

TARGET_LAYERS = 4


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3", layers=TARGET_LAYERS)


def drafts(drafter, seed=0, contexts=(5, 11), anchors=(3, 17, 94)):
    """Every draft output for a few contexts and anchors (greedy), as a flat list of tensors."""
    generator = torch.Generator().manual_seed(seed)
    m = len(drafter.config.aux_hidden_state_layer_ids)
    dtype = drafter.fc.weight.dtype
    out = []
    for length in contexts:
        aux = torch.randn(1, length, m * drafter.config.target_hidden_size, generator=generator).to(dtype)
        cache = drafter.extend_context(DSparkContextCache(), aux)
        for anchor in anchors:
            block = drafter.draft_block(cache, anchor)
            out += [block.token_ids, block.draft_logits]
            if block.confidences is not None:
                out.append(block.confidences)
    return out


def assert_same_drafts(original, converted):
    """Identical draft tokens; logits and confidences equal up to float rounding.

    Rounding only: the weights are compared bit for bit elsewhere, but the CPU GEMM kernels pick different
    blockings for differently aligned buffers (a model loaded from safetensors vs one built in memory), which moves
    the last bit of an fp32 logit; a natively saved and reloaded drafter shows the same ~1e-8 differences.
    """
    left, right = drafts(original), drafts(converted)
    assert len(left) == len(right)
    for x, y in zip(left, right):
        if x.dtype == torch.long:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6 if x.dtype == torch.float32 else 1e-2)


def assert_same_weights(original, converted):
    a, b = original.state_dict(), converted.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name].to(a[name].dtype)), name


def reload(directory, target=None):
    drafter = DSparkForDrafting.from_pretrained(directory).eval()
    if drafter.config.bind_target_embeddings:
        drafter.bind_target(target)
    return drafter


def geometry(config: DSparkConfig) -> dict:
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
    }


def tensors_of(drafter, drop=()):
    return {k: v.clone().contiguous() for k, v in drafter.state_dict().items() if k not in drop}


# ----------------------------------------------------------------------------------------------------------------
# Source directories in the other projects' layouts


def write_zlab(path, drafter, prefix=""):
    """z-lab DFlash: Qwen3 config top level, `dflash_config`, `block_size`, no embed/head/vocab maps."""
    c = drafter.config
    path.mkdir()
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **geometry(c),
        "rope_theta": c.rope_theta,  # 4.x-style field, as in the published z-lab configs
        "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids},
        "num_target_layers": TARGET_LAYERS,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    drop = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")
    save_file({prefix + k: v for k, v in tensors_of(drafter, drop).items()}, path / "model.safetensors")
    return path


def write_deepspec(path, drafter):
    """DeepSpec dense: target config copy + DSpark fields, full-vocab embed/head, its own keys; no d2t/t2d."""
    c = drafter.config
    path.mkdir()
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **geometry(c),
        "rope_theta": c.rope_theta,
        "num_target_layers": TARGET_LAYERS,
        "block_size": c.block_size,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": c.target_layer_ids,
        "num_anchors": 512,
        "enable_confidence_head": c.enable_confidence_head,
        "markov_rank": c.markov_rank,
    }
    if c.enable_confidence_head:  # DeepSpec writes these two only when they apply
        config["confidence_head_with_markov"] = c.confidence_head_with_markov
    if c.markov_rank:
        config["markov_head_type"] = c.markov_head_type
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors_of(drafter, ("d2t", "t2d")), path / "model.safetensors")
    return path


def write_speculators(path, drafter, algorithm):
    """speculators DFlash/DSpark: `transformer_layer_config` as a Qwen3 diff dict, no embed_tokens, verifier copies."""
    c = drafter.config
    path.mkdir()
    layer = Qwen3Config(**geometry(c), rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    config = {
        "speculators_model_type": algorithm,
        "architectures": ["DSparkSpeculator" if algorithm == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": layer.to_diff_dict(),
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": c.aux_hidden_state_layer_ids,
        "target_hidden_size": c.target_hidden_size,
        "mask_token_id": c.mask_token_id,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/qwen3", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    if algorithm == "dspark":
        config.update(markov_rank=c.markov_rank, markov_head_type=c.markov_head_type, num_anchors=256,
                      enable_confidence_head=c.enable_confidence_head,
                      confidence_head_with_markov=c.confidence_head_with_markov)
    # sample_from_anchor deliberately absent: the reader must apply speculators' per-algorithm default.
    (path / "config.json").write_text(json.dumps(config))
    drop = ["embed_tokens.weight"]
    if c.draft_vocab_size == c.vocab_size:  # speculators keeps lm_head/d2t/t2d only for a reduced vocabulary
        drop += ["lm_head.weight", "d2t", "t2d"]
    tensors = tensors_of(drafter, drop)
    tensors["verifier_norm.weight"] = torch.ones(c.hidden_size)  # training-time copy, never part of the drafter
    save_file(tensors, path / "model.safetensors")
    return path


# ----------------------------------------------------------------------------------------------------------------
# Round trips: convert -> save -> reload gives identical drafts


def test_zlab_dflash_converts_to_identical_drafts(target, tmp_path):
    original = make_drafter(target, markov_rank=0, enable_confidence_head=False, block_size=5)
    source = write_zlab(tmp_path / "zlab", original, prefix="model.")
    out = convert(source, tmp_path / "out", "zlab-dflash")

    converted = reload(out, target)
    cfg = converted.config
    assert cfg.aux_hidden_state_layer_ids == original.config.aux_hidden_state_layer_ids  # target_layer_ids + 1
    assert cfg.sample_from_anchor is False and cfg.num_draft_tokens == 4
    assert cfg.markov_rank == 0 and not cfg.enable_confidence_head and cfg.bind_target_embeddings
    assert_same_weights(original, converted)
    assert_same_drafts(original, converted)

    record = json.loads((out / "conversion.json").read_text())
    assert record["source_format"] == "zlab-dflash"
    assert record["layer_ids"]["source_values"] == [i - 1 for i in cfg.aux_hidden_state_layer_ids]
    assert record["layer_ids"]["aux_hidden_state_layer_ids"] == cfg.aux_hidden_state_layer_ids
    assert record["sample_from_anchor"]["value"] is False and record["stripped_prefix"] == "model."


@pytest.mark.parametrize("heads", ["dspark", "dflash"])
def test_deepspec_converts_to_identical_drafts(target, tmp_path, heads):
    if heads == "dspark":  # aux 0 = embeddings: DeepSpec writes -1 for it
        original = make_drafter(target, sample_from_anchor=True, markov_head_type="gated",
                                aux_hidden_state_layer_ids=[0, 2, 3], confidence_head_with_markov=True)
    else:
        original = make_drafter(target, sample_from_anchor=True, markov_rank=0, enable_confidence_head=False)
    source = write_deepspec(tmp_path / "deepspec", original)
    out = convert(source, tmp_path / "out", "deepspec")

    converted = reload(out)
    cfg = converted.config
    assert cfg.sample_from_anchor is True and cfg.num_draft_tokens == cfg.block_size
    assert cfg.aux_hidden_state_layer_ids == original.config.aux_hidden_state_layer_ids
    assert (cfg.markov_rank, cfg.markov_head_type, cfg.enable_confidence_head) == (
        original.config.markov_rank, original.config.markov_head_type, original.config.enable_confidence_head)
    assert not cfg.bind_target_embeddings and cfg.draft_vocab_size == cfg.vocab_size
    assert_same_weights(original, converted)
    assert_same_drafts(original, converted)
    record = json.loads((out / "conversion.json").read_text())
    assert record["layer_ids"]["source_values"] == original.config.target_layer_ids
    assert record["dropped_config_keys"] == ["num_anchors"]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_speculators_converts_to_identical_drafts(target, tmp_path, algorithm):
    if algorithm == "dflash":  # reduced draft vocabulary, z-lab slot convention (speculators' DFlash default)
        original = make_drafter(target, markov_rank=0, enable_confidence_head=False, draft_vocab_size=40)
    else:  # full vocabulary, DeepSpec slot convention (speculators' DSpark default), RNN Markov head
        original = make_drafter(target, sample_from_anchor=True, markov_head_type="rnn",
                                confidence_head_with_markov=False)
    source = write_speculators(tmp_path / "spec", original, algorithm)
    out = convert(source, tmp_path / "out", "speculators")

    converted = reload(out, target)
    assert converted.config.sample_from_anchor is original.config.sample_from_anchor
    assert converted.config.draft_vocab_size == original.config.draft_vocab_size
    assert converted.config.verifier_name_or_path == "tiny/qwen3"
    assert_same_weights(original, converted)
    assert_same_drafts(original, converted)
    record = json.loads((out / "conversion.json").read_text())
    assert record["sample_from_anchor"]["rule"].startswith("absent: speculators default")
    assert "verifier_norm.weight" in record["dropped_tensors"]


def test_own_checkpoint_reads_back_unchanged(target, tmp_path):
    original = make_drafter(target, draft_vocab_size=50, markov_head_type="gated")
    original.save_pretrained(tmp_path / "ours")
    write_checkpoint(read_speculators(tmp_path / "ours"), tmp_path / "again")
    assert_same_drafts(original, reload(tmp_path / "again"))
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (tmp_path / "ours" / "config.json").read_text())


def test_convert_cli_writes_and_reports(target, tmp_path, capsys):
    original = make_drafter(target, markov_rank=0, enable_confidence_head=False)
    source = write_zlab(tmp_path / "zlab", original)
    assert cli_main(["convert", "--from", "zlab-dflash", str(source), str(tmp_path / "out")]) == 0
    assert_same_drafts(original, reload(tmp_path / "out", target))


# ----------------------------------------------------------------------------------------------------------------
# Each converter rejects a wrong-shaped file with one clear line, and writes nothing


def _corrupt(path, name, shape):
    tensors = {}
    with safe_open(path / "model.safetensors", "pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    tensors[name] = torch.zeros(shape)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "source_format, tensor, shape",
    [
        ("zlab-dflash", "fc.weight", (64, 128)),
        ("deepspec", "markov_head.markov_w2.weight", (96, 4)),
        ("speculators", "layers.0.self_attn.k_proj.weight", (64, 64)),
    ],
)
def test_each_converter_rejects_a_wrong_shaped_tensor(target, tmp_path, capsys, source_format, tensor, shape):
    if source_format == "zlab-dflash":
        source = write_zlab(tmp_path / "src", make_drafter(target, markov_rank=0, enable_confidence_head=False))
    elif source_format == "deepspec":
        source = write_deepspec(tmp_path / "src", make_drafter(target, sample_from_anchor=True))
    else:
        source = write_speculators(tmp_path / "src", make_drafter(target, draft_vocab_size=40), "dspark")
    _corrupt(source, tensor, shape)

    with pytest.raises(ValueError) as error:
        convert(source, tmp_path / "out", source_format)
    message = str(error.value)
    assert "\n" not in message
    assert f"`{tensor}`" in message and str(list(shape)) in message and "config.json implies" in message
    assert "fix" in message
    assert not (tmp_path / "out").exists()

    assert cli_main(["convert", "--from", source_format, str(source), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and tensor in err


def test_unsupported_variants_are_named(target, tmp_path):
    source = write_zlab(tmp_path / "src", make_drafter(target, markov_rank=0, enable_confidence_head=False))
    config = json.loads((source / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_attention"):
        convert(source, tmp_path / "out", "zlab-dflash")


# ----------------------------------------------------------------------------------------------------------------
# Export: exactly docs/design.md §3, field by field; the Kimi-shaped tiny checkpoint passes the checks the real layout does


def design_layout(config: dict, tensors: dict[str, tuple[tuple[int, ...], str]]):
    """docs/design.md §3, spelled out: every config key and every tensor name, shape and dtype of a DSpark checkpoint."""
    L, d, H, KV, hd = (config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    V_t, V_d, r, m = config["vocab_size"], config["draft_vocab_size"], config["markov_rank"], len(
        config["aux_hidden_state_layer_ids"])
    ffn = config["intermediate_size"]
    expected = {"fc.weight": (d, m * config["target_hidden_size"]), "hidden_norm.weight": (d,), "norm.weight": (d,),
                "embed_tokens.weight": (V_t, d), "lm_head.weight": (V_d, d), "d2t": (V_d,), "t2d": (V_t,),
                "markov_head.markov_w1.weight": (V_t, r), "markov_head.markov_w2.weight": (V_d, r),
                "confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)}
    for i in range(L):
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (H * hd, d), p + "self_attn.k_proj.weight": (KV * hd, d),
            p + "self_attn.v_proj.weight": (KV * hd, d), p + "self_attn.o_proj.weight": (d, H * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (ffn, d), p + "mlp.up_proj.weight": (ffn, d),
            p + "mlp.down_proj.weight": (d, ffn),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
    assert set(tensors) == set(expected), set(tensors) ^ set(expected)
    for name, (shape, dtype) in tensors.items():
        assert tuple(shape) == expected[name], name
        assert dtype == {"d2t": "I64", "t2d": "BOOL"}.get(name, "BF16"), name
    assert len(tensors) == 11 * L + 11

    # config.json, field by field
    assert config["speculators_model_type"] == "dspark" and config["model_type"] == "dspark"
    assert config["architectures"] == ["DSparkForDrafting"]
    assert config["auto_map"] == {"AutoConfig": "configuration_dspark.DSparkConfig",
                                  "AutoModel": "drafting_dspark.DSparkForDrafting",
                                  "AutoModelForCausalLM": "drafting_dspark.DSparkForDrafting"}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "vocab_size"):
        assert layer[key] == config[key], key
    assert layer["rope_parameters"]["rope_theta"] == config["rope_parameters"]["rope_theta"]
    for key in ("draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "target_hidden_size", "mask_token_id",
                "sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "vocab_size"):
        assert key in config, key
    n = config["block_size"] - (0 if config["sample_from_anchor"] else 1)
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dspark" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": n}]
    assert set(spec["verifier"]) == {"name_or_path", "architectures"} and spec["verifier"]["name_or_path"]


def read_layout(directory):
    with safe_open(directory / "model.safetensors", "pt") as f:
        tensors = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    return json.loads((directory / "config.json").read_text()), tensors


def test_kimi_preset_layout_is_design_section_3():
    """The real Kimi-K2.6 layout (built on the meta device): 44 tensors, ≈3.15 B parameters, docs/design.md §3 exactly."""
    config = preset_config("kimi-k2.6")
    with torch.device("meta"):
        model = DSparkForDrafting(config).to(torch.bfloat16)
    names = {"torch.bfloat16": "BF16", "torch.int64": "I64", "torch.bool": "BOOL"}
    tensors = {k: (tuple(v.shape), names[str(v.dtype)]) for k, v in model.state_dict().items()}
    design_layout(json.loads(config.to_json_string()), tensors)
    assert len(tensors) == 44
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 3.15) < 0.01


def test_kimi_shaped_tiny_export_is_design_section_3(target, tmp_path):
    tiny = make_drafter(target, num_hidden_layers=3, aux_hidden_state_layer_ids=[1, 2, 3], draft_vocab_size=48,
                        block_size=8, sample_from_anchor=False, markov_rank=8, markov_head_type="vanilla",
                        enable_confidence_head=True, confidence_head_with_markov=True)
    tiny.save_pretrained(tmp_path / "trained")
    out = export(tmp_path / "trained", tmp_path / "export", verifier="tiny/qwen3",
                 verifier_architectures=["Qwen3ForCausalLM"])

    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *REMOTE_CODE_FILES])
    config, tensors = read_layout(out)
    design_layout(config, tensors)
    assert len(tensors) == 44  # same count as the Kimi card
    kimi = preset_config("kimi-k2.6")
    with torch.device("meta"):
        assert set(tensors) == set(DSparkForDrafting(kimi).state_dict())  # same names as the real layout
    assert config["speculators_config"]["verifier"] == {"name_or_path": "tiny/qwen3",
                                                        "architectures": ["Qwen3ForCausalLM"]}

    exported = reload(out)
    assert_same_drafts(tiny.to(torch.bfloat16), exported)
    # and it converts back through the speculators reader unchanged
    assert_same_drafts(exported, reload(write_checkpoint(read_speculators(out), tmp_path / "again")))


def test_export_writes_bound_embeddings_from_the_target(target, tmp_path):
    drafter = make_drafter(target, draft_vocab_size=40, bind_target_embeddings=True)
    drafter.save_pretrained(tmp_path / "bound")
    with safe_open(tmp_path / "bound" / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in f.keys()

    with pytest.raises(ValueError, match="--target"):
        export(tmp_path / "bound", tmp_path / "nope", verifier="tiny/qwen3")
    out = export(tmp_path / "bound", tmp_path / "export", verifier="tiny/qwen3", target=target, dtype="float32")
    config, tensors = read_layout(out)
    assert config["bind_target_embeddings"] is False and "embed_tokens.weight" in tensors
    exported = reload(out)
    assert torch.equal(exported.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(exported.lm_head.weight, target.lm_head.weight[drafter.draft_to_target_ids])
    assert_same_drafts(drafter, exported)


def test_export_writes_a_draft_vocabulary_markov_table_row_by_target_token(target, tmp_path):
    """vLLM and speculators index W1 by target id: export expands the draft-vocabulary table exactly."""
    drafter = make_drafter(target, draft_vocab_size=40, markov_input_vocab="draft")
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)  # large enough to move drafts
    drafter.save_pretrained(tmp_path / "draft-table")
    out = export(tmp_path / "draft-table", tmp_path / "export", verifier="tiny/qwen3", dtype="float32")
    config, table = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")["markov_head.markov_w1.weight"]
    vocab = drafter.config.vocab_size
    assert config["markov_input_vocab"] == "target" and table.shape == (vocab, 8)
    assert torch.equal(table, drafter.markov_head.markov_w1.weight[drafter.markov_rows(torch.arange(vocab))])
    assert_same_drafts(drafter, reload(out))


def test_rerunning_a_finished_export_or_conversion_is_a_no_op_that_says_so(target, tmp_path, capsys):
    drafter = make_drafter(target, draft_vocab_size=40, bind_target_embeddings=False)
    drafter.save_pretrained(tmp_path / "trained")
    export_args = ["export", str(tmp_path / "trained"), str(tmp_path / "exported"), "--verifier", "tiny/qwen3",
                   "--no-progress"]
    assert cli_main(export_args) == 0
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "exported").iterdir()}
    assert cli_main(export_args) == 0
    assert f"already holds this export of {tmp_path / 'trained'}; nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "exported").iterdir()} == written
    assert cli_main([*export_args, "--dtype", "float32"]) == 1  # other settings: refused, the export kept
    assert "exported holds another export (other files than this command writes); choose a new output directory" in (
        capsys.readouterr().err)
    source = write_zlab(tmp_path / "zlab", make_drafter(target, markov_rank=0, enable_confidence_head=False))
    convert_args = ["convert", "--from", "zlab-dflash", str(source), str(tmp_path / "converted")]
    assert cli_main(convert_args) == 0 and cli_main(convert_args) == 0
    assert "already holds this conversion" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*partial*"))  # no staging folder left behind
