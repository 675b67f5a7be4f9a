"""Where one speculative round's time goes, and what a round that drafts nothing costs against plain `generate`.

Part 1 (round breakdown): SmolLM2 target + the shipped drafter (fixed-length blocks, so every round has a full
drafter pass), chitchat test prompts, greedy. Each stage is timed by wrapping it, over every round of every prompt:

- verify: the target's forward on the candidates (the prefill is excluded);
- hand-off: the generator slicing the verify pass's aux hidden states of newly committed positions;
- context: `extend_context` (fuse + K/V of the committed positions);
- parallel: `block_rows` (the one parallel block pass);
- markov: the rest of `draft_block` (Markov head, confidence head, token choice, left to right);
- transformers: everything else in the round (the assisted loop's own bookkeeping).

`--sample` runs part 1 at T = 1 (the bench's sampling mode). Part 2 (k = 0 rounds): plain greedy vs assisted rounds
that never draft: (a) a generator that returns no candidates and never runs a drafter (transformers' assisted loop
alone), (b) the drafter with the hardware schedule forced to k = 0 and the back-off on (the shipped behaviour when
drafting does not pay), (c) the same with the back-off off (a drafter pass every round). Prompts × repetitions
interleaved; medians of per-token wall time and of this process's CPU time (with one thread, the CPU time is the
steadier measure on a shared machine).

    PYTHONPATH=. python benchmarks/profile_round.py --threads 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from dspark_hf.evaluation import load_drafter
from dspark_hf.prompts import encode_prompt, held_out_prompts
from dspark_hf.reporting import machine_description
from dspark_hf.remote_code import generation_dspark, profiling_dspark, routing_dspark, scheduling_dspark
from dspark_hf.timing import timed_generate

STAGES = ["verify", "hand-off", "context", "parallel", "markov", "transformers"]


class Timers:
    """Accumulates seconds per stage; `wrap` times a bound method in place."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, owner, name: str, stage: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start
                self.calls[stage] += 1

        setattr(owner, name, timed)
        return original


def round_breakdown(target, drafter, encoded, max_new_tokens: int, do_sample: bool = False) -> dict:
    timers = Timers()
    drafter.generation_config.dspark_schedule = "fixed"
    verify_start = {}

    def before(module, args, kwargs):
        verify_start["t"] = time.perf_counter()

    def after(module, args, kwargs, output):
        if kwargs.get("input_ids", args[0] if args else None).shape[1] <= drafter.config.block_size:  # not the prefill
            timers.seconds["verify"] += time.perf_counter() - verify_start["t"]
            timers.calls["verify"] += 1
        else:
            timers.seconds["prefill"] += time.perf_counter() - verify_start["t"]

    hooks = [target.register_forward_pre_hook(before, with_kwargs=True),
             target.register_forward_hook(after, with_kwargs=True)]
    generator_class = generation_dspark.DSparkCandidateGenerator
    original_get = timers.wrap(generator_class, "get_candidates", "get_candidates")
    originals = {name: timers.wrap(drafter, name, stage) for name, stage in
                 [("extend_context", "context"), ("block_rows", "parallel"), ("draft_block", "draft_block")]}
    total, rounds, tokens = 0.0, 0, 0
    try:
        for inputs in encoded:
            new_tokens, seconds = timed_generate(target, inputs, max_new_tokens, do_sample, assistant_model=drafter)
            total += seconds
            rounds += drafter.last_generation_stats.rounds
            tokens += new_tokens.shape[0] - 1  # the prefill's token is not a round's
    finally:
        for hook in hooks:
            hook.remove()
        generator_class.get_candidates = original_get
        for name in originals:
            delattr(drafter, name)  # back to the class methods
    s = timers.seconds
    stages = {
        "verify": s["verify"],
        "hand-off": s["get_candidates"] - s["context"] - s["draft_block"],
        "context": s["context"],
        "parallel": s["parallel"],
        "markov": s["draft_block"] - s["parallel"],
    }
    stages["transformers"] = total - s["prefill"] - s["get_candidates"] - s["verify"]
    return {"rounds": rounds, "tokens_per_round": tokens / max(rounds, 1),
            "ms_per_round": {k: 1e3 * v / max(rounds, 1) for k, v in stages.items()}}


class NoCandidates(CandidateGenerator):
    """Assisted rounds with no drafter at all: isolates transformers' assisted loop."""

    def get_candidates(self, input_ids, *args, **kwargs):
        return input_ids, None

    def update_candidate_strategy(self, *args, **kwargs):
        pass


def k0_costs(target, drafter, encoded, max_new_tokens: int, repetitions: int) -> dict:
    drafter.generation_config.dspark_schedule = "hardware"
    never = profiling_dspark.DSparkVerifyProfile(  # t(k) = (1 + 9k)·t(0): drafting can never pay
        key=profiling_dspark.verify_profile_key(target), context_lengths=[16, 4096],
        verify_time_s=[[1.0 + 9.0 * k for k in range(8)]] * 2, spread_s=[[0.0] * 8] * 2)
    drafter.drafting_state.verify_profile = never
    no_candidates = NoCandidates()
    marker = type("NoDrafter", (), {routing_dspark.DSPARK_FACTORY_ATTRIBUTE: lambda *a: no_candidates})()
    marker.config = drafter.config  # checked against the target like any DSpark drafter (vocabulary, sizes)
    methods = {
        "plain": {},
        "assisted loop, no drafter": {"assistant_model": marker},
        "k=0 schedule + back-off": {"assistant_model": drafter},
        "k=0 schedule, no back-off": {"assistant_model": drafter, "_no_backoff": True},
    }
    per_token = defaultdict(list)
    original_backoff = scheduling_dspark.DSparkDrafterBackoff.should_skip
    for rep in range(repetitions + 1):  # repetition 0 warms up
        names = list(methods)
        names = names[rep % len(names):] + names[: rep % len(names)]
        for inputs in encoded:
            for name in names:
                kwargs = dict(methods[name])
                if kwargs.pop("_no_backoff", False):
                    scheduling_dspark.DSparkDrafterBackoff.should_skip = lambda self: False
                start, start_cpu = time.perf_counter(), time.process_time()
                out = target.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=target.generation_config.eos_token_id, **kwargs)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                scheduling_dspark.DSparkDrafterBackoff.should_skip = original_backoff
                if rep:
                    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
                    per_token[name].append((elapsed / new_tokens, cpu / new_tokens))
    # CPU time of this (one-thread) process is far less disturbed by other jobs on a shared machine than wall time.
    wall = {name: statistics.median(t for t, _ in v) for name, v in per_token.items()}
    cpu = {name: statistics.median(c for _, c in v) for name, v in per_token.items()}
    return {name: {"ms_per_token": 1e3 * wall[name], "vs_plain": wall[name] / wall["plain"],
                   "cpu_ms_per_token": 1e3 * cpu[name], "cpu_vs_plain": cpu[name] / cpu["plain"]} for name in per_token}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="examples/smollm2-dspark")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3, help="of part 2")
    parser.add_argument("--sample", action="store_true", help="part 1 at T = 1 (draws and q on the draft side)")
    parser.add_argument("--skip-k0", action="store_true", help="part 1 only")
    args = parser.parse_args()

    from dspark_hf.assets import load_smollm2

    torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2(dtype=args.dtype)
    drafter = load_drafter(args.model, target, getattr(torch, args.dtype))
    encoded = [encode_prompt(tokenizer, p) for p in held_out_prompts(["chitchat"], "test", args.num_prompts)]
    context = statistics.mean(e["input_ids"].shape[1] for e in encoded)
    print(f"{machine_description()}; SmolLM2-135M-Instruct {args.dtype}; {len(encoded)} chitchat test prompts "
          f"(mean prompt {context:.0f} tokens), {args.max_new_tokens} new tokens, "
          f"part 1 {'T = 1' if args.sample else 'greedy'}")

    target.generate(**encoded[0], max_new_tokens=8, do_sample=False, assistant_model=drafter)  # warm-up
    report = round_breakdown(target, drafter, encoded, args.max_new_tokens, args.sample)
    ms = report["ms_per_round"]
    round_ms = sum(ms.values())
    print(f"\none round (fixed blocks of {drafter.num_draft_tokens} drafts), {report['rounds']} rounds, "
          f"{report['tokens_per_round']:.2f} tokens per round, {round_ms:.1f} ms per round")
    print(f"{'stage':<14}{'ms':>8}{'share':>8}")
    for stage in STAGES:
        print(f"{stage:<14}{ms[stage]:8.2f}{ms[stage] / round_ms:8.1%}")

    if args.skip_k0:
        return
    costs = k0_costs(target, drafter, encoded[: max(2, len(encoded) // 2)], args.max_new_tokens, args.repetitions)
    print(f"\nrounds that draft nothing vs plain greedy ({args.repetitions} repetitions, medians)")
    print(f"{'method':<28}{'wall ms/token':>14}{'vs plain':>10}{'CPU ms/token':>14}{'vs plain':>10}")
    for name, row in costs.items():
        print(f"{name:<28}{row['ms_per_token']:14.2f}{row['vs_plain']:10.3f}"
              f"{row['cpu_ms_per_token']:14.2f}{row['cpu_vs_plain']:10.3f}")


if __name__ == "__main__":
    main()
