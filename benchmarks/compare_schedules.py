"""Drafting settings of one drafter side by side: each variant against plain `generate`, per domain and mode.

Every variant is its own copy of the drafter (the online confidence bias and lookup counts are per drafter), run in
the bench's order (domain → mode → repetition → prompt → variant, the variant order rotated each repetition). Per
cell: whole-call ratio to plain / decode ratio (after the first token; see `dspark-hf bench`), drafts per round and
the share of rounds that verified prompt-lookup drafts. A variant is `NAME=KEY:VALUE,KEY:VALUE` of drafter
generation_config settings (`dspark_` prefix implied, except transformers' own `num_assistant_tokens`), e.g.

    PYTHONPATH=. python benchmarks/compare_schedules.py --dtype float32 \\
        "left-to-right=lookahead:false,lookup_ngram_size:0" "shipped="

`NAME@DIR=...` loads that variant from another checkpoint directory with its own remote code
(`trust_remote_code`), e.g. the same weights next to an older `modeling_dspark.py` (`git show REV:modeling_dspark.py`)
to compare two versions of the generation path side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModel

from dspark_hf.assets import load_smollm2
from dspark_hf.evaluation import load_drafter
from dspark_hf.prompts import domain_prompts, encode_prompt
from dspark_hf.reporting import machine_description
from dspark_hf.timing import timed_generation

DOMAINS = ["chitchat", "wordnet-nouns", "stdlib-explain", "chitchat-long:test:6", "humaneval:all"]


TRANSFORMERS_KEYS = ("num_assistant_tokens",)  # transformers' own assistant settings, named as they are


def parse_variant(spec: str) -> tuple[str, str | None, dict]:
    """(name, checkpoint directory or None, generation_config settings) of `NAME[@DIR]=KEY:VALUE,...`."""
    name, _, settings = spec.partition("=")
    name, _, directory = name.partition("@")
    parsed = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition(":")
        parsed[key if key in TRANSFORMERS_KEYS else f"dspark_{key}"] = json.loads(value)
    return name, directory or None, parsed


def load_variant(directory: str, target):
    """A drafter with the remote code of its own directory, bound to the target."""
    drafter = AutoModel.from_pretrained(directory, trust_remote_code=True, dtype=torch.bfloat16).eval()
    drafter.bind_target(target)
    return drafter


def run_cell(target, encoded, drafters: dict, do_sample: bool, repetitions: int, max_new_tokens: int) -> dict:
    methods = ["plain", *drafters]
    totals = {m: [[0, 0.0, 0, 0.0] for _ in range(repetitions)] for m in methods}  # tokens, s, decode tokens, s
    drafted = {m: [0, 0, 0] for m in drafters}  # drafts, rounds, lookup rounds
    for m in methods:  # warm-up
        timed_generation(target, encoded[0], 8, do_sample, 0, **({"assistant_model": drafters[m]} if m in drafters else {}))
    for rep in range(repetitions):
        order = methods[rep % len(methods):] + methods[: rep % len(methods)]
        for i, inputs in enumerate(encoded):
            for m in order:
                kwargs = {"assistant_model": drafters[m]} if m in drafters else {}
                timed = timed_generation(target, inputs, max_new_tokens, do_sample, 1000 * rep + i, **kwargs)
                for j, value in enumerate((timed.tokens.numel(), timed.seconds, timed.decode_tokens, timed.decode_seconds)):
                    totals[m][rep][j] += value
                if m in drafters:
                    stats = drafters[m].last_generation_stats
                    drafted[m] = [drafted[m][0] + sum(stats.drafted), drafted[m][1] + stats.rounds,
                                  drafted[m][2] + stats.lookup_rounds]
    rate = {m: statistics.median(t / s for t, s, _, _ in totals[m]) for m in methods}
    decode = {m: statistics.median(t / s for _, _, t, s in totals[m]) for m in methods}
    return {m: {"x_plain": rate[m] / rate["plain"], "decode_x_plain": decode[m] / decode["plain"],
                "drafts_per_round": drafted[m][0] / max(drafted[m][1], 1),
                "lookup_share": drafted[m][2] / max(drafted[m][1], 1)} for m in drafters}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=KEY:VALUE,... (dspark_ generation_config settings)")
    parser.add_argument("--model", default="examples/smollm2-dspark")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", nargs="+", default=DOMAINS)
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"])
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    target, tokenizer = load_smollm2(dtype=args.dtype)
    drafters = {}
    for spec in args.variants:
        name, directory, settings = parse_variant(spec)
        drafter = load_variant(directory, target) if directory else load_drafter(args.model, target, torch.bfloat16)
        for key, value in settings.items():
            setattr(drafter.generation_config, key, value)
        drafters[name] = drafter
    print(f"{machine_description()}; SmolLM2-135M-Instruct {args.dtype}, drafter bf16; {args.num_prompts} prompts "
          f"per domain × {args.max_new_tokens} tokens, {args.repetitions} repetitions (median)")
    print("cells: × plain (whole calls) / × plain (decoding), drafts per round, share of prompt-lookup rounds")
    results = {}
    for spec in args.prompts:
        encoded = [encode_prompt(tokenizer, p) for p in domain_prompts(spec, "test", args.num_prompts)]
        for mode in args.modes:
            start = time.perf_counter()
            row = run_cell(target, encoded, drafters, mode == "sample", args.repetitions, args.max_new_tokens)
            results[f"{spec} {mode}"] = row
            cells = "  ".join(f"{m} {r['x_plain']:.2f}/{r['decode_x_plain']:.2f} k {r['drafts_per_round']:.2f} "
                              f"L {r['lookup_share']:.2f}" for m, r in row.items())
            print(f"{spec:22s} {mode:7s} {cells}   ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "machine": machine_description(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
