"""`dspark-hf eval` / `bench` / `make demo` code paths, and the shipped SmolLM2 drafter.

Promises tested: offline τ and per-position acceptance equal a direct, one-block-at-a-time computation through the
inference path; online statistics add up and greedy output equals plain generate; the benchmark and the demo run
end to end on a tiny model; the drafter shipped in examples/smollm2-dspark loads with `AutoModel` +
`trust_remote_code` and is lossless against plain greedy SmolLM2 in fp32.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import make_drafter, make_tiny_target
from dspark_hf import DSparkContextCache
from dspark_hf.cache import HiddenStateCache, build_cache
from dspark_hf.evaluation import (
    calibration_metrics,
    format_report,
    offline_acceptance,
    offline_metrics,
    online_metrics,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "smollm2-dspark"
AUX = [1, 2, 3]
CONVERSATIONS = [
    {"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Tell me something about the number {i}."},
        {"role": "assistant", "content": f"The number {i} is a fine number, and it comes after {i - 1} in order."},
    ]}
    for i in range(3)
]
PROMPTS = [[{"role": "user", "content": "Hello, how are you?"}], [{"role": "user", "content": "What is a cat?"}]]


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    target = make_tiny_target("llama", vocab_size=len(smollm2_tokenizer), layers=4)
    drafter = make_drafter(target, draft_vocab_size=len(smollm2_tokenizer) // 2, aux_hidden_state_layer_ids=AUX,
                           mask_token_id=16)
    return target, smollm2_tokenizer, drafter


@torch.no_grad()
def test_offline_tau_equals_direct_block_by_block_computation(tiny, tmp_path):
    target, tokenizer, drafter = tiny
    build_cache(target, tokenizer, CONVERSATIONS, tmp_path / "c", AUX, dtype="float32", progress=False)
    cache = HiddenStateCache(tmp_path / "c")
    got = offline_acceptance(drafter, cache, max_anchors=10_000)
    metrics = offline_metrics(got["accept"], got["mask"], drafter.config.block_size)

    # Direct: every valid anchor, through the inference path (context cache + one block pass), with the vanilla
    # Markov bias W2·W1[prev] teacher-forced on the data tokens and the target distribution from the cached state.
    N = drafter.num_draft_tokens
    accepts, greedy_accepts, masks = [], [], []
    for i in range(len(cache)):
        s = cache[i]
        ids, loss, T = s["input_ids"], s["loss_mask"].bool(), len(s["input_ids"])
        for p in range(T):
            if not loss[p] or p + N > T - 1:
                continue
            ctx = drafter.extend_context(DSparkContextCache(), s["aux_hidden_states"][None, :p].float())
            rows = drafter.block_hidden_states(ctx, ids[p : p + 1])[0]  # (N, d)
            prev = ids[p : p + N]
            logits = drafter.lm_head(rows) + drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev))
            q = torch.softmax(logits.float(), -1)
            target_p = torch.softmax(s["final_hidden_state"][p : p + N].float() @ drafter.lm_head.weight.T, -1)
            accepts.append(torch.minimum(q, target_p).sum(-1))
            greedy_accepts.append((q.argmax(-1) == target_p.argmax(-1)).float())
            masks.append(loss[p + 1 : p + N + 1])
    accept, mask = torch.stack(accepts), torch.stack(masks)
    assert torch.equal(got["greedy_accept"], torch.stack(greedy_accepts))
    assert got["accept"].shape == accept.shape
    torch.testing.assert_close(got["accept"], accept, atol=2e-5, rtol=0)
    assert torch.equal(got["mask"], mask)
    expected_tau = float((1 + torch.cumprod(accept * mask, -1).sum(-1)).mean())
    assert metrics["tau"] == pytest.approx(expected_tau, abs=1e-5)
    expected_pos = (accept * mask).sum(0) / mask.sum(0).clamp(min=1)
    assert metrics["acceptance"] == pytest.approx(expected_pos.tolist(), abs=1e-5)
    assert metrics["tau_over_B"] == pytest.approx(metrics["tau"] / drafter.config.block_size)

    cal = calibration_metrics(got["confidence_logits"], got["accept"], got["mask"], [1.0] * N)
    assert set(cal) == {"temperatures", "before", "after"}
    assert len(cal["before"]["ece"]) == N and len(cal["after"]["brier"]) == N


def test_online_stats_add_up_and_greedy_is_lossless(tiny):
    target, tokenizer, drafter = tiny
    greedy = online_metrics(target, tokenizer, drafter, PROMPTS, max_new_tokens=12, do_sample=False, warmup=False)
    assert greedy["identical_to_plain"] == f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert sum(greedy["accepted_histogram"]) == greedy["rounds"] > 0
    assert greedy["mean_accepted_length"] == pytest.approx(1 + greedy["accepted_tokens"] / greedy["rounds"])
    cumulative, conditional = greedy["acceptance_cumulative"], greedy["acceptance_conditional"]
    assert len(cumulative) == len(conditional) == drafter.num_draft_tokens
    assert all(0 <= a <= 1 for a in cumulative + conditional)
    assert greedy["plain_tokens_per_s"] > 0 and greedy["dspark_tokens_per_s"] > 0
    sampled = online_metrics(target, tokenizer, drafter, PROMPTS[:1], max_new_tokens=8, do_sample=True, warmup=False)
    assert sampled["mode"] == "sampling T=1" and sampled["rounds"] > 0


def test_online_stats_at_a_batch_size_are_batched_and_lossless(tiny):
    """`eval --batch-size 2`: left-padded batches through batched speculation, each batch's rows (up to EOS)
    identical to plain batched generate's, and the schedule's batch rounds reported."""
    target, tokenizer, drafter = tiny
    prompts = PROMPTS + PROMPTS[:1]  # a batch of 2, then the last prompt alone
    greedy = online_metrics(target, tokenizer, drafter, prompts, max_new_tokens=12, do_sample=False, warmup=False,
                            batch_size=2)
    batches = 2
    assert greedy["identical_to_plain"] == f"{batches}/{batches}" and greedy["batch_size"] == 2
    assert greedy["batch_rounds"] > 0 and 0 <= greedy["plain_step_share"] <= 1
    assert "in batches of 2" in format_report({"machine": "m", "dtype": "float32", "online": [greedy]})


def test_timed_generation_splits_the_prefill_from_decoding(tiny):
    """The first token comes from the prefill: decoding is timed from its arrival, with or without a drafter."""
    from dspark_hf.prompts import encode_prompt
    from dspark_hf.timing import timed_generation

    target, tokenizer, drafter = tiny
    inputs = encode_prompt(tokenizer, PROMPTS[0])
    forwards = []  # (start, end) of each target forward; the first is the prefill
    hooks = [target.register_forward_pre_hook(lambda *args: forwards.append([time.perf_counter(), None])),
             target.register_forward_hook(lambda *args: forwards[-1].__setitem__(1, time.perf_counter()))]
    try:
        for kwargs in ({}, {"assistant_model": drafter}):
            forwards.clear()
            timed = timed_generation(target, inputs, 8, False, min_new_tokens=8, **kwargs)
            assert timed.tokens.numel() == 8 and timed.decode_tokens == 7
            prefill_forward = forwards[0][1] - forwards[0][0]
            assert prefill_forward <= timed.prefill_seconds < timed.seconds  # the clock stops after the prefill
            assert timed.decode_seconds == pytest.approx(timed.seconds - timed.prefill_seconds)
        forwards.clear()
        single = timed_generation(target, inputs, 1, False)
        assert single.decode_tokens == 0 and 0 <= single.decode_seconds
        assert forwards[0][1] - forwards[0][0] <= single.prefill_seconds <= single.seconds
    finally:
        for hook in hooks:
            hook.remove()


def test_eval_and_bench_commands_run_on_a_tiny_model(tiny, tmp_path, capsys):
    from dspark_hf import benchmark, evaluation

    target, tokenizer, drafter = tiny
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "dspark")
    dflash = make_drafter(target, draft_vocab_size=len(tokenizer) // 2, aux_hidden_state_layer_ids=AUX, mask_token_id=16,
                          markov_rank=0, enable_confidence_head=False)
    dflash.save_pretrained(tmp_path / "dflash")
    build_cache(target, tokenizer, CONVERSATIONS, tmp_path / "c", AUX, dtype="float32", progress=False)

    parser = argparse.ArgumentParser()
    evaluation.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "dspark"), "--target", str(tmp_path / "target"), "--cache",
                              str(tmp_path / "c"), "--num-prompts", "1", "--max-new-tokens", "6", "--dtype", "float32",
                              "--prompts", str(tmp_path / "prompts.jsonl"), "--split", "all", "--plots",
                              str(tmp_path / "plots"), "--json", str(tmp_path / "eval.json")])
    from dspark_hf.data import write_jsonl

    write_jsonl(tmp_path / "prompts.jsonl", CONVERSATIONS)
    assert evaluation.run(args) == 0
    out = capsys.readouterr().out
    assert "offline (teacher-forced" in out and "online (greedy" in out and "calibration" in out
    assert (tmp_path / "plots" / "acceptance.png").stat().st_size > 0
    assert (tmp_path / "plots" / "reliability.png").stat().st_size > 0

    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "dspark"), "--dflash", str(tmp_path / "dflash"), "--target",
                              str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"), "--split", "all",
                              "--num-prompts", "1", "--max-new-tokens", "6", "--repetitions", "2", "--dtype", "float32",
                              "--drafter-dtype", "bfloat16", "--assistant-layers", "2", "--methods",
                              *benchmark.ALL_METHODS, "--plots", str(tmp_path / "bench-plots"), "--json",
                              str(tmp_path / "bench.json")])
    assert benchmark.run(args) == 0
    out = capsys.readouterr().out
    for method in benchmark.ALL_METHODS:
        assert f"\n{method} " in out
    assert "dspark overhead" in out and "machine:" in out and "dtype: float32 (drafters: bfloat16)" in out
    assert "summary: DSpark (shipped generation config) × plain generate per domain" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    domain = report["domains"][str(tmp_path / "prompts.jsonl")]
    live = domain["modes"]["greedy"]["dspark"]
    assert report["drafter_dtype"] == "bfloat16" and live["identical_to_plain"] == 1  # bf16 drafter, fp32 target
    assert domain["modes"]["greedy"]["plain-reseeded"]["identical_to_plain"] == 1  # the noise floor: same text, new timing
    assert len(live["acceptance_conditional_rounds"]) == drafter.num_draft_tokens
    assert live["acceptance_cumulative_rounds"][0] == live["rounds"] - live["drafts_per_round_histogram"][0]
    assert (tmp_path / "bench-plots" / "acceptance.png").stat().st_size > 0
    assert "decode ×" in out and live["decode_speedup_vs_plain"] > 0 and live["decode_tokens_per_s"] > 0

    # `make drafter`'s sizing bench (fixed blocks against plain only; the drafter's round cost is still measured), here
    # with fixed-length answers.
    args = parser.parse_args(["--model", str(tmp_path / "dspark"), "--target", str(tmp_path / "target"), "--prompts",
                              str(tmp_path / "prompts.jsonl"), "--split", "all", "--num-prompts", "1", "--max-new-tokens",
                              "6", "--repetitions", "1", "--dtype", "float32", "--methods", "plain", "dspark-fixed",
                              "--fixed-length", "--json", str(tmp_path / "sizing-bench.json")])
    assert benchmark.run(args) == 0
    assert "max_new_tokens: 6 (fixed length, EOS off)" in capsys.readouterr().out
    sizing_bench = json.loads((tmp_path / "sizing-bench.json").read_text())
    assert sizing_bench["fixed_length"] is True
    assert sizing_bench["dspark_overhead"]["draft_round_ms"] > 0
    _check_sizing_picks_the_fastest(tmp_path, sizing_bench)


def test_bench_batch_size_runs_batched_methods_side_by_side(tiny, tmp_path, capsys):
    """`bench --batch-size 2`: left-padded batches of the domain's prompts, plain against the DSpark drafters (the
    one-row baselines left out), the same texts as plain batched generate, and what the width schedule chose."""
    from dspark_hf import benchmark
    from dspark_hf.data import write_jsonl

    target, tokenizer, drafter = tiny
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "dspark")
    write_jsonl(tmp_path / "prompts.jsonl", CONVERSATIONS)
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "dspark"), "--target", str(tmp_path / "target"), "--prompts",
                              str(tmp_path / "prompts.jsonl"), "--split", "all", "--num-prompts", "3", "--batch-size", "2",
                              "--max-new-tokens", "6", "--repetitions", "1", "--dtype", "float32", "--json",
                              str(tmp_path / "bench.json")])
    assert benchmark.run(args) == 0
    out = capsys.readouterr().out
    assert "batch size: 2 (left-padded" in out and "\ndspark " in out
    domain = json.loads((tmp_path / "bench.json").read_text())["domains"][str(tmp_path / "prompts.jsonl")]
    assert not set(benchmark.ONE_ROW_METHODS) & set(domain["modes"]["greedy"])  # transformers serves them one row at a time
    assert domain["prompts"] == 3 and domain["calls"] == 2  # batches of 2 and 1
    for method in ("dspark", "dspark-fixed"):
        live = domain["modes"]["greedy"][method]
        assert live["identical_to_plain"] == 2 and live["batch_rounds"] > 0 and 0 <= live["plain_step_share"] <= 1


def test_fixed_length_batches_count_every_row_to_max_new_tokens(tiny):
    """`--fixed-length` turns EOS off: every row of a batch decodes max_new_tokens, and all of them are counted
    (with EOS on, a row's tokens end at its first EOS)."""
    from dspark_hf.prompts import encode_batches
    from dspark_hf.timing import timed_batch_generation

    target, tokenizer, drafter = tiny
    batch = encode_batches(tokenizer, PROMPTS, 2)[0]
    for kwargs in ({}, {"assistant_model": drafter}):
        timed = timed_batch_generation(target, batch, 9, False, 0, eos_token_id=None, **kwargs)
        assert timed.tokens.numel() == 2 * 9


@pytest.mark.slow
def test_bench_isa_runs_each_instruction_set_in_its_own_process_side_by_side(tiny, tmp_path, capsys):
    """`bench --isa native avx2`: the bench once natively and once held to AVX2 (ATen, oneDNN and MKL capped in a
    process of its own), each machine line naming its ISA, and DSpark × plain per ISA side by side."""
    from dspark_hf import benchmark
    from dspark_hf.data import write_jsonl

    target, tokenizer, drafter = tiny
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "dspark")
    write_jsonl(tmp_path / "prompts.jsonl", CONVERSATIONS)
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "dspark"), "--target", str(tmp_path / "target"), "--prompts",
                              str(tmp_path / "prompts.jsonl"), "--split", "all", "--num-prompts", "1", "--methods",
                              "plain", "dspark", "--modes", "greedy", "--max-new-tokens", "4", "--repetitions", "1",
                              "--dtype", "float32", "--isa", "native", "avx2", "--json", str(tmp_path / "bench.json")])
    assert benchmark.run(args) == 0
    out = capsys.readouterr().out
    reports = json.loads((tmp_path / "bench.json").read_text())["isa"]
    assert "capped" not in reports["native"]["machine"]
    assert "AVX2, bf16 emulated, capped ATEN_CPU_CAPABILITY=avx2" in reports["avx2"]["machine"]
    assert "| domain | mode | native × plain | avx2 × plain |" in out and "=== ISA avx2 ===" in out


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_sizing_picks_the_fastest(tmp_path, report):
    """`make drafter`'s sizing stage: examples/pick_size.py reads each candidate's bench and picks the highest
    geometric-mean speed-up; the model card shows every candidate's numbers."""
    work = tmp_path / "work"
    slower = json.loads(json.dumps(report))
    for result in slower["domains"].values():
        for methods in result["modes"].values():
            methods["dspark-fixed"]["speedup_vs_plain"] /= 2
    for name, bench in (("slow", slower), ("fast", report)):
        (work / f"size-{name}").mkdir(parents=True)
        (work / f"size-{name}" / "bench.json").write_text(json.dumps(bench))
        (work / f"size-{name}" / "training_args.json").write_text(json.dumps({"max_steps": 7}))
        shutil.copytree(tmp_path / "dspark", work / f"size-{name}" / "drafter")
    pick_size = _example("pick_size")
    assert pick_size.main(work, ["slow", "fast"]) == "fast"
    sizing = json.loads((work / "sizing.json").read_text())
    speedups = [m["dspark-fixed"]["speedup_vs_plain"] for r in report["domains"].values() for m in r["modes"].values()]
    geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
    assert sizing["candidates"]["fast"]["geo-mean × plain"] == pytest.approx(geomean, abs=1e-3)
    assert sizing["candidates"]["slow"]["geo-mean × plain"] == pytest.approx(geomean / 2, abs=1e-3)
    assert sizing["candidates"]["fast"]["MB (bf16)"] > 0 and sizing["steps"] == 7
    assert " / " in sizing["candidates"]["fast"]["draft ms / verify ms"]
    pick_size.MAX_MB = sizing["candidates"]["fast"]["MB (bf16)"] - 0.1  # the fast one over the limit: never shipped
    with pytest.raises(SystemExit, match="every candidate is over MAX_MB"):
        pick_size.main(work, ["slow", "fast"])
    pick_size.MAX_MB = 25
    section = "\n".join(_example("model_card").sizing_section(work))
    assert "**fast**" in section and "| slow |" in section and "7 steps" in section
    from dspark_hf.data import write_jsonl

    (work / "data").mkdir()
    write_jsonl(work / "data" / "chatterbot-train.jsonl", CONVERSATIONS)
    data = "\n".join(_example("model_card").data_section(work))
    assert f"| chatterbot | {len(CONVERSATIONS)} |" in data and "sampled, T = 0.8" in data


def test_model_card_lists_every_training_cycle(tmp_path):
    """A drafter continued from earlier weights (`--init-from`, possibly on a smaller cache) shows every cycle."""
    caches = {"small": 10, "large": 30}
    for name, samples in caches.items():
        (tmp_path / f"cache-{name}").mkdir()
        (tmp_path / f"cache-{name}" / "manifest.json").write_text(json.dumps({"num_samples": samples, "num_tokens": 100 * samples}))
    runs = [("first", "small", None, 1e-3), ("second", "small", "first", 5e-4), ("continue-dspark", "large", "second", 5e-4)]
    for run, cache, parent, rate in runs:
        (tmp_path / run / "drafter").mkdir(parents=True)
        args = {"max_steps": 100, "learning_rate": rate, "train_cache": str(tmp_path / f"cache-{cache}"),
                "init_from": str(tmp_path / parent / "drafter") if parent else None}
        (tmp_path / run / "training_args.json").write_text(json.dumps(args))
    section = "\n".join(_example("model_card").training_section(tmp_path))
    assert "300 steps in all" in section
    rows = [line for line in section.splitlines() if line.startswith("| cycle ") and not line.startswith("| cycle |")]
    assert len(rows) == 3 and "| 10 | 1,000 | scratch |" in rows[0] and "| 30 | 3,000 | the previous" in rows[2]
    assert str(tmp_path) not in section  # no machine paths in a card


def test_bench_domains_keep_history_when_asked(tmp_path):
    from dspark_hf.prompts import domain_prompts
    from dspark_hf.data import write_jsonl

    turns = [{"role": r, "content": f"{r} {i}"} for i in range(4) for r in ("user", "assistant")]
    write_jsonl(tmp_path / "long.jsonl", [{"id": "a", "messages": turns}, {"id": "b", "messages": turns[:2]}])
    single = domain_prompts(f"{tmp_path / 'long.jsonl'}:all", "test", 5)
    assert single == [[{"role": "user", "content": "user 0"}]] * 2
    long = domain_prompts(f"{tmp_path / 'long.jsonl'}:all:3", "test", 5)
    assert long == [turns[:5]], "three user turns with the replies between them; b has too few turns"
    with pytest.raises(ValueError, match="no prompts with 9 user turn"):
        domain_prompts(f"{tmp_path / 'long.jsonl'}:all:9", "test", 5)


def test_truncated_assistant_shares_the_first_layers(tiny):
    from dspark_hf.benchmark import truncated_assistant

    target = tiny[0]
    small = truncated_assistant(target, 2)
    assert small.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    torch.testing.assert_close(small.model.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    torch.testing.assert_close(small.lm_head.weight, target.lm_head.weight)


def _demo_module():
    return _example("demo")


def test_demo_code_path_on_a_tiny_model(tiny):
    target, tokenizer, drafter = tiny
    lines = []
    result = _demo_module().run_demo(target, tokenizer, drafter, PROMPTS, max_new_tokens=8, log=lines.append)
    assert result["identical"] is True
    assert len(result["acceptance_conditional"]) == drafter.num_draft_tokens
    assert sum("identical: yes" in line for line in lines) == len(PROMPTS)
    assert sum(result["drafts_per_round_histogram"]) == result["rounds"] > 0
    assert 0 <= result["drafts_per_round"] <= drafter.num_draft_tokens
    assert sum("drafts/round" in line for line in lines) == len(PROMPTS)


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no shipped drafter in examples/smollm2-dspark")
def test_shipped_drafter_loads_with_automodel_and_is_lossless_in_fp32(smollm2):
    from transformers import AutoModel

    from dspark_hf.prompts import encode_prompt, held_out_prompts
    from dspark_hf.timing import timed_generate

    target, tokenizer = smollm2
    size = sum(f.stat().st_size for f in SHIPPED.iterdir() if f.is_file())
    assert size <= 25 * 2**20, f"shipped drafter is {size / 2**20:.1f} MiB"
    # as a user loads it (its bf16 checkpoint dtype) and in fp32: the fp32 target's text either way
    for dtype in (None, torch.float32):
        drafter = AutoModel.from_pretrained(str(SHIPPED), trust_remote_code=True, dtype=dtype).eval()
        assert drafter.config.bind_target_embeddings and drafter.dtype == (dtype or torch.bfloat16)
        for messages in held_out_prompts(["chitchat"], "test", 2):
            inputs = encode_prompt(tokenizer, messages)
            plain, _ = timed_generate(target, inputs, 24, False)
            spec, _ = timed_generate(target, inputs, 24, False, assistant_model=drafter)
            assert torch.equal(plain, spec), tokenizer.decode(plain) + " vs " + tokenizer.decode(spec)
        assert drafter.last_generation_stats.rounds > 0
