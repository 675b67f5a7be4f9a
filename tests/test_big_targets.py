"""Targets bigger than one device: `--device-map auto` / `--max-memory` (Accelerate big-model loading) and reading
only the embedding and LM head from the target's safetensors shards (`export --target`, `train --target`).

On CPU the only split Accelerate can make is CPU + disk, so a small `max_memory` forces part of a sharded tiny target
onto disk (read back from its own safetensors shards at each forward); everything must equal the plain load.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import make_drafter, make_tiny_target
from dspark_hf.cache import HiddenStateCache, build_cache
from dspark_hf.cli import main
from dspark_hf.formats.export import export
from dspark_hf.regenerate import regenerate_conversations
from dspark_hf.targets import load_target, load_target_heads, load_target_model, parse_max_memory
from dspark_hf.targets import load_target_heads as trainer_target  # what `train --target` and `calibrate --target` read

# Embedding + the LM-head reserve + two decoder layers of the target below: a CPU + disk split (checked in the test).
SPLIT_BUDGET = {"cpu": "25.5MB"}
CHATS = [{"id": f"c{i}", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": f"Question {i}: why is the sky blue?"},
                                      {"role": "assistant", "content": "Because of Rayleigh scattering."},
                                      {"role": "user", "content": "And sunsets?"},
                                      {"role": "assistant", "content": "Longer path, more red."}]} for i in range(3)]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, smollm2_tokenizer):
    """A tiny chat target (SmolLM2's tokenizer) saved as 3 safetensors shards: embedding, LM head, the rest."""
    path = tmp_path_factory.mktemp("target") / "sharded"
    model = make_tiny_target("llama", vocab_size=len(smollm2_tokenizer), layers=4)
    model.save_pretrained(path, max_shard_size="4MB")
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def split(sharded, tmp_path_factory):
    """The sharded target loaded with device_map="auto" under a budget that sends half of it to disk."""
    offload = tmp_path_factory.mktemp("offload")
    return load_target(str(sharded), device_map="auto", max_memory=dict(SPLIT_BUDGET), offload_folder=str(offload))


def test_max_memory_is_parsed_or_refused_in_one_line():
    assert parse_max_memory("0=20GiB, 1=20GiB,cpu=64GiB") == {0: "20GiB", 1: "20GiB", "cpu": "64GiB"}
    assert parse_max_memory(None) is None
    for bad in ("cpu", "cpu=lots", "=3GiB", "0=20GiB,,"):
        with pytest.raises(ValueError, match="not DEVICE=SIZE.*--max-memory 0=20GiB"):
            parse_max_memory(bad)


def test_a_split_target_computes_what_the_plain_load_computes(sharded, split):
    model, _ = split
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map  # really split, not all on one side
    plain = load_target_model(str(sharded))
    ids = torch.randint(3, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)
        hidden = model(ids, output_hidden_states=True).hidden_states
        for a, b in zip(hidden, plain(ids, output_hidden_states=True).hidden_states):
            assert torch.equal(a, b)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), plain.generate(ids, max_new_tokens=6, do_sample=False))


def test_regenerate_and_cache_with_a_split_target_equal_the_plain_load(sharded, split, tmp_path):
    model, tokenizer = split
    plain, _ = load_target(str(sharded))
    for name, target in (("split", model), ("plain", plain)):
        regenerate_conversations(target, tokenizer, CHATS, tmp_path / f"{name}.jsonl", max_new_tokens=5, batch_size=2, progress=False)
        build_cache(target, tokenizer, CHATS, tmp_path / f"cache-{name}", aux_layer_ids=[1, 2, 3], dtype="float32",
                    shard_size=2, batch_size=2, progress=False, log=lambda *a: None)
    assert (tmp_path / "split.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
    a, b = HiddenStateCache(tmp_path / "cache-split"), HiddenStateCache(tmp_path / "cache-plain")
    assert len(a) == len(b) == len(CHATS)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_target_wholly_on_disk_still_regenerates_what_the_plain_load_does(sharded, tmp_path):
    """Its weights are all meta tensors between forwards: inputs go to the CPU, where Accelerate's hooks run it."""
    model, tokenizer = load_target(str(sharded), device_map="auto", max_memory={"cpu": "1MB"}, offload_folder=str(tmp_path / "off"))
    assert set(model.hf_device_map.values()) == {"disk"}
    plain, _ = load_target(str(sharded))
    for name, target in (("disk", model), ("plain", plain)):
        regenerate_conversations(target, tokenizer, CHATS[:2], tmp_path / f"{name}.jsonl", max_new_tokens=4, batch_size=1, progress=False)
    assert (tmp_path / "disk.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()


def test_a_target_that_does_not_fit_max_memory_is_one_clear_line(sharded, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"needs about .* but --max-memory cpu=25.5MB allows .*--offload-folder"):
        load_target_model(str(sharded), device_map="auto", max_memory=dict(SPLIT_BUDGET))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    for command in (["cache", "--dataset", str(data), "--output", str(tmp_path / "cache")],
                    ["regenerate", "--input", str(data), "--output", str(tmp_path / "out.jsonl")]):
        code = main([*command, "--target", str(sharded), "--device-map", "auto", "--max-memory", "cpu=1MB"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and "--max-memory cpu=1MB" in err[0] and "raise --max-memory" in err[0]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert main(["cache", "--dataset", str(data), "--output", str(tmp_path / "c2"), "--target", str(sharded),
                 "--max-memory", "cpu=1GB"]) == 1
    assert "add --device-map auto" in capsys.readouterr().err
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"names GPU {gpus} but this machine has {gpus} GPU"):
        load_target_model(str(sharded), device_map="auto", max_memory={gpus: "1GB", "cpu": "1GB"})


def test_heads_are_read_from_their_shards_alone(sharded, tmp_path):
    """Only the shards holding the embedding and the LM head are opened: the layers' shard can be gone."""
    plain = load_target_model(str(sharded))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {index["model.embed_tokens.weight"], index["lm_head.weight"]}
    partial = tmp_path / "partial"
    partial.mkdir()
    for file in sharded.iterdir():
        if not file.name.endswith(".safetensors") or file.name in needed:
            (partial / file.name).symlink_to(file)
    assert len(list(partial.glob("*.safetensors"))) < len(list(sharded.glob("*.safetensors")))
    heads = load_target_heads(str(partial))
    assert torch.equal(heads.get_input_embeddings().weight, plain.get_input_embeddings().weight)
    assert torch.equal(heads.get_output_embeddings().weight, plain.get_output_embeddings().weight)
    assert heads.config.vocab_size == plain.config.vocab_size and heads.name_or_path == str(partial)


def test_tied_embeddings_are_one_table(tmp_path):
    tied = make_tiny_target("qwen3", layers=2)
    tied.config.tie_word_embeddings = True
    tied = type(tied)(tied.config).eval()
    tied.save_pretrained(tmp_path / "tied", max_shard_size="20KB")
    with open(tmp_path / "tied" / "model.safetensors.index.json") as handle:
        assert "lm_head.weight" not in json.load(handle)["weight_map"]
    heads = load_target_heads(str(tmp_path / "tied"))
    assert heads.get_output_embeddings().weight is heads.get_input_embeddings().weight
    assert torch.equal(heads.get_output_embeddings().weight, tied.get_output_embeddings().weight)


def test_export_from_the_shards_equals_export_from_the_loaded_model(sharded, tmp_path):
    plain = load_target_model(str(sharded))
    drafter = make_drafter(plain, draft_vocab_size=64, bind_target_embeddings=True)
    drafter.save_pretrained(tmp_path / "bound")
    from_model = export(tmp_path / "bound", tmp_path / "a", verifier="org/tiny", target=plain, dtype="float32")
    from_shards = export(tmp_path / "bound", tmp_path / "b", verifier="org/tiny", target=str(sharded), dtype="float32")
    files = sorted(p.name for p in from_model.iterdir())
    assert files == sorted(p.name for p in from_shards.iterdir()) and "model.safetensors" in files
    for name in files:
        assert (from_model / name).read_bytes() == (from_shards / name).read_bytes(), name
    with safe_open(from_shards / "model.safetensors", "pt") as handle:
        assert torch.equal(handle.get_tensor("embed_tokens.weight"), plain.get_input_embeddings().weight)


def test_train_target_binds_from_the_shards(sharded):
    """`train --target` (and `calibrate --target`) copy the same two tensors without loading the model."""
    plain = load_target_model(str(sharded))
    heads = trainer_target(str(sharded))
    a, b = make_drafter(plain, draft_vocab_size=64), make_drafter(plain, draft_vocab_size=64)
    b.bind_target(heads)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
