"""`dspark-hf` command line: one subcommand per pipeline stage (data → cache → vocab → train → eval → export).

Each stage module defines `add_arguments(parser)` and `run(args) -> int`; modules are imported only when their
subcommand runs, so `dspark-hf --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys

from .flags import OneLineParser, option_for_path
from .interrupt import CtrlC, end_process
from .progress import close_all

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "regenerate": ("dspark_hf.regenerate", "let the target write every assistant turn (on-policy data)"),
    "corpus": ("dspark_hf.corpus_store", "pack a regenerated corpus into git (gzips and a manifest), check it, unpack it"),
    "cache": ("dspark_hf.cache", "capture target hidden states into a sharded safetensors cache (bf16 or fp8; "
              "`accelerate launch` splits it across processes)"),
    "vocab": ("dspark_hf.vocab", "build the draft vocabulary (d2t/t2d) from assistant-token frequencies"),
    "train": ("dspark_hf.training.cli", "train a DSpark drafter from a cache or online (--online) with Accelerate"),
    "calibrate": ("dspark_hf.calibration", "fit per-position confidence temperatures (Sequential Temperature Scaling)"),
    "eval": ("dspark_hf.evaluation", "offline τ/acceptance on a cache, online acceptance and speed with generate"),
    "bench": ("dspark_hf.benchmark", "tokens/s of DSpark vs plain generate and other speculative baselines"),
    "profile": ("dspark_hf.profile", "measure the target's verify cost t(k) for the hardware-aware draft schedule"),
    "export": ("dspark_hf.formats.export", "write a drafter in the speculators/vLLM layout"),
    "convert": ("dspark_hf.formats.convert", "import z-lab DFlash, DeepSpec or speculators checkpoints"),
}


DEBUG_ENV = "DSPARK_HF_DEBUG"
DEBUG_HELP = f"show the full traceback of an error (or set {DEBUG_ENV}=1)"
# How to go on after Ctrl-C, per command (default: start again).
RESUME_HINTS = {
    "regenerate": "rerun the same command to resume where it stopped (finished conversations are kept)",
    "cache": "rerun the same command to resume where it stopped (finished shards are kept)",
    "train": "rerun the same command with --resume to continue from the last checkpoint",
}
# What to do about the OSErrors users hit while writing results; {flag} is the option holding the path.
OS_ERROR_FIXES = {
    errno.ENOSPC: "free some disk space or pass {a_flag} on another disk",
    errno.EDQUOT: "free some disk space or pass {a_flag} on another disk",
    errno.EROFS: "the disk is read-only; pass {a_flag} on a writable disk",
    errno.EACCES: "pass {a_flag} you may write to",
    errno.EPERM: "pass {a_flag} you may write to",
    errno.ENOTDIR: "a file stands where a directory is needed; pass another {flag}",
    errno.EISDIR: "a directory stands where a file is needed; pass another {flag}",
    errno.EEXIST: "a file stands where a directory is needed; pass another {flag}",
}


def describe_os_error(error: OSError, flag: str | None = None) -> str:
    """One line for an OSError: what failed, on which path, and the fix when we know it (ours carry only a message);
    `flag` is the option that named the path (`--output`, `--output-dir`), when it is one of the user's."""
    if error.errno is None:
        return str(error)
    what = error.strerror or str(error)
    where = f": {error.filename}" if error.filename else ""
    fix = OS_ERROR_FIXES.get(error.errno)
    flag = flag or "--output"
    a_flag = f"an {flag}" if flag.startswith("-") else f"a {flag}"
    return f"{what}{where}" + (f"; {fix.format(flag=flag, a_flag=a_flag)}" if fix else "")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = OneLineParser(prog="dspark-hf", description="DSpark speculative-decoding drafters for transformers.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    children = {}
    for name, (_, help_text) in COMMANDS.items():
        children[name] = subparsers.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: the subcommand must not reset a `--debug` given before it
        children[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser, children


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # the `dspark-hf` program, not a caller that goes on after it returns
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
    if args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return int(module.run(args) or 0)  # errors raise with their traceback
    ctrl_c = CtrlC(f"dspark-hf {command}: interrupted; {RESUME_HINTS.get(command, 'rerun the same command to start again')}")
    try:
        with ctrl_c if own_process else contextlib.nullcontext():  # ends within GRACE_S, even inside native code
            return int(module.run(args) or 0)
    except KeyboardInterrupt:
        close_all()  # a bar the interrupted stage left open ends before the hint, not after it
        ctrl_c.announce()
        if own_process:
            end_process(130)  # not the 1-2 s the interpreter takes to tear torch and the target down
        return 130
    except ValueError as error:
        # Bad input: one clear line naming the problem and the fix, no traceback.
        close_all()
        print(f"dspark-hf {command}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # our own FileNotFoundError messages, or a full/read-only disk, a file for a directory...
        close_all()
        flag = option_for_path(children[command], args, error.filename)
        print(f"dspark-hf {command}: error: {describe_os_error(error, flag)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
