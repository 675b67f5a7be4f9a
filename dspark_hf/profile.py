"""`dspark-hf profile`: measure the target's verify cost t(k) on this device and dtype, store it, print the table.

The hardware-aware schedule (`dspark_schedule: "hardware"` in a drafter's generation_config) takes this profile as
the shape of the live profile it learns from its own rounds; generation never measures, so the command gives a
first call a measured shape to start from and shows the numbers. A profile is stored per target (name, revision,
config hash), device (type and name; the CPU's ISA and thread count), dtype and torch version under
`<HF_HOME>/dspark/profiles/`, and is never used for another of these.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .flags import positive_int
from .measuring import measure_batch_verify_profile, measure_verify_profile, store_drafter_dtype
from .remote_code.profiling_dspark import store_json, verify_profile_path
from .progress import timed
from .reporting import emit_report, machine_description
from .targets import add_target_argument, check_drafter_dir, load_target, load_target_model

RECOMMEND_DTYPES = ("float32", "bfloat16")


def profile(args: argparse.Namespace) -> dict[str, Any]:
    if args.drafter:
        check_drafter_dir(args.drafter, "--drafter")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target_model(args.target, dtype=args.dtype, device=args.device)
    with timed(f"profile: measuring t(k) for k = 0..{args.max_drafts} at contexts {args.contexts}"):
        measured = measure_verify_profile(target, args.max_drafts, tuple(args.contexts), args.repeats)
    path = verify_profile_path(measured.key)
    store_json(measured.to_dict(), path)
    report = {"path": path, **measured.to_dict()}
    if args.batch_sizes:  # the batch axis t(B, w) of batched generation
        with timed(f"profile: measuring t(B, w) for B in {sorted(set(args.batch_sizes))}"):
            batch = measure_batch_verify_profile(target, args.max_drafts, tuple(sorted(set(args.batch_sizes))))
        report["batch"] = {"path": verify_profile_path(batch.key), **batch.to_dict()}
        store_json(batch.to_dict(), report["batch"]["path"])
    if args.drafter:
        del target
        report["recommendation"] = recommend(args)
    return report


def _tokens_per_s(target, prompts, max_new_tokens: int, **kwargs) -> float:
    """Greedy tokens/s over the prompts, after one untimed call (it warms the kernels and the live profile)."""
    from .timing import timed_generation

    timed_generation(target, prompts[0], max_new_tokens, do_sample=False, **kwargs)
    runs = [timed_generation(target, p, max_new_tokens, do_sample=False, **kwargs) for p in prompts]
    return sum(len(r.tokens) for r in runs) / sum(r.seconds for r in runs)


def recommend(args: argparse.Namespace) -> dict[str, Any]:
    """Which target dtype and drafter dtype give the most tokens/s here, against the best plain configuration:
    greedy chat test prompts, every pair side by side. The fastest drafter dtype per target dtype is stored, so a
    drafter left at `dspark_drafter_dtype="auto"` runs in it on this machine."""
    from .evaluation import load_drafter
    from .prompts import encode_prompt, held_out_prompts

    rows, stored = [], {}
    for target_dtype in RECOMMEND_DTYPES:
        target, tokenizer = load_target(args.target, dtype=target_dtype, device=args.device)
        prompts = [encode_prompt(tokenizer, p, target.device) for p in held_out_prompts(limit=args.recommend_prompts)]
        with timed(f"profile: timing plain generate and the drafter in {', '.join(RECOMMEND_DTYPES)} ({target_dtype} target)"):
            rows.append({"target": target_dtype, "drafter": None,
                         "tokens_per_s": _tokens_per_s(target, prompts, args.recommend_tokens)})
            for drafter_dtype in RECOMMEND_DTYPES:
                drafter = load_drafter(args.drafter, target, getattr(torch, drafter_dtype), flag="--drafter")
                drafter.generation_config.dspark_drafter_dtype = "as-loaded"
                rows.append({"target": target_dtype, "drafter": drafter_dtype, "tokens_per_s": _tokens_per_s(
                    target, prompts, args.recommend_tokens, assistant_model=drafter)})
        mine = {r["drafter"]: r["tokens_per_s"] for r in rows if r["target"] == target_dtype and r["drafter"]}
        stored[target_dtype] = store_drafter_dtype(target, max(mine, key=mine.get), mine)
    plain = max((r for r in rows if r["drafter"] is None), key=lambda r: r["tokens_per_s"])
    best = max((r for r in rows if r["drafter"]), key=lambda r: r["tokens_per_s"])
    return {"machine": machine_description(), "rows": rows, "best_plain": plain, "best": best,
            "speedup": best["tokens_per_s"] / plain["tokens_per_s"], "stored": stored}


def format_report(report: dict[str, Any]) -> str:
    key = report["key"]
    lines = [
        f"target {key['target']} ({key['dtype']}) on {key['device']}: {key['device_name']}, torch {key['torch']}",
        f"verify cost t(k) of k drafts (a forward of k+1 tokens on a cached context), median ± interquartile spread, "
        f"measured in {report['measured_in_s']:.1f} s",
        "  k | " + " | ".join(f"context {n:>5}: ms (× t(0))" for n in report["context_lengths"]),
    ]
    for k in range(len(report["verify_time_s"][0])):
        cells = []
        for times, spreads in zip(report["verify_time_s"], report["spread_s"]):
            cells.append(f"{1e3 * times[k]:8.2f} ± {1e3 * spreads[k]:6.2f} ({times[k] / times[0]:4.2f}×)".ljust(27))
        lines.append(f"{k:>3} | " + " | ".join(cells))
    if report["noisy"]:
        lines.append("NOISY: these timings alone cannot rank k on this machine now; generation refines them from its "
                     "own verify passes (the live profile). Re-run on a quieter machine for a cleaner starting shape.")
    lines.append(f"stored in {report['path']}")
    if "batch" in report:
        lines += format_batch_table(report["batch"])
    if "recommendation" in report:
        lines += format_recommendation(report["recommendation"])
    return "\n".join(lines)


def format_recommendation(recommendation: dict[str, Any]) -> list[str]:
    lines = ["", f"greedy chat tokens/s on {recommendation['machine']}:", "  target   | drafter  | tokens/s"]
    for row in recommendation["rows"]:
        lines.append(f"  {row['target']:<8} | {row['drafter'] or 'plain':<8} | {row['tokens_per_s']:8.1f}")
    best, plain = recommendation["best"], recommendation["best_plain"]
    lines.append(f"recommended: target {best['target']} with the drafter in {best['drafter']}, "
                 f"{best['tokens_per_s']:.1f} tokens/s = {recommendation['speedup']:.2f}× the best plain generate "
                 f"(target {plain['target']}, {plain['tokens_per_s']:.1f} tokens/s). Drafters now run in the fastest "
                 "dtype measured for their target's dtype here (dspark_drafter_dtype=\"auto\").")
    return lines


def format_batch_table(batch: dict[str, Any]) -> list[str]:
    """t(B, w) per batch size and measured width, and each as a multiple of the batch's plain step t(B, 0)."""
    lines = ["", f"batched verify cost t(B, w) of width w for B rows, context {batch['context_length']}, measured in "
                 f"{batch['measured_in_s']:.1f} s",
             "  B | " + " | ".join(f"w = {w}: ms (× t(B, 0))".ljust(22) for w in batch["widths"])]
    for size, times in zip(batch["batch_sizes"], batch["verify_time_s"]):
        lines.append(f"{size:>3} | " + " | ".join(f"{1e3 * t:8.2f} ({t / times[0]:4.2f}×)".ljust(22) for t in times))
    lines.append(f"stored in {batch['path']}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser, default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", help="device to measure on (cpu, cuda, ...)")
    parser.add_argument("--max-drafts", type=positive_int, default=7, help="largest k measured (the drafter's block size - 1)")
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[128, 512], help="context lengths measured")
    parser.add_argument("--repeats", type=positive_int, default=4, help="timed repetitions per (context, k)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (part of a CPU profile's identity)")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="*", default=None, metavar="B",
                        help="also measure the batch axis t(B, w) at these batch sizes, e.g. 1 4 16 (batched generation)")
    parser.add_argument("--drafter", default=None, metavar="DIR",
                        help="also time plain generate and this drafter for each target dtype × drafter dtype and end "
                        "with the recommendation (the fastest drafter dtype per target dtype is stored and used)")
    parser.add_argument("--recommend-prompts", type=positive_int, default=3, help="chat test prompts timed per pair (default: 3)")
    parser.add_argument("--recommend-tokens", type=positive_int, default=48, help="new tokens per prompt (default: 48)")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="also write the report as JSON (file or '-')")


def run(args: argparse.Namespace) -> int:
    emit_report(profile(args), args.json, format_report)
    return 0


__all__ = ["format_report", "profile"]
