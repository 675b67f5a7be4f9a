"""The cache at scale: fp8 storage with per-row scales, and capture shared across `accelerate launch` processes.

fp8 keeps every row within e4m3's precision of the fp32 capture at about half the bf16 bytes, and training reads it
unchanged. Several processes produce the same shards, byte for byte, as one process, resume after kill -9, and
refuse a manifest with a process's shards missing or processes that disagree on the settings.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import kill_process_tree, make_tiny_target, run_launch, two_process_launch
from test_training import tiny_args, tiny_world
from transformers import LlamaForCausalLM

from dspark_hf.cache import (
    HiddenStateCache,
    build_cache,
    check_same_settings,
    estimate_bytes,
    shard_name,
)
from dspark_hf.corpora import chatterbot_conversations
from dspark_hf.data import read_jsonl
from dspark_hf.training.trainer import train

AUX = [1, 2, 3]
FP8 = "float8_e4m3fn"


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny_target("llama", vocab_size=len(tokenizer), layers=4)


@pytest.fixture(scope="module")
def conversations():
    return chatterbot_conversations()[:12]


# ---------------------------------------------------------------------------------------------------------- fp8
def _row_bound(reference: torch.Tensor, groups: int) -> torch.Tensor:
    """|fp8 round-trip error| allowed per element: half an e4m3 step (2⁻⁴ relative) for normal values, half the
    subnormal step (2⁻¹⁰ of the row's scale) below; plus fp32 rounding of the scaling."""
    rows = reference.reshape(len(reference), groups, -1)  # [T, g, d]
    scale = rows.abs().amax(-1, keepdim=True) / 448  # [T, g, 1]
    return (rows.abs() * 2**-4 + scale * 2**-10 + rows.abs().amax(-1, keepdim=True) * 1e-6).reshape(reference.shape)


def test_fp8_cache_round_trips_within_fp8_precision(tiny, tokenizer, conversations, tmp_path):
    build_cache(tiny, tokenizer, conversations, tmp_path / "f32", AUX, dtype="float32", shard_size=5, progress=False)
    manifest = build_cache(tiny, tokenizer, conversations, tmp_path / "fp8", AUX, dtype=FP8, shard_size=5, progress=False)
    assert manifest["dtype"] == FP8 and manifest["scales"] == "per-row" and manifest["complete"]
    assert "scales" not in json.loads((tmp_path / "f32" / "manifest.json").read_text())  # other dtypes: as before
    full = HiddenStateCache(tmp_path / "f32")
    exact = HiddenStateCache(tmp_path / "fp8", verify=True, dequantize_to=torch.float32)
    default = HiddenStateCache(tmp_path / "fp8")
    worst = 0.0
    for i in range(len(full)):
        reference, sample = full[i], exact[i]
        assert torch.equal(sample["input_ids"], reference["input_ids"])
        assert torch.equal(sample["loss_mask"], reference["loss_mask"])
        for name, groups in (("aux_hidden_states", len(AUX)), ("final_hidden_state", 1)):
            expected, got = reference[name], sample[name]
            assert got.dtype == torch.float32 and got.shape == expected.shape
            error = (got - expected).abs()
            assert (error <= _row_bound(expected, groups)).all(), name
            rows = expected.reshape(len(expected), groups, -1)
            relative = error.reshape(rows.shape).norm(dim=-1) / rows.norm(dim=-1).clamp_min(1e-30)  # [T, g]
            worst = max(worst, relative.max().item())
            assert default[i][name].dtype == torch.bfloat16  # training reads bf16, as from a bf16 cache
            assert torch.equal(default[i][name], got.to(torch.bfloat16))
    print(f"fp8 per-row relative error (L2): worst {worst:.4f}")
    assert worst < 2**-4  # e4m3: 3 mantissa bits
    shard = next(default.iter_shards())
    assert shard["aux_hidden_states"].dtype == torch.bfloat16 and shard["aux_hidden_states"].shape[-1] == 3 * 64


def test_fp8_bytes_per_token(tiny, tokenizer, conversations, tmp_path):
    manifest = build_cache(tiny, tokenizer, conversations, tmp_path / "fp8", AUX, dtype=FP8, progress=False)
    tokens, d, m = manifest["num_tokens"], 64, len(AUX)
    shard_bytes = sum(s["bytes"] for s in manifest["shards"])
    expected = estimate_bytes(tokens, m, d, FP8)  # (m+1)·d fp8 + (m+1) float32 scales + ids and mask
    assert expected <= shard_bytes < expected + 2048  # plus the safetensors header
    # SmolLM2-135M (d = 576, m = 3): fp8 with per-row scales costs 0.505× the bf16 floor (m+1)·d·2
    assert estimate_bytes(1, 3, 576, FP8) / (4 * 576 * 2) <= 0.52


def test_training_reads_an_fp8_cache(tokenizer, tmp_path):
    world = tiny_world()  # the training tests' target, fp32 caches and draft vocabulary
    target = LlamaForCausalLM.from_pretrained(world["target"], dtype=torch.float32).eval()
    conversations = chatterbot_conversations()
    for name, convs in {"train": conversations[:120], "eval": conversations[120:150]}.items():
        build_cache(target, tokenizer, convs, tmp_path / name, AUX, dtype=FP8, progress=False, log=lambda *a: None)
    steps = dict(max_steps=6, warmup_steps=0, eval_steps=0)
    fp8 = train(tiny_args(tmp_path / "run-fp8", train_cache=str(tmp_path / "train"), eval_cache=str(tmp_path / "eval"),
                          **steps))
    fp32 = train(tiny_args(tmp_path / "run-fp32", **steps))
    assert fp8["finished"] and Path(fp8["drafter"]).is_dir()
    print(f"6 steps: validation loss fp8 {fp8['eval']['loss']:.4f} vs fp32 {fp32['eval']['loss']:.4f}, "
          f"tau {fp8['eval']['tau']:.4f} vs {fp32['eval']['tau']:.4f}")
    assert abs(fp8["eval"]["loss"] - fp32["eval"]["loss"]) <= 0.02 * fp32["eval"]["loss"]


# ------------------------------------------------------------------------------------------------- bad inputs
def test_manifest_missing_a_process_shard_is_refused(tiny, tokenizer, conversations, tmp_path):
    build_cache(tiny, tokenizer, conversations, tmp_path / "c", AUX, shard_size=4, progress=False)
    manifest_path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] != shard_name(1)]  # process 1 of 2 lost
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"does not list shard-00001\.safetensors .*rerun the same `dspark-hf cache`"):
        HiddenStateCache(tmp_path / "c")


def test_shard_left_by_a_run_with_other_settings_is_refused(tiny, tokenizer, conversations, tmp_path):
    build_cache(tiny, tokenizer, conversations, tmp_path / "f32", AUX, dtype="float32", shard_size=4, progress=False)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "f32" / shard_name(1), mixed / shard_name(1))  # another process wrote float32 here
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors was written with other settings \(F32 .*BF16"):
        build_cache(tiny, tokenizer, conversations, mixed, AUX, dtype="bfloat16", shard_size=4, progress=False)
    assert sorted(p.name for p in mixed.iterdir()) == [shard_name(1)]  # nothing written, no manifest
    shutil.copy(tmp_path / "f32" / shard_name(1), mixed / shard_name(1))
    with pytest.raises(ValueError, match=r"other settings .*width 192, this run stores F32 of width 128"):
        build_cache(tiny, tokenizer, conversations, mixed, [1, 2], dtype="float32", shard_size=4, progress=False)


def test_processes_that_disagree_are_refused():
    settings = dict(target="t", target_revision="r", aux_hidden_state_layer_ids=[1, 2], dtype="bfloat16", shard_size=4,
                    max_length=64, inputs_sha256="x", hidden_size=8, vocab_size=10, num_hidden_layers=3)
    check_same_settings([settings, dict(settings)])
    with pytest.raises(ValueError, match=r"disagree on dtype: process 1 has 'float32', process 0 has 'bfloat16'; launch"):
        check_same_settings([settings, {**settings, "dtype": "float32"}])


# -------------------------------------------------------------------------------------------- accelerate launch
@pytest.fixture(scope="module")
def launch_world(tiny, tokenizer, tmp_path_factory):
    """A saved tiny target, a 64-conversation dataset and its one-process cache (16 shards of 4)."""
    root = tmp_path_factory.mktemp("launch")
    tiny.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    convs = chatterbot_conversations()
    (root / "data.jsonl").write_text("".join(json.dumps({"id": f"{c['id']}#{k}", "messages": c["messages"]}) + "\n"
                                             for k in range(2) for c in convs[:32]))
    model = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()  # named as the CLI names it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each launched worker runs: fp32 sums can split differently across threads
    try:
        build_cache(model, tokenizer, read_jsonl(root / "data.jsonl"), root / "reference", AUX, shard_size=4,
                    batch_size=2, progress=False, log=lambda *a: None)
    finally:
        torch.set_num_threads(threads)
    return root


def _launch(world: Path, output: Path, script: list[str] | None = None) -> tuple[list[str], dict]:
    """`accelerate launch` of `dspark-hf cache` on 2 CPU processes (gloo), as the DDP training test launches."""
    return two_process_launch(*(script or ["-m", "dspark_hf.cli"]), "cache", "--target", str(world / "target"),
                              "--dataset", str(world / "data.jsonl"), "--output", str(output), "--aux-layers", "1,2,3",
                              "--split", "all", "--shard-size", "4", "--batch-size", "2", "--target-dtype", "float32")


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_two_processes_write_the_one_process_cache(launch_world, tmp_path):
    command, env = _launch(launch_world, tmp_path / "two")
    done = run_launch(command, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "process 0 of 2 captures 8 shards" in done.stdout and "process 1 of 2 captures 8 shards" in done.stdout
    assert _files(tmp_path / "two") == _files(launch_world / "reference")  # same shards, same manifest
    one, two = HiddenStateCache(launch_world / "reference"), HiddenStateCache(tmp_path / "two", verify=True)
    assert len(one) == len(two) == 64
    for i in range(len(one)):
        for name, tensor in one[i].items():
            assert torch.equal(two[i][name], tensor), (i, name)


@pytest.mark.slow
def test_two_process_run_killed_mid_way_resumes(launch_world, tmp_path):
    output = tmp_path / "killed"
    command, env = _launch(launch_world, output)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while len(list(output.glob("shard-*.safetensors"))) < 3 and process.poll() is None and time.time() < deadline:
            time.sleep(0.02)
    finally:
        kill_process_tree(process.pid)  # kill -9 the whole launch mid-way, both workers included
        process.wait(timeout=60)
    finished = {p.name: p.stat() for p in output.glob("shard-*.safetensors")}
    assert 3 <= len(finished) < 16, "the run finished before it could be killed; make the dataset larger"
    assert not json.loads((output / "manifest.json").read_text())["complete"]
    with pytest.raises(ValueError, match="incomplete"):
        HiddenStateCache(output)

    resumed = run_launch(command, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    missing = [k for k in range(16) if shard_name(k) not in finished]
    for rank in (0, 1):  # shard k belongs to process k % 2, whichever run captures it
        assert f"process {rank} of 2 captures {sum(k % 2 == rank for k in missing)} shards" in resumed.stdout
    for name, before in finished.items():  # finished shards were adopted, never rewritten
        after = (output / name).stat()
        assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns), name
    assert _files(output) == _files(launch_world / "reference")  # no temp files left, same bytes
    print(f"killed with {len(finished)} of 16 shards on disk; the rerun captured the other {16 - len(finished)}")


@pytest.mark.slow
def test_two_processes_with_different_settings_are_refused(launch_world, tmp_path):
    # process 1 gets another --dtype, as a node with a different launch script would
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(
        "import os, sys\n"
        "from dspark_hf.cli import main\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.argv += ['--dtype', 'float32']\n"
        "sys.exit(main())\n"
    )
    command, env = _launch(launch_world, tmp_path / "mixed", script=[str(wrapper)])
    done = run_launch(command, env)
    assert done.returncode != 0
    assert ("dspark-hf cache: error: the cache processes disagree on dtype: process 1 has 'float32', process 0 has "
            "'bfloat16'; launch every process with the same arguments, target and dataset") in done.stderr
    assert not (tmp_path / "mixed").exists() or not list((tmp_path / "mixed").iterdir())  # nothing written
