"""`dspark-hf` command line: one subcommand per pipeline stage (data → cache → vocab → train → eval → export).

Each stage module defines `add_arguments(parser)` and `run(args) -> int`; modules are imported only when their
subcommand runs, so `dspark-hf --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "regenerate": ("dspark_hf.regenerate", "let the target write every assistant turn (on-policy data)"),
    "cache": ("dspark_hf.cache", "capture target hidden states into a sharded safetensors cache"),
    "vocab": ("dspark_hf.vocab", "build the draft vocabulary (d2t/t2d) from assistant-token frequencies"),
    "train": ("dspark_hf.training.cli", "train a DSpark drafter from a cache with Accelerate"),
    "calibrate": ("dspark_hf.calibration", "fit per-position confidence temperatures (Sequential Temperature Scaling)"),
    "eval": ("dspark_hf.evaluation", "offline τ/acceptance on a cache, online acceptance and speed with generate"),
    "bench": ("dspark_hf.benchmark", "tokens/s of DSpark vs plain generate and other speculative baselines"),
    "profile": ("dspark_hf.profile", "measure the target's verify cost t(k) for the hardware-aware draft schedule"),
    "export": ("dspark_hf.formats.export", "write a drafter in the speculators/vLLM layout"),
    "convert": ("dspark_hf.formats.convert", "import z-lab DFlash, DeepSpec or speculators checkpoints"),
}


def emit_report(report: dict, json_target: str | None, format_report) -> None:
    """Print a report as a table for people, and/or write it as JSON for machines (`--json FILE`, or `--json -`)."""
    if json_target and json_target != "-":
        Path(json_target).parent.mkdir(parents=True, exist_ok=True)
        Path(json_target).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if json_target == "-" else format_report(report))


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="dspark-hf", description="DSpark speculative-decoding drafters for transformers.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    children = {}
    for name, (_, help_text) in COMMANDS.items():
        children[name] = subparsers.add_parser(name, help=help_text, description=help_text)
    return parser, children


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, children = build_parser()
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        parser.parse_args(argv)  # prints help / usage errors
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(f"dspark-hf {command}: not yet available in this version.", file=sys.stderr)
        return 2
    module.add_arguments(children[command])
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        # Bad input: one clear line naming the problem and the fix, no traceback.
        print(f"dspark-hf {command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
