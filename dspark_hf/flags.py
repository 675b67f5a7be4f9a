"""What a flag value may be, checked by argparse before a command does any work.

Every numeric flag of every subcommand takes one of these types, so `--batch-size 0`, `--temperature -1` or
`--top-p 2` is refused in one line naming the flag and what it takes (`dspark-hf train: error: argument
--batch-size: takes a whole number of 1 or more, not '0' (see dspark-hf train --help)`), with exit status 2 like any usage error, before a
target loads or an output directory is made. `OneLineParser` keeps argparse's own usage errors (a missing or unknown
flag, a bad choice) to that one line too, instead of the full usage block.
"""

from __future__ import annotations

import argparse
import math
import os


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line: the problem and where to read the flags (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes {what}, not {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"takes {what}, not {text!r}")
    return value


def _bounded(kind, what: str, accept):
    """An argparse type: `text` read as `kind`, refused with `what` unless `accept(value)`."""

    def parse(text: str):
        value = _number(text, kind, what)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"takes {what}, not {text!r}")
        return value

    parse.__name__ = what  # argparse names a type by it in its fallback message
    return parse


positive_int = _bounded(int, "a whole number of 1 or more", lambda v: v >= 1)
non_negative_int = _bounded(int, "a whole number of 0 or more", lambda v: v >= 0)
positive_float = _bounded(float, "a number above 0", lambda v: v > 0)
non_negative_float = _bounded(float, "a number of 0 or more", lambda v: v >= 0)
probability = _bounded(float, "a number from 0 to 1", lambda v: 0 <= v <= 1)
nucleus_mass = _bounded(float, "a number above 0 and at most 1", lambda v: 0 < v <= 1)
below_one = _bounded(float, "a number of 0 or more, below 1", lambda v: 0 <= v < 1)
seed = _bounded(int, "a whole number from 0 to 4294967295", lambda v: 0 <= v < 2**32)  # numpy's seed range


def layer_ids(text: str) -> list[int]:
    """`1,10,20` -> [1, 10, 20]: aux layer ids, each 0 or more (the target's depth is checked once it is known)."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated layer ids such as 1,10,20, not {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"takes layer ids of 0 or more such as 1,10,20, not {text!r}")
    return ids


def option_for_path(parser: argparse.ArgumentParser, args: argparse.Namespace, path: str | None) -> str | None:
    """The flag of `parser` (or a positional's name) whose value in `args` is `path` or the nearest folder above it:
    which of the user's paths an OSError is about, so its fix names that flag."""
    if not path:
        return None
    target, best, best_length = os.path.abspath(path), None, -1
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not isinstance(value, str) or not value:
            continue
        given = os.path.abspath(value)
        if (target == given or target.startswith(given.rstrip(os.sep) + os.sep)) and len(given) > best_length:
            best = action.option_strings[0] if action.option_strings else action.dest  # a positional: its name
            best_length = len(given)
    return best


__all__ = [
    "OneLineParser",
    "below_one",
    "layer_ids",
    "non_negative_float",
    "non_negative_int",
    "nucleus_mass",
    "option_for_path",
    "positive_float",
    "positive_int",
    "probability",
    "seed",
]
