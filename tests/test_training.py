"""Offline training on a tiny target: it learns, it resumes bit-identically, DDP matches one process, NaN stops cleanly.

The tiny target is a random 4-layer Llama with SmolLM2's tokenizer (so the real chat template and loss mask apply);
its LM head is scaled up so its next-token distributions are peaked and there is something to learn.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, run_launch
from safetensors.torch import load_file
from transformers import AutoModel, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dspark_hf import DSparkConfig
from dspark_hf.assets import smollm2_path
from dspark_hf.cache import HiddenStateCache, build_cache
from dspark_hf.corpora import chatterbot_conversations
from dspark_hf.training.trainer import (
    TrainingArguments,
    TrainingDivergedError,
    checkpoint_step,
    latest_checkpoint,
    train,
)
from dspark_hf.vocab import build_draft_vocab, count_assistant_tokens, save_draft_vocab

REPO = Path(__file__).resolve().parents[1]
AUX = [1, 2, 3]
DRAFTER = dict(mask_token_id=0, block_size=4, markov_rank=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128)


@functools.lru_cache(maxsize=None)
def tiny_world() -> dict[str, str]:
    """Target directory, train/eval/test caches and a draft vocabulary, built once per test session."""
    root = Path(tempfile.mkdtemp(prefix="dspark-train-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=1024,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)  # peaked next-token distributions (logit std ≈ 2)
    target.save_pretrained(root / "target")
    conversations = chatterbot_conversations()
    splits = {"train": conversations[:120], "eval": conversations[120:150], "test": conversations[150:174]}
    for name, convs in splits.items():
        build_cache(target, tokenizer, convs, root / name, AUX, dtype="float32", progress=False, log=lambda *a: None)
    counts = count_assistant_tokens(HiddenStateCache(root / "train"))
    save_draft_vocab(root / "vocab.safetensors", *build_draft_vocab(counts, 512))
    return {"root": str(root), "target": str(root / "target"), "train": str(root / "train"),
            "eval": str(root / "eval"), "test": str(root / "test"), "vocab": str(root / "vocab.safetensors")}


def tiny_args(output_dir, **overrides) -> TrainingArguments:
    world = tiny_world()
    settings = dict(
        output_dir=str(output_dir), train_cache=world["train"], eval_cache=world["eval"], target=world["target"],
        draft_vocab=world["vocab"], drafter_config=dict(DRAFTER), learning_rate=1e-2, warmup_steps=5, max_steps=40,
        batch_size=4, max_anchors=16, logging_steps=10, report_to=None, progress=False,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


@functools.lru_cache(maxsize=None)
def trained_run() -> dict:
    """A drafter trained for 60 steps, validated at steps 0, 30, 60 (shared by the calibration and LoRA tests)."""
    return train(tiny_args(Path(tiny_world()["root"]) / "trained", max_steps=60, eval_steps=30, report_to="tensorboard"))


def _weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def test_loss_decreases_and_tau_rises_on_validation():
    run = trained_run()
    (first_step, before), (last_step, after) = run["eval_history"][0], run["eval_history"][-1]
    assert (first_step, last_step) == (0, 60)
    print(f"validation tau {before['tau']:.4f} -> {after['tau']:.4f}, loss {before['loss']:.4f} -> {after['loss']:.4f}, "
          f"accept {[round(before[f'accept/slot_{n}'], 3) for n in (1, 2, 3)]} -> "
          f"{[round(after[f'accept/slot_{n}'], 3) for n in (1, 2, 3)]}")
    assert after["tau"] > before["tau"] + 0.2
    assert after["loss"] < before["loss"] - 0.3
    assert after["accept/slot_1"] > 1.5 * before["accept/slot_1"]
    output = Path(run["output_dir"])
    # the final directory is a normal HF drafter with remote code, and TensorBoard logs were written
    drafter = AutoModel.from_pretrained(output / "drafter", trust_remote_code=True)
    assert type(drafter).__name__ == "DSparkForDrafting" and drafter.config.block_size == 4
    assert list((output / "logs").rglob("events.out.tfevents.*"))


def test_rerunning_a_finished_run_does_nothing_and_other_settings_are_refused(capsys):
    """A pipeline reruns to continue; a finished `train` must neither retrain nor overwrite its drafter."""
    run = trained_run()
    output = Path(run["output_dir"])
    drafter = output / "drafter" / "model.safetensors"
    before = (drafter.stat().st_mtime_ns, drafter.read_bytes())
    again = train(tiny_args(output, max_steps=60, eval_steps=30, report_to=None, resume=True, logging_steps=5))
    assert again["already_finished"] and again["step"] == 60 and again["eval"] == run["eval"]
    assert (drafter.stat().st_mtime_ns, drafter.read_bytes()) == before
    assert "finished already with these settings (step 60); nothing to do" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"holds a finished run with other settings \(learning_rate 0.01 -> 0.005\); "
                                         r"pass another --output-dir \(with --init-from .*drafter to continue"):
        train(tiny_args(output, max_steps=60, eval_steps=30, learning_rate=5e-3))
    assert (drafter.stat().st_mtime_ns, drafter.read_bytes()) == before


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    """kill -9 a real `dspark-hf train` process mid-run, resume from its last checkpoint (mid-epoch), and land on the
    same weights and optimizer state at step 18 (past the epoch boundary at 15) as a run that was never interrupted;
    both stop there with `--max-steps-per-run` inside the same 400-step schedule."""
    world = tiny_world()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    common = [
        sys.executable, "-m", "dspark_hf.cli", "train", "--train-cache", world["train"], "--target", world["target"],
        "--draft-vocab", world["vocab"], "--max-steps", "400", "--save-steps", "3", "--batch-size", "8",
        "--max-anchors", "8", "--learning-rate", "1e-2", "--report-to", "none", "--no-progress",
        "--drafter-config", *[f"{k}={v}" for k, v in {**DRAFTER, "markov_rank": 8}.items()],
    ]
    stop_at = 18  # 120 samples / batch 8 = 15 steps per epoch
    straight = subprocess.run(common + ["--output-dir", str(tmp_path / "straight"), "--max-steps-per-run", str(stop_at)],
                              env=env, capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]

    killed_dir = tmp_path / "killed"
    process = subprocess.Popen(common + ["--output-dir", str(killed_dir)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while latest_checkpoint(killed_dir) is None and process.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    resumed_from = checkpoint_step(latest_checkpoint(killed_dir))
    assert 3 <= resumed_from < stop_at
    resumed = subprocess.run(common + ["--output-dir", str(killed_dir), "--resume",
                                       "--max-steps-per-run", str(stop_at - resumed_from)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    print(f"killed after checkpoint-{resumed_from}; resumed to step {stop_at}")
    straight_ckpt = tmp_path / "straight" / "checkpoints" / f"checkpoint-{stop_at}"
    resumed_ckpt = killed_dir / "checkpoints" / f"checkpoint-{stop_at}"
    a, b = load_file(str(straight_ckpt / "model.safetensors")), load_file(str(resumed_ckpt / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt_a = torch.load(straight_ckpt / "optimizer.bin", weights_only=False)["state"]
    opt_b = torch.load(resumed_ckpt / "optimizer.bin", weights_only=False)["state"]
    for key in opt_a:
        assert torch.equal(opt_a[key]["exp_avg"], opt_b[key]["exp_avg"])
        assert torch.equal(opt_a[key]["exp_avg_sq"], opt_b[key]["exp_avg_sq"])


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # an absurd learning rate overflows the weights after the first update: step 2's loss is NaN
    args = tiny_args(tmp_path / "nan", max_steps=10, save_steps=1, learning_rate=1e30, warmup_steps=0, eval_cache=None)
    with pytest.raises(TrainingDivergedError, match=r"non-finite .* at step 2; training stopped and the last good checkpoint is .*checkpoint-1"):
        train(args)
    checkpoint = latest_checkpoint(tmp_path / "nan")
    assert checkpoint.name == "checkpoint-1"
    drafter = AutoModel.from_pretrained(checkpoint / "drafter", trust_remote_code=True)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path, capsys):
    """`--save-total-limit 2` leaves exactly the two newest of the checkpoints a run without it writes, byte for byte,
    and a run resumes from them; 0 is refused in one line, since it would delete what --resume needs."""
    every = tiny_args(tmp_path / "every", max_steps=9, save_steps=2, eval_cache=None)
    limited = tiny_args(tmp_path / "limited", max_steps=9, save_steps=2, eval_cache=None, save_total_limit=2)
    train(every)
    train(limited)
    written = sorted((p.name for p in (tmp_path / "every" / "checkpoints").iterdir()), key=lambda n: int(n.split("-")[1]))
    kept = sorted((p.name for p in (tmp_path / "limited" / "checkpoints").iterdir()), key=lambda n: int(n.split("-")[1]))
    assert len(written) > 2 and kept == written[-2:]
    for name in kept:
        a = load_file(str(tmp_path / "every" / "checkpoints" / name / "model.safetensors"))
        b = load_file(str(tmp_path / "limited" / "checkpoints" / name / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)
    train(tiny_args(tmp_path / "limited", max_steps=12, save_steps=2, eval_cache=None, save_total_limit=2, resume=True))
    assert len(list((tmp_path / "limited" / "checkpoints").iterdir())) == 2

    from dspark_hf import cli

    capsys.readouterr()  # the runs' own output

    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "--train-cache", every.train_cache, "--output-dir", str(tmp_path / "zero"),
                  "--save-total-limit", "0"])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1, err
    assert "argument --save-total-limit: takes a whole number of 1 or more, not '0'" in err and not (tmp_path / "zero").exists()


DDP_TOLERANCE = 1e-4  # max |Δweight| after 15 steps: gloo all-reduce vs sequential accumulation, fp32 sum order


@pytest.mark.slow
def test_two_process_cpu_ddp_matches_single_process(tmp_path):
    """Same global batch: 2 processes × batch 2 vs 1 process × batch 2 × 2 accumulation steps."""
    world = tiny_world()
    common = [
        "--train-cache", world["train"], "--eval-cache", world["eval"], "--target", world["target"],
        "--draft-vocab", world["vocab"], "--max-steps", "15", "--batch-size", "2", "--max-anchors", "16",
        "--learning-rate", "1e-2", "--warmup-steps", "2", "--report-to", "none", "--no-progress",
        "--drafter-config", *[f"{k}={v}" for k, v in DRAFTER.items()],
    ]
    # torchrun-style DDP on CPU: `--multi_gpu` spawns the processes, ACCELERATE_USE_CPU makes them use gloo on CPU
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    runs = {
        "single": launch + ["--num_processes", "1", "--cpu"],
        "ddp": launch + ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())],
    }
    for name, command in runs.items():
        accumulation = ["--gradient-accumulation-steps", "2"] if name == "single" else []
        done = run_launch(command + ["-m", "dspark_hf.cli", "train", "--output-dir", str(tmp_path / name)]
                          + common + accumulation, env)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = _weights(tmp_path / "single" / "drafter"), _weights(tmp_path / "ddp" / "drafter")
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"DDP vs single process: max |Δweight| = {worst:.3e}")
    assert worst < DDP_TOLERANCE


def test_warm_start_from_zlab_dflash_checkpoint_adds_heads(tmp_path):
    """A z-lab DFlash directory (Qwen3 fields top-level, `dflash_config`, no embed/head, no heads) warm-starts a DSpark."""
    from dspark_hf.training.build import build_drafter

    world = tiny_world()
    source, layers = _zlab_dflash_checkpoint(tmp_path, block_size=4)
    drafter = build_drafter(tiny_args(tmp_path, init_from=str(source), drafter_config={"markov_rank": 8}), AUX)
    assert drafter.config.aux_hidden_state_layer_ids == AUX and drafter.config.draft_vocab_size == 512
    assert drafter.markov_head is not None and drafter.markov_head.markov_rank == 8 and drafter.confidence_head is not None
    state = drafter.state_dict()
    for name, value in layers.items():
        assert torch.equal(state[name], value), name
    target = LlamaForCausalLM.from_pretrained(world["target"])
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[drafter.draft_to_target_ids])


def test_warm_start_on_the_same_draft_vocab_keeps_every_trained_tensor(tmp_path):
    """A continued run (`--init-from` a trained drafter, `--draft-vocab` its own mapping) starts from all its weights,
    the Markov head's vocabulary rows included; a different vocabulary re-initialises those rows."""
    from dspark_hf.training.build import build_drafter

    trained = _weights(trained_run()["drafter"])
    warm = build_drafter(tiny_args(tmp_path, init_from=str(trained_run()["drafter"])), AUX).state_dict()
    for name, value in trained.items():
        assert torch.equal(warm[name], value), name
    shuffled = tmp_path / "other_vocab.safetensors"
    d2t = trained["d2t"].clone()
    d2t[-1] += 1  # the last draft id now maps to the next target id
    t2d = torch.zeros_like(trained["t2d"])
    t2d[torch.arange(d2t.numel()) + d2t] = True
    save_draft_vocab(shuffled, d2t, t2d)
    fresh = build_drafter(tiny_args(tmp_path, init_from=str(trained_run()["drafter"]), draft_vocab=str(shuffled)), AUX)
    assert not torch.equal(fresh.state_dict()["markov_head.markov_w2.weight"], trained["markov_head.markov_w2.weight"])


def test_warm_start_into_a_draft_vocabulary_markov_table_keeps_each_draft_tokens_trained_row(tmp_path):
    """`--init-from` a full-vocabulary drafter with `markov_input_vocab="draft"`: the draft tokens' W1 rows carry over
    (so the drafts of in-vocabulary previous tokens are unchanged), the shared row is the mean of the rest."""
    from dspark_hf.training.build import build_drafter

    trained = _weights(trained_run()["drafter"])
    args = tiny_args(tmp_path, init_from=str(trained_run()["drafter"]),
                     drafter_config={**DRAFTER, "markov_input_vocab": "draft"})
    drafter = build_drafter(args, AUX)
    table, full, t2d = drafter.markov_head.markov_w1.weight, trained["markov_head.markov_w1.weight"], trained["t2d"]
    assert table.shape == (int(t2d.sum()) + 1, full.shape[1])
    assert torch.equal(table[drafter.markov_rows(drafter.draft_to_target_ids)], full[drafter.draft_to_target_ids])
    torch.testing.assert_close(table[-1], full[~t2d].mean(0))


def _block_outputs(drafter, seed=0):
    """The training forward's logits and confidence logits on random target states: 2 sequences, 4 blocks each."""
    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    aux = torch.randn(2, 40, len(AUX) * config.target_hidden_size, generator=generator)
    ids = drafter.draft_to_target_ids[torch.randint(0, config.draft_vocab_size, (2, 40), generator=generator)]
    anchors = torch.tensor([[3, 10, 17, 25], [5, 12, 20, 30]])
    out = drafter(aux_hidden_states=aux, input_ids=ids, anchor_positions=anchors, attention_mask=torch.ones(2, 40))
    return out


def test_warm_start_grows_layers_and_markov_rank_without_changing_the_drafts(tmp_path):
    """A trained drafter starts one with an extra layer and twice the Markov rank: the logits and confidence are the
    checkpoint's (the new capacity joins at zero output), and one backward step reaches every new weight."""
    from dspark_hf.training.build import build_drafter

    source = trained_run()["drafter"]
    old = build_drafter(tiny_args(tmp_path, init_from=str(source)), AUX).eval()
    grown_config = {**DRAFTER, "markov_rank": 2 * DRAFTER["markov_rank"], "num_hidden_layers": 2}
    lines = []
    grown = build_drafter(tiny_args(tmp_path, init_from=str(source), drafter_config=grown_config), AUX,
                          log=lines.append).eval()
    assert grown.markov_head.markov_w1.weight.shape[1] == 128 and len(grown.layers) == 2
    assert "grown without changing its drafts: Markov rank 64 -> 128, draft layers 1 -> 2" in lines[-1]
    before, after = _block_outputs(old), _block_outputs(grown)
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.confidence_logits, before.confidence_logits, rtol=1e-5, atol=1e-5)
    grown.train()
    out = _block_outputs(grown, seed=1)
    (out.logits.logsumexp(-1).mean() + out.confidence_logits.mean()).backward()
    assert grown.markov_head.markov_w2.weight.grad[:, 64:].abs().sum() > 0
    assert grown.confidence_head.proj.weight.grad[:, -64:].abs().sum() > 0
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert grown.get_submodule(f"layers.1.{name}").weight.grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match=r"has 2 draft layers and the config asks for 1; a warm start adds layers"):
        grown.save_pretrained(tmp_path / "grown")
        build_drafter(tiny_args(tmp_path, init_from=str(tmp_path / "grown"), drafter_config={"num_hidden_layers": 1}), AUX)


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    from dspark_hf.cli import main

    assert main(["train", "--output-dir", str(tmp_path)]) == 1
    assert "--train-cache is required" in capsys.readouterr().err
    world = tiny_world()
    code = main(["train", "--output-dir", str(tmp_path), "--train-cache", world["train"], "--target", world["target"],
                 "--no-progress", "--report-to", "none", "--drafter-config", "num_attention_heads=4",
                 "num_key_value_heads=2", "head_dim=16"])  # no mask token: the tiny target has no pad token
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dspark-hf train: error")]
    assert code == 1 and len(errors) == 1 and "--mask-token-id" in errors[0]


def test_warm_start_from_zlab_maps_the_config_like_convert(tmp_path):
    """Issue 10.6: `train --init-from` a z-lab DFlash directory whose block size sits in `dflash_config` (16) gets the
    same config as `dspark-hf convert --from zlab-dflash`, not the trainer's own default block of 8."""
    from dspark_hf.formats.convert import convert
    from dspark_hf.training.build import build_drafter

    source, _ = _zlab_dflash_checkpoint(tmp_path, rope_theta=10000.0, dflash_block_size=16)
    converted = DSparkConfig.from_pretrained(convert(source, tmp_path / "converted", "zlab-dflash"))
    warm = build_drafter(tiny_args(tmp_path, init_from=str(source), drafter_config={}, draft_vocab=None), AUX).config
    assert converted.block_size == 16
    for key in ("block_size", "sample_from_anchor", "aux_hidden_state_layer_ids", "mask_token_id", "rope_parameters"):
        assert getattr(warm, key) == getattr(converted, key), key


def _zlab_dflash_checkpoint(tmp_path: Path, rope_theta: float | None = None, block_size: int | None = None,
                            dflash_block_size: int | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A z-lab DFlash directory (Qwen3 fields top-level, `dflash_config`, layer tensors only) of a tiny trained-shape
    drafter; block size at the top level and/or inside `dflash_config`. Returns it and its tensors."""
    import json

    from safetensors.torch import save_file

    from dspark_hf.training.build import build_drafter

    plain = build_drafter(tiny_args(tmp_path, drafter_config={**DRAFTER, "markov_rank": 0, "enable_confidence_head": False},
                                    draft_vocab=None), AUX)
    source = tmp_path / "dflash"
    source.mkdir()
    layers = {k: v.contiguous() for k, v in plain.state_dict().items() if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
    save_file(layers, str(source / "model.safetensors"))
    c = plain.config
    dflash = {"mask_token_id": 0, "target_layer_ids": [0, 1, 2]}
    if dflash_block_size is not None:
        dflash["block_size"] = dflash_block_size
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta if rope_theta is None else rope_theta, "dflash_config": dflash,
    }
    if block_size is not None:
        config["block_size"] = block_size
    (source / "config.json").write_text(json.dumps(config))
    return source, layers


def _flip_byte_in(shard: Path, tensor: str, byte: int) -> None:
    """Flip one byte of `tensor`'s data inside a safetensors file (header: 8-byte length, JSON, then the data)."""
    import json

    raw = bytearray(shard.read_bytes())
    header_length = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8 : 8 + header_length])[tensor]["data_offsets"]
    raw[8 + header_length + begin + byte] ^= 0x40
    shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("tensor, byte", [("aux_hidden_states", 2), ("input_ids", 7)])
def test_train_refuses_a_corrupt_shard_in_one_line(tmp_path, capsys, tensor, byte):
    """Issue 10.7: a flipped byte in the hidden states (trained silently before) or in input_ids (an IndexError
    traceback before) is refused before training, naming the shard and the fix."""
    from dspark_hf.cli import main

    world = tiny_world()
    cache = tmp_path / "cache"
    shutil.copytree(world["train"], cache)
    _flip_byte_in(cache / "shard-00000.safetensors", tensor, byte)
    code = main(["train", "--output-dir", str(tmp_path / "out"), "--train-cache", str(cache), "--target", world["target"],
                 "--draft-vocab", world["vocab"], "--max-steps", "2", "--no-progress", "--report-to", "none",
                 "--drafter-config", *[f"{k}={v}" for k, v in DRAFTER.items()]])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dspark-hf train: error")]
    assert code == 1 and len(errors) == 1
    assert "shard-00000.safetensors is corrupt" in errors[0] and "rerun `dspark-hf cache`" in errors[0]
    assert not (tmp_path / "out" / "training_args.json").exists()


def test_failed_train_leaves_no_training_args(tmp_path):
    """Issue 10.8: a run that fails before its first checkpoint leaves no training_args.json behind."""
    args = tiny_args(tmp_path / "nan", max_steps=10, learning_rate=1e30, warmup_steps=0, eval_cache=None)
    with pytest.raises(TrainingDivergedError, match="no checkpoint had been written yet"):
        train(args)
    assert not (tmp_path / "nan" / "training_args.json").exists()


def test_a_second_train_into_the_same_output_dir_is_refused_in_one_line(tmp_path, capsys):
    """Two runs writing checkpoints into one directory crash each other; the second is refused before it starts, and
    the lock dies with the process that held it."""
    from dspark_hf import cli

    out = tmp_path / "run"
    out.mkdir()
    hold = (f"import time; from filelock import FileLock; lock = FileLock({str(out / '.train.lock')!r}); "
            "lock.acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        world = tiny_world()
        argv = ["train", "--train-cache", world["train"], "--target", world["target"], "--draft-vocab", world["vocab"],
                "--mask-token-id", "0", "--output-dir", str(out), "--max-steps", "2", "--report-to", "none",
                "--no-progress"]
        assert cli.main(argv) == 1
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert errors == [f"dspark-hf train: error: another `dspark-hf train` is writing to {out}; wait for it to "
                          "finish or pick another --output-dir."]
        assert not (out / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    result = train(tiny_args(out, max_steps=2, eval_cache=None))  # the holder died: its lock went with it
    assert result["finished"]


def test_train_refuses_a_cache_of_another_model_of_the_same_shape(tmp_path, capsys):
    """Issue 10.9: the manifest's target name and revision are compared with --target."""
    from dspark_hf.cli import main

    world = tiny_world()
    other = LlamaForCausalLM.from_pretrained(world["target"])
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    other.save_pretrained(tmp_path / "other")
    code = main(["train", "--output-dir", str(tmp_path / "out"), "--train-cache", world["train"], "--target",
                 str(tmp_path / "other"), "--draft-vocab", world["vocab"], "--max-steps", "2", "--no-progress",
                 "--report-to", "none", "--drafter-config", *[f"{k}={v}" for k, v in DRAFTER.items()]])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dspark-hf train: error")]
    assert code == 1 and len(errors) == 1
    assert "captured from another model" in errors[0] and str(tmp_path / "other") in errors[0]
    # the same weights under another path and dtype are the same target
    LlamaForCausalLM.from_pretrained(world["target"], dtype=torch.bfloat16).save_pretrained(tmp_path / "copy")
    from dspark_hf.cache import HiddenStateCache as Cache
    from dspark_hf.targets import load_target_model

    Cache(world["train"]).check_target(load_target_model(str(tmp_path / "copy")))


def test_new_drafter_binds_target_embeddings_and_logs_without_a_bar(tmp_path, capsys):
    """Issue 14.4: a new drafter's directory holds no copy of the target's embedding or head unless asked
    (`--embed-target-copies`). Issue 14.5: with --no-progress, loss terms, τ and tokens/s reach the console at
    --logging-steps."""
    result = train(tiny_args(tmp_path / "bound", max_steps=4, logging_steps=2, eval_cache=None, progress=False))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"]
    for term in ("loss=", "ce=", "tv=", "bce=", "tau=", "tokens/s="):
        assert term in lines[-1], term
    bound = _weights(result["drafter"])
    assert "embed_tokens.weight" not in bound and "lm_head.weight" not in bound
    assert AutoModel.from_pretrained(result["drafter"], trust_remote_code=True).config.bind_target_embeddings

    copies = train(tiny_args(tmp_path / "copies", max_steps=1, eval_cache=None, embed_target_copies=True))
    stored = _weights(copies["drafter"])
    target = LlamaForCausalLM.from_pretrained(tiny_world()["target"])
    assert torch.equal(stored["embed_tokens.weight"], target.model.embed_tokens.weight)


def test_help_says_how_the_default_aux_layers_are_chosen():
    """Issue 14.6: `cache --aux-layers` and `train` help state the rule and when to change it."""
    import argparse

    from dspark_hf import cache
    from dspark_hf.training import cli

    for module in (cache, cli):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        text = " ".join(parser.format_help().split())
        assert "(L-3)//2" in text and "L-4" in text and "warm-start" in text, module.__name__


def test_default_mask_token_comes_from_the_tokenizer_and_the_data(tmp_path):
    """Issue 14.3: a target whose pad token is its end-of-turn token (SmolLM2's case) gets a special token that is
    neither bos/eos/pad/unk nor ever seen in the training cache, instead of an error (or the end-of-turn token)."""
    from dspark_hf.training.build import build_drafter

    world = tiny_world()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    target = LlamaForCausalLM.from_pretrained(world["target"])
    target.config.pad_token_id = target.config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter_config = {k: v for k, v in DRAFTER.items() if k != "mask_token_id"}
    cache = HiddenStateCache(world["train"])
    drafter = build_drafter(tiny_args(tmp_path, target=str(tmp_path / "target"), drafter_config=drafter_config),
                            AUX, cache=cache)
    mask = drafter.config.mask_token_id
    assert tokenizer.added_tokens_decoder[mask].special
    assert mask not in {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    assert mask not in cache.token_ids() and tokenizer.eos_token_id in cache.token_ids()
