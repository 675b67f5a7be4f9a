"""Online (cache-free) training: the frozen target runs inside the loop and the drafter equals the one trained on a
cache of the same data; it resumes bit-identically, runs under DDP, and refuses a wrong data source in one line.

The target is conftest's tiny random Llama with SmolLM2's tokenizer and chat template saved next to it (the cache
command and online training both read the template from the target directory), its LM head scaled up as in
test_training.py so that there is something to learn.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, make_tiny_target, run_launch
from safetensors.torch import load_file

from dspark_hf.cache import HiddenStateCache, build_cache
from dspark_hf.cli import main
from dspark_hf.corpora import chatterbot_conversations
from dspark_hf.data import write_jsonl
from dspark_hf.training.online import open_online
from dspark_hf.training.trainer import TrainingArguments, train
from dspark_hf.vocab import build_draft_vocab, count_assistant_tokens, save_draft_vocab

AUX = [1, 2, 3]
DRAFTER = dict(mask_token_id=0, block_size=4, markov_rank=8, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128)
MAX_LENGTH = 256
# max |Δweight| online vs cached (the bound). Online captures each sample alone, so against a cache captured
# one sample per forward (`--batch-size 1`) the runs are bit-identical; the cache's default padded batches of 8 move
# fp32 states by ~1e-6 (other matmul shapes), which after these 8 steps leaves ~2e-7 in the weights.
ONLINE_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    """A target directory (weights + tokenizer), a 24-conversation JSONL, its fp32 cache written by `dspark-hf cache`
    (one sample per forward, as online training captures), and a draft vocabulary counted from that cache."""
    root = tmp_path_factory.mktemp("online")
    target = make_tiny_target("llama", vocab_size=len(smollm2_tokenizer), layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)
    target.save_pretrained(root / "target")
    smollm2_tokenizer.save_pretrained(root / "target")
    write_jsonl(root / "chats.jsonl", chatterbot_conversations()[:24])
    code = main(["cache", "--target", str(root / "target"), "--dataset", str(root / "chats.jsonl"), "--output",
                 str(root / "cache"), "--aux-layers", ",".join(map(str, AUX)), "--dtype", "float32",
                 "--max-length", str(MAX_LENGTH), "--batch-size", "1"])
    assert code == 0
    save_draft_vocab(root / "vocab.safetensors", *build_draft_vocab(count_assistant_tokens(HiddenStateCache(root / "cache")), 256))
    return {"target": str(root / "target"), "dataset": str(root / "chats.jsonl"), "cache": str(root / "cache"),
            "vocab": str(root / "vocab.safetensors")}


def make_args(world, output_dir, online: bool, **overrides) -> TrainingArguments:
    data = (dict(online=True, dataset=world["dataset"], aux_layers=AUX, max_length=MAX_LENGTH, online_dtype="float32")
            if online else dict(train_cache=world["cache"]))
    settings = dict(output_dir=str(output_dir), target=world["target"], draft_vocab=world["vocab"],
                    drafter_config=dict(DRAFTER), learning_rate=1e-2, warmup_steps=2, max_steps=8, batch_size=4,
                    max_anchors=8, logging_steps=4, report_to=None, progress=False, **data)
    settings.update(overrides)
    return TrainingArguments(**settings)


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_online_training_equals_cache_then_cached_training(world, tmp_path):
    """8 steps (24 samples, batch 4: across an epoch boundary) online vs on the fp32 cache of the same data; the
    validation metrics (online `--eval-dataset` vs `--eval-cache`, at steps 0, 4 and 8) agree as well."""
    cached = train(make_args(world, tmp_path / "cached", online=False, eval_cache=world["cache"], eval_steps=4))
    online = train(make_args(world, tmp_path / "online", online=True, eval_dataset=world["dataset"], eval_steps=4))
    assert cached["finished"] and online["finished"]
    assert [step for step, _ in online["eval_history"]] == [0, 4, 8]
    for (_, ours), (_, theirs) in zip(online["eval_history"], cached["eval_history"], strict=True):
        assert ours.keys() == theirs.keys() and all(abs(ours[k] - theirs[k]) <= 1e-6 for k in ours if k != "tokens_per_s")
    a, b = load_file(str(Path(cached["drafter"]) / "model.safetensors")), load_file(str(Path(online["drafter"]) / "model.safetensors"))
    worst = _max_difference(a, b)
    print(f"online vs cached: max |Δweight| after 8 steps = {worst:.3e}")
    assert worst <= ONLINE_TOLERANCE


def test_online_states_round_to_the_cache_dtype(world, tmp_path):
    """By default (--online-dtype bfloat16) the captured states are exactly what a bf16 cache stores."""
    args = make_args(world, tmp_path, online=True, online_dtype="bfloat16", limit=6)
    [online] = open_online(args, "cpu", log=lambda *a: None)
    cache_dir = tmp_path / "bf16"
    from dspark_hf.data import load_conversations

    build_cache(online.target, _tokenizer(world), load_conversations(world["dataset"])[:6], cache_dir, AUX,
                dtype="bfloat16", max_length=MAX_LENGTH, batch_size=1, progress=False, log=lambda *a: None)
    cache = HiddenStateCache(cache_dir)
    assert len(online) == len(cache) == 6
    for i in range(6):
        ours, theirs = online[i], cache[i]
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), (i, key)


def _tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world["target"])


def test_online_training_resumes_bit_identically(world, tmp_path):
    """Stopped by --max-steps-per-run at step 5 (mid-epoch), resumed to step 8 (past the epoch boundary at 6): the
    weights and optimizer moments equal those of a run that went to step 8 at once."""
    common = dict(max_steps=12, save_steps=0)
    train(make_args(world, tmp_path / "straight", online=True, max_steps_per_run=8, **common))
    first = train(make_args(world, tmp_path / "stopped", online=True, max_steps_per_run=5, **common))
    assert not first["finished"] and first["step"] == 5
    second = train(make_args(world, tmp_path / "stopped", online=True, max_steps_per_run=3, resume=True, **common))
    assert second["step"] == 8
    straight = tmp_path / "straight" / "checkpoints" / "checkpoint-8"
    resumed = tmp_path / "stopped" / "checkpoints" / "checkpoint-8"
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(straight / "optimizer.bin", weights_only=False)["state"]
    opt_b = torch.load(resumed / "optimizer.bin", weights_only=False)["state"]
    for key in opt_a:
        assert torch.equal(opt_a[key]["exp_avg"], opt_b[key]["exp_avg"])
        assert torch.equal(opt_a[key]["exp_avg_sq"], opt_b[key]["exp_avg_sq"])


def test_non_finite_target_states_are_named_as_training_samples(world, tmp_path):
    """Online there is no cache to blame: the error names the training samples and points at the target."""
    from transformers import AutoModelForCausalLM

    from dspark_hf.training.trainer import TrainingDivergedError

    poisoned = tmp_path / "poisoned"
    shutil.copytree(world["target"], poisoned)
    target = AutoModelForCausalLM.from_pretrained(poisoned)
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")  # output of layer 2 = aux id 2
    target.save_pretrained(poisoned)
    args = make_args({**world, "target": str(poisoned)}, tmp_path / "out", online=True, max_steps=1, limit=4)
    with pytest.raises(TrainingDivergedError) as error:
        train(args)
    message = str(error.value)
    assert "non-finite (NaN/inf) hidden states in training samples [" in message and "captured online" in message
    assert "cache" not in message and "--target-dtype float32" in message


@pytest.mark.parametrize("flags, message", [
    (["--online", "--target", "{target}"], "--online needs --target (the frozen model run inside the training loop) and --dataset"),
    (["--online", "--dataset", "{dataset}"], "--online needs --target"),
    (["--online", "--target", "{target}", "--dataset", "{dataset}", "--train-cache", "{cache}"],
     "--online trains without a cache but --train-cache was also given; drop --train-cache"),
    (["--dataset", "{dataset}", "--train-cache", "{cache}", "--target", "{target}"],
     "--dataset is read only by online training; add --online"),
    (["--eval-dataset", "{dataset}", "--train-cache", "{cache}", "--target", "{target}"],
     "--eval-dataset is read only by online training; add --online, or build a cache"),
    (["--online", "--target", "{target}", "--dataset", "{dataset}", "--eval-dataset", "{dataset}", "--eval-cache", "{cache}"],
     "--eval-dataset and --eval-cache both give validation data; pass only one"),
    (["--online", "--target", "{target}", "--dataset", "{dataset}", "--aux-layers", "1,9"],
     "aux layer ids [9] are outside the target's hidden states [0, 4]"),
])
def test_wrong_data_source_is_one_line(world, tmp_path, capsys, flags, message):
    output = tmp_path / "out"
    code = main(["train", "--output-dir", str(output), "--draft-vocab", world["vocab"], "--no-progress",
                 "--report-to", "none", "--max-steps", "1", "--drafter-config",
                 *[f"{k}={v}" for k, v in DRAFTER.items()], *[flag.format(**world) for flag in flags]])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dspark-hf train: error")]
    assert code == 1 and len(errors) == 1 and message in errors[0], errors
    assert not (output / "checkpoints").exists() and not (output / "training_args.json").exists()


@pytest.mark.slow
def test_two_process_cpu_ddp_online_equals_cached(world, tmp_path):
    """Under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo) each process runs its own target on its
    own batches; the drafter equals the one the same launch trains on the cache."""
    common = [
        "--target", world["target"], "--draft-vocab", world["vocab"], "--max-steps", "4", "--batch-size", "2",
        "--max-anchors", "8", "--learning-rate", "1e-2", "--warmup-steps", "1", "--report-to", "none", "--no-progress",
        "--drafter-config", *[f"{k}={v}" for k, v in DRAFTER.items()],
    ]
    sources = {
        "cached": ["--train-cache", world["cache"]],
        "online": ["--online", "--dataset", world["dataset"], "--aux-layers", ",".join(map(str, AUX)),
                   "--max-length", str(MAX_LENGTH), "--online-dtype", "float32"],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2", "--main_process_port"]
    for name, source in sources.items():
        done = run_launch(launch + [str(free_port()), "-m", "dspark_hf.cli", "train", "--output-dir", str(tmp_path / name)]
                          + common + source, env)
        assert done.returncode == 0, done.stderr[-3000:]
    a = load_file(str(tmp_path / "cached" / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "online" / "drafter" / "model.safetensors"))
    worst = _max_difference(a, b)
    print(f"DDP online vs cached: max |Δweight| = {worst:.3e}")
    assert worst <= ONLINE_TOLERANCE
