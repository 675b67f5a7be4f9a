"""`dspark-hf convert --from {zlab-dflash,deepspec,speculators} SRC DST`: import a drafter trained elsewhere.

The result is this project's layout (docs/design.md §3), loadable with `AutoModel.from_pretrained(DST, trust_remote_code=True)`,
by speculators and by vLLM; `DST/conversion.json` records how layer ids, slot conventions, heads and vocabulary
were translated. Nothing is written when the source fails a check.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from .deepspec import read_deepspec
from .speculators import read_speculators
from .toolkit import DraftCheckpoint, write_checkpoint, write_output
from .zlab import read_zlab_dflash

READERS: dict[str, Callable[[str | Path], DraftCheckpoint]] = {
    "zlab-dflash": read_zlab_dflash,
    "deepspec": read_deepspec,
    "speculators": read_speculators,
}

DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def read_checkpoint(source: str | Path, source_format: str) -> DraftCheckpoint:
    if source_format not in READERS:
        raise ValueError(f"unknown source format {source_format!r}; use one of {', '.join(READERS)}.")
    return READERS[source_format](source)


def convert(source: str | Path, destination: str | Path, source_format: str, dtype: str = "auto", log=print) -> Path:
    """Read `source` in `source_format`, check it, and write it to `destination` in this project's layout; a
    `destination` that already holds this conversion is left as it is (`log` says so)."""
    destination = Path(destination)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if destination.exists() and any(destination.iterdir()) and not (destination / "config.json").is_file():
        raise FileExistsError(f"{destination} is not empty; choose a new output directory.")  # before any work
    checkpoint = read_checkpoint(source, source_format)
    written = write_output(destination, lambda folder: write_checkpoint(checkpoint, folder, dtype=DTYPES[dtype]), "conversion")
    log(f"convert: wrote {destination} (see conversion.json for the translated conventions)" if written
        else f"convert: {destination} already holds this conversion of {source}; nothing to do")
    return destination


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--from", dest="source_format", required=True, choices=sorted(READERS), help="source layout")
    parser.add_argument("source", help="source checkpoint directory")
    parser.add_argument("destination", help="output directory (new or empty)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="floating-point dtype (auto = keep)")


def run(args: argparse.Namespace) -> int:
    convert(args.source, args.destination, args.source_format, dtype=args.dtype)
    return 0


__all__ = ["READERS", "add_arguments", "convert", "read_checkpoint", "run"]
