"""How fast a batch can be: batched DSpark against the bound its slowest row sets, greedy.

    HF_HUB_OFFLINE=1 python benchmarks/batch_bound.py [--batch-size 4] [--num-prompts 8] [--dtype bfloat16]

A batched round costs at least what a round of its slowest row alone costs, and the call lasts until that row is
done, so batched DSpark cannot finish before its slowest row would finish alone: × plain batched `generate` is at
most plain batched time / max over rows of (that row alone with DSpark). On a CPU where a plain batched step costs
about what a one-row step costs, that bound is about the slowest row's own one-prompt speed-up. For each batch of the
chat test prompts this prints plain batched and DSpark batched seconds, every row alone with DSpark and plain, the
bound and the measured ratio, and the rounds the batch ran against its slowest row's rounds alone. Calls are
interleaved and repeated (`--repetitions`, medians). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dspark_hf.evaluation import load_drafter
from dspark_hf.prompts import encode_batches, held_out_prompts
from dspark_hf.reporting import machine_description
from dspark_hf.targets import load_target
from dspark_hf.timing import timed_batch_generation, timed_generate


def row_inputs(batch: dict, row: int) -> dict:
    """One row of a left-padded batch without its padding."""
    keep = batch["attention_mask"][row].bool()
    return {name: tensor[row][keep][None] for name, tensor in batch.items()}


def median_seconds(call, repetitions: int) -> float:
    return statistics.median(call() for _ in range(repetitions))


def measure_batch(target, drafter, batch: dict, tokens: int, repetitions: int) -> dict:
    """Seconds of plain and DSpark on the batch and on each row alone, with the rounds DSpark ran each time."""
    def batched(**kwargs):
        return timed_batch_generation(target, batch, tokens, False, **kwargs).seconds

    def alone(row: int, **kwargs):
        return timed_generate(target, row_inputs(batch, row), tokens, False, **kwargs)[1]

    plain = median_seconds(batched, repetitions)
    dspark = median_seconds(lambda: batched(assistant_model=drafter), repetitions)
    batch_rounds = len(drafter.last_generation_stats.widths)
    rows = []
    for row in range(batch["input_ids"].shape[0]):
        row_dspark = median_seconds(lambda: alone(row, assistant_model=drafter), repetitions)
        rows.append({"plain_s": median_seconds(lambda: alone(row), repetitions), "dspark_s": row_dspark,
                     "rounds": drafter.last_generation_stats.rounds})
    slowest = max(rows, key=lambda r: r["dspark_s"])
    return {"plain_s": plain, "dspark_s": dspark, "ratio": plain / dspark, "bound": plain / slowest["dspark_s"],
            "rounds": batch_rounds, "slowest_row_rounds": slowest["rounds"],
            "rows_alone_ratio": [r["plain_s"] / r["dspark_s"] for r in rows], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", dtype=args.dtype)
    drafter = load_drafter("examples/smollm2-dspark", target, getattr(torch, args.dtype))
    batches = encode_batches(tokenizer, held_out_prompts(limit=args.num_prompts), args.batch_size)
    measure_batch(target, drafter, batches[0], 8, 1)  # warm: the first calls pay for the first passes
    results = [measure_batch(target, drafter, batch, args.max_new_tokens, args.repetitions) for batch in batches]
    total = {name: sum(r[name] for r in results) for name in ("plain_s", "dspark_s")}
    slowest = sum(max(row["dspark_s"] for row in r["rows"]) for r in results)
    print(json.dumps({"machine": machine_description(), "dtype": args.dtype, "batch_size": args.batch_size,
                      "ratio": total["plain_s"] / total["dspark_s"], "bound": total["plain_s"] / slowest,
                      "batches": results}, indent=1))


if __name__ == "__main__":
    main()
