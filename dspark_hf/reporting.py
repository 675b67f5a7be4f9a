"""What every measuring command prints with its numbers: the machine it ran on, and the report as table or JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .remote_code.profiling_dspark import cpu_isa_description, cpu_name


def machine_description() -> str:
    """CPU model and ISA, cores and torch threads (and the GPU if one is used): printed with every table."""
    text = (f"{cpu_name()} ({cpu_isa_description()}), {os.cpu_count()} cores, torch {torch.__version__} with "
            f"{torch.get_num_threads()} thread(s)")
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    return text


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads (None keeps torch's default), so timings state what they ran on."""
    if threads:
        torch.set_num_threads(threads)


def emit_report(report: dict, json_target: str | None, format_report) -> None:
    """Print a report as a table for people, and/or write it as JSON for machines (`--json FILE`, or `--json -`)."""
    if json_target and json_target != "-":
        Path(json_target).parent.mkdir(parents=True, exist_ok=True)
        Path(json_target).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if json_target == "-" else format_report(report))


__all__ = ["emit_report", "machine_description", "set_threads"]
