"""A GGUF file works as `--target` for every command: dequantized once into a cached dense copy, weights exact."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from conftest import make_tiny_target, run_launch, two_process_launch

from dspark_hf import cli
from dspark_hf.assets import smollm2_gguf_path
from dspark_hf.targets import load_target


def _permute(weight, heads: int):
    """llama.cpp's q/k row order (what its converters write; transformers' GGUF loader undoes it)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path, model, tokenizer_source) -> None:
    """`model` (a tiny Llama) as an F32 GGUF file with the tokenizer and chat template of `tokenizer_source`."""
    reader = gguf.GGUFReader(tokenizer_source)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    weights = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        layer = lambda name: weights[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        writer.add_tensor(f"blk.{i}.attn_norm.weight", layer("input_layernorm"))
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(layer("self_attn.q_proj"), config.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(layer("self_attn.k_proj"), config.num_key_value_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", layer("self_attn.v_proj"))
        writer.add_tensor(f"blk.{i}.attn_output.weight", layer("self_attn.o_proj"))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", layer("post_attention_layernorm"))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", layer("mlp.gate_proj"))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", layer("mlp.up_proj"))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", layer("mlp.down_proj"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_target_loads_exactly_from_one_cached_dense_copy(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    source = smollm2_gguf_path()
    vocab = len(gguf.GGUFReader(source).fields["tokenizer.ggml.tokens"].data)
    tiny = make_tiny_target("llama", vocab_size=vocab, layers=2)
    path = tmp_path / "my-model.gguf"
    write_tiny_gguf(path, tiny, source)

    model, tokenizer = load_target(str(path))
    ids = torch.tensor([[1, 5, 9, 200, 3000]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny(ids).logits)
    assert tokenizer.chat_template and model.name_or_path == str(path.resolve())  # recorded as the file the user named
    (copy,) = (tmp_path / "cache" / "gguf").iterdir()
    built = (copy / "model.safetensors").stat().st_mtime_ns

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    assert cli.main(["regenerate", "--target", str(path), "--input", str(data), "--output", str(tmp_path / "o.jsonl"),
                     "--max-new-tokens", "2", "--no-progress"]) == 0, capsys.readouterr().err
    assert list((tmp_path / "cache" / "gguf").iterdir()) == [copy] and (copy / "model.safetensors").stat().st_mtime_ns == built


@pytest.mark.slow
def test_launched_processes_share_one_dense_copy_built_by_the_main_process(tmp_path):
    """transformers' `save_pretrained` writes weights on rank 0 only: a copy published by another rank would hold a
    tokenizer and no model, and every later load would fail ("Unrecognized model")."""
    source = smollm2_gguf_path()
    vocab = len(gguf.GGUFReader(source).fields["tokenizer.ggml.tokens"].data)
    path = tmp_path / "my-model.gguf"
    write_tiny_gguf(path, make_tiny_target("llama", vocab_size=vocab, layers=2), source)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": str(k), "messages": [{"role": "user", "content": f"Hi {k}"},
                                                                   {"role": "assistant", "content": "Hello"}]}) + "\n"
                            for k in range(4)))
    command, env = two_process_launch("-m", "dspark_hf.cli", "cache", "--target", str(path), "--dataset", str(data),
                                      "--output", str(tmp_path / "out"), "--aux-layers", "0,1", "--split", "all",
                                      "--shard-size", "2", "--batch-size", "2", "--target-dtype", "float32",
                                      DSPARK_HF_CACHE=str(tmp_path / "cache"))
    done = run_launch(command, env)
    assert done.returncode == 0, done.stderr[-3000:]
    (copy,) = (tmp_path / "cache" / "gguf").iterdir()  # one copy, no staging directory left behind
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in copy.iterdir()}


def test_a_missing_gguf_file_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="target GGUF file .*missing.gguf does not exist"):
        load_target(str(tmp_path / "missing.gguf"))
