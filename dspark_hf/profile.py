"""`dspark-hf profile`: measure the target's verify cost t(k) on this device and dtype, store it, print the table.

The hardware-aware schedule (`dspark_schedule: "hardware"` in a drafter's generation_config) reads this profile; it
is measured automatically on first use too, so running the command is only needed to re-measure (for example on a
quieter machine) or to look at the numbers. A profile is stored per target (name, revision, config hash), device
(type and name; the CPU's thread count), dtype and torch version under `<HF_HOME>/dspark/profiles/`, and is never
used for another of these.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .remote_code.profiling_dspark import (
    measure_batch_verify_profile,
    measure_verify_profile,
    store_verify_profile,
    verify_profile_path,
)
from .reporting import emit_report
from .targets import add_target_argument, load_target_model


def profile(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_drafts < 1:
        raise ValueError(f"--max-drafts must be at least 1 (got {args.max_drafts}); use the drafter's block size - 1.")
    target = load_target_model(args.target, dtype=args.dtype, device=args.device)
    measured = measure_verify_profile(target, args.max_drafts, tuple(args.contexts), args.repeats)
    path = verify_profile_path(measured.key)
    store_verify_profile(measured, path)
    report = {"path": path, **measured.to_dict()}
    if args.batch_sizes:  # the batch axis t(B, w) of batched generation
        batch = measure_batch_verify_profile(target, args.max_drafts, tuple(sorted(set(args.batch_sizes))))
        report["batch"] = {"path": verify_profile_path(batch.key), **batch.to_dict()}
        store_verify_profile(batch, report["batch"]["path"])
    return report


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
        lines.append("NOISY: the timings cannot rank k on this machine now; drafting falls back to the confidence "
                     "threshold rule. Re-run on a quieter machine to use the hardware-aware schedule.")
    lines.append(f"stored in {report['path']}")
    if "batch" in report:
        lines += format_batch_table(report["batch"])
    return "\n".join(lines)


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
    parser.add_argument("--max-drafts", type=int, default=7, help="largest k measured (the drafter's block size - 1)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512], help="context lengths measured")
    parser.add_argument("--repeats", type=int, default=4, help="timed repetitions per (context, k)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (part of a CPU profile's identity)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=None, metavar="B",
                        help="also measure the batch axis t(B, w) at these batch sizes, e.g. 1 4 16 (batched generation)")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="also write the report as JSON (file or '-')")


def run(args: argparse.Namespace) -> int:
    emit_report(profile(args), args.json, format_report)
    return 0


__all__ = ["format_report", "profile"]
