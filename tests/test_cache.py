"""The hidden-state cache holds exactly what a fresh target forward computes, survives kill -9, and refuses bad data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from transformers import AutoTokenizer, LlamaForCausalLM

from dspark_hf.cache import HiddenStateCache, build_cache, shard_name
from dspark_hf.corpora import chatterbot_conversations
from dspark_hf.data import read_jsonl
from dspark_hf.tokenization import tokenize_conversation
from dspark_hf.remote_code.configuration_dspark import DSparkConfig

REPO = Path(__file__).resolve().parents[1]
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny_target("llama", vocab_size=len(tokenizer), layers=4)


@pytest.fixture(scope="module")
def conversations():
    convs = chatterbot_conversations()
    # a few multi-turn ones too: chain pairs into 2-turn chats
    chained = [{"id": f"chain/{i}", "messages": convs[i]["messages"] + convs[i + 1]["messages"]} for i in range(0, 8, 2)]
    return convs[:16] + chained


def _assert_matches_fresh_forward(model, tokenizer, conversations, cache_dir, aux):
    cache = HiddenStateCache(cache_dir, verify=True)
    assert len(cache) == len(conversations)
    num_layers = model.config.num_hidden_layers
    worst_aux = worst_final = scale = 0.0
    for i, conv in enumerate(conversations):
        sample = cache[i]
        expected = tokenize_conversation(tokenizer, conv["messages"])
        assert torch.equal(sample["input_ids"], expected["input_ids"])
        assert torch.equal(sample["loss_mask"], expected["loss_mask"].bool())
        with torch.no_grad():
            out = model(sample["input_ids"][None], output_hidden_states=True)  # fresh, unbatched, all states
        fresh_aux = torch.cat([out.hidden_states[j][0] for j in aux], dim=-1)  # [T, m·d]
        assert sample["aux_hidden_states"].shape == fresh_aux.shape
        worst_aux = max(worst_aux, (sample["aux_hidden_states"] - fresh_aux).abs().max().item())
        worst_final = max(worst_final, (sample["final_hidden_state"] - out.hidden_states[num_layers][0]).abs().max().item())
        scale = max(scale, fresh_aux.abs().max().item())
    # fp32; batched (padded) vs unbatched matmuls differ only by rounding, relative to the states' magnitude
    print(f"max |cached - fresh| aux={worst_aux:.3e} final={worst_final:.3e} (max |state| {scale:.1f})")
    assert worst_aux <= 1e-6 * max(scale, 100.0) and worst_final <= 1e-6 * max(scale, 100.0)
    return worst_aux, worst_final


def test_tiny_cache_equals_fresh_forward(tiny, tokenizer, conversations, tmp_path):
    manifest = build_cache(tiny, tokenizer, conversations, tmp_path / "c", AUX, dtype="float32", shard_size=7, batch_size=3)
    assert manifest["complete"] and len(manifest["shards"]) == 3
    assert manifest["num_samples"] == len(conversations)
    assert manifest["aux_hidden_state_layer_ids"] == AUX and manifest["hidden_size"] == 64
    assert manifest["num_hidden_layers"] == 4 and manifest["vocab_size"] == len(tokenizer)
    assert manifest["target_revision"].startswith("sha256:")
    _assert_matches_fresh_forward(tiny, tokenizer, conversations, tmp_path / "c", AUX)


def test_smollm2_cache_equals_fresh_forward(smollm2, conversations, tmp_path):
    model, tokenizer = smollm2
    convs = conversations[-4:]  # multi-turn samples
    aux = [1, 13, 26]
    manifest = build_cache(model, tokenizer, convs, tmp_path / "c", aux, dtype="float32", shard_size=3, batch_size=2)
    assert manifest["target"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert manifest["hidden_size"] == 576 and manifest["num_hidden_layers"] == 30 and manifest["vocab_size"] == 49152
    _assert_matches_fresh_forward(model, tokenizer, convs, tmp_path / "c", aux)


def test_bf16_cache_is_the_rounded_fp32_cache(tiny, tokenizer, conversations, tmp_path):
    build_cache(tiny, tokenizer, conversations[:5], tmp_path / "f32", AUX, dtype="float32", progress=False)
    build_cache(tiny, tokenizer, conversations[:5], tmp_path / "bf16", AUX, dtype="bfloat16", progress=False)
    full, half = HiddenStateCache(tmp_path / "f32"), HiddenStateCache(tmp_path / "bf16")
    for i in range(5):
        assert half[i]["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(half[i]["aux_hidden_states"], full[i]["aux_hidden_states"].to(torch.bfloat16))
    shard = tmp_path / "bf16" / shard_name(0)
    tokens = half.num_tokens
    floor = tokens * (len(AUX) + 1) * 64 * 2
    assert shard.stat().st_size < floor * 1.1  # the bf16 floor plus ids, mask and header


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_resume_after_interruption_mid_shard_is_byte_identical(tiny, tokenizer, conversations, tmp_path):
    reference = tmp_path / "reference"
    build_cache(tiny, tokenizer, conversations, reference, AUX, shard_size=7, batch_size=3, progress=False)

    # Interrupt inside the second shard (after 4 target forwards; shard 0 needs 3), as Ctrl-C would.
    calls = {"n": 0}

    def interrupt(module, args, output):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt

    resumed = tmp_path / "resumed"
    handle = tiny.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            build_cache(tiny, tokenizer, conversations, resumed, AUX, shard_size=7, batch_size=3, progress=False)
    finally:
        handle.remove()
    partial = json.loads((resumed / "manifest.json").read_text())
    assert not partial["complete"] and [s["file"] for s in partial["shards"]] == [shard_name(0)]
    (resumed / f".{shard_name(1)}.crashed.tmp").write_bytes(b"half a shard")  # a kill during the write
    staging = resumed / f".{shard_name(2)}.killed.tmp"  # ... or inside safetensors' own write, in a staging directory
    staging.mkdir()
    (staging / ".tmpAbC123").write_bytes(b"half a shard")
    (resumed / ".tmpXyZ789").write_bytes(b"half a shard")  # ... or beside the shards, as before staging directories
    with pytest.raises(ValueError, match="incomplete"):
        HiddenStateCache(resumed)
    first = (resumed / shard_name(0)).stat()

    build_cache(tiny, tokenizer, conversations, resumed, AUX, shard_size=7, batch_size=3, progress=False)
    again = (resumed / shard_name(0)).stat()
    assert (first.st_ino, first.st_mtime_ns) == (again.st_ino, again.st_mtime_ns)  # never rewritten
    assert _files(resumed) == _files(reference)  # same shards, same manifest, no temp files left


def test_resume_after_kill_9_of_the_cli(tiny, tokenizer, conversations, tmp_path):
    target = tmp_path / "target"
    tiny.save_pretrained(target)
    tokenizer.save_pretrained(target)
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"{c['id']}#{k}", "messages": c["messages"]}) + "\n"
                               for k in range(2) for c in conversations))

    def command(out):
        return [sys.executable, "-m", "dspark_hf.cli", "cache", "--target", str(target), "--dataset", str(dataset),
                "--output", str(out), "--aux-layers", "1,2,3", "--split", "all", "--shard-size", "5", "--batch-size", "2",
                "--target-dtype", "float32"]

    # The CLI runs on this process's thread count: fp32 sums can split differently across threads on some CPUs.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    killed = tmp_path / "killed"
    process = subprocess.Popen(command(killed), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / shard_name(1)).exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)  # kill -9 while later shards are still being computed
    process.wait()
    manifest = json.loads((killed / "manifest.json").read_text())
    assert not manifest["complete"], "the run finished before it could be killed; make the dataset larger"

    subprocess.run(command(killed), cwd=tmp_path, env=env, check=True, capture_output=True)
    reference = tmp_path / "reference"  # the same command, uninterrupted, through the library API
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    build_cache(model, AutoTokenizer.from_pretrained(target), read_jsonl(dataset), reference, AUX, shard_size=5,
                batch_size=2, progress=False)
    assert _files(killed) == _files(reference)
    HiddenStateCache(killed, verify=True)


@pytest.fixture
def small_cache(tiny, tokenizer, conversations, tmp_path):
    build_cache(tiny, tokenizer, conversations, tmp_path / "c", AUX, shard_size=8, batch_size=4, progress=False)
    return tmp_path / "c"


def test_flipped_byte_is_caught(small_cache):
    shard = small_cache / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    HiddenStateCache(small_cache)  # same size: opens, the checksum is what catches it
    with pytest.raises(ValueError, match=f"{shard_name(1)} is corrupt"):
        HiddenStateCache(small_cache, verify=True)


def test_truncated_shard_is_refused_on_open(small_cache):
    shard = small_cache / shard_name(2)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{shard_name(2)} is truncated"):
        HiddenStateCache(small_cache)


def test_validate_against_drafter_config(small_cache, tokenizer):
    cache = HiddenStateCache(small_cache)

    def config(**overrides):
        fields = dict(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=len(tokenizer), draft_vocab_size=1000, mask_token_id=0,
                      aux_hidden_state_layer_ids=AUX, target_num_hidden_layers=4)
        return DSparkConfig(**{**fields, **overrides})

    cache.validate_against(config())
    with pytest.raises(ValueError, match=r"aux layers \[1, 2, 3\].*expects \[1, 2, 4\].*--aux-layers 1,2,4"):
        cache.validate_against(config(aux_hidden_state_layer_ids=[1, 2, 4]))
    with pytest.raises(ValueError, match="hidden size 64.*target_hidden_size=128"):
        cache.validate_against(config(hidden_size=128, target_hidden_size=128))
    with pytest.raises(ValueError, match="vocab size 49152.*vocab_size=50000"):
        cache.validate_against(config(vocab_size=50000))
    with pytest.raises(ValueError, match="4 layers.*target_num_hidden_layers=30"):
        cache.validate_against(config(target_num_hidden_layers=30))


def test_bad_inputs(tiny, tokenizer, conversations, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="outside the target's hidden states"):
        build_cache(tiny, tokenizer, conversations, tmp_path / "a", [1, 5])
    with pytest.raises(ValueError, match="empty"):
        build_cache(tiny, tokenizer, [], tmp_path / "b", AUX)
    with pytest.raises(ValueError, match="no assistant turns"):
        build_cache(tiny, tokenizer, [{"id": "x", "messages": [{"role": "user", "content": "hi"}]}], tmp_path / "c", AUX)
    with pytest.raises(FileNotFoundError, match="not a hidden-state cache"):
        HiddenStateCache(tmp_path)
    build_cache(tiny, tokenizer, conversations[:4], tmp_path / "d", AUX, progress=False)
    with pytest.raises(ValueError, match="different aux_hidden_state_layer_ids"):
        build_cache(tiny, tokenizer, conversations[:4], tmp_path / "d", [1, 2], progress=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6, 1000))
    with pytest.raises(ValueError, match="not enough disk space"):
        build_cache(tiny, tokenizer, conversations, tmp_path / "e", AUX)
    assert not list((tmp_path / "e").glob("shard-*"))  # refused before writing anything


def test_cli_error_is_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", "cache", "--target", "smollm2", "--dataset", str(empty),
                             "--output", str(tmp_path / "c")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "empty" in result.stderr
