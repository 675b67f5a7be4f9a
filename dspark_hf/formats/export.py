"""`dspark-hf export --format speculators SRC DST`: a drafter ready for vLLM (`"method": "dspark"`) and speculators.

Our checkpoints already use that layout; export makes it self-contained and canonical: bf16 weights with `d2t`
int64 / `t2d` bool in one safetensors file, `speculators_config.verifier` filled in, a draft-vocabulary Markov input
table written out row by target token, and `embed_tokens`/`lm_head` written out (vLLM and the Kimi card expect them
in the file) — copied from the target with `--target` when the checkpoint binds them at attach time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..progress import add_progress_argument, progress as progress_bar
from ..targets import add_target_argument, load_target_heads
from .convert import DTYPES
from .speculators import read_speculators
from .toolkit import DraftCheckpoint, write_checkpoint, write_output

FORMATS = ("speculators",)


@torch.no_grad()
def bind_from_target(checkpoint: DraftCheckpoint, target) -> DraftCheckpoint:
    """Copy the target's embedding table and the draft-vocab rows of its LM head into the checkpoint."""
    config, text = checkpoint.config, target.config.get_text_config()
    if text.vocab_size != config.vocab_size or text.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"target vocab/hidden size {text.vocab_size}/{text.hidden_size} differ from the drafter's "
            f"{config.vocab_size}/{config.target_hidden_size}; pass the target this drafter was trained for."
        )
    d2t = checkpoint.tensors["d2t"]
    rows = torch.arange(d2t.numel()) + d2t
    checkpoint.tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu().clone()
    checkpoint.tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().cpu()[rows].clone()
    config.bind_target_embeddings = False
    config.verifier_name_or_path = config.verifier_name_or_path or target.config.name_or_path
    config.verifier_architectures = config.verifier_architectures or list(target.config.architectures or [])
    return checkpoint


@torch.no_grad()
def markov_table_over_target_vocab(checkpoint: DraftCheckpoint) -> DraftCheckpoint:
    """A draft-vocabulary Markov input table (`markov_input_vocab="draft"`) written out row by target token, the layout
    vLLM and speculators read: each draft token keeps its row, every other token gets the shared last row. Exact: the
    drafter drafts the same tokens from either table."""
    config, tensors = checkpoint.config, checkpoint.tensors
    name = "markov_head.markov_w1.weight"
    if config.markov_input_vocab == "target" or name not in tensors:
        return checkpoint
    table, t2d = tensors[name], tensors["t2d"].bool()
    full = table[-1].expand(config.vocab_size, -1).clone()
    full[t2d] = table[:-1]  # draft ids ascend with target ids, so the i-th member of t2d is draft id i
    tensors[name] = full
    config.markov_input_vocab = "target"
    return checkpoint


def export(
    source: str | Path,
    destination: str | Path,
    *,
    verifier: str | None = None,
    verifier_architectures: list[str] | None = None,
    target=None,
    dtype: str = "bfloat16",
    format: str = "speculators",
    progress: bool = True,
    log=print,
) -> Path:
    """Export `source` (this project's layout) to `destination`; `target` is a loaded model or a path to bind from.
    `progress`: a bar over its three steps (read, bind, write), else log lines. A `destination` that already holds
    this very export is left as it is, and `log` says so: rerunning a finished export is a no-op."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; use one of {', '.join(FORMATS)}.")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    destination = Path(destination)
    if destination.exists() and any(destination.iterdir()) and not (destination / "config.json").is_file():
        raise FileExistsError(f"{destination} is not empty; choose a new output directory.")  # before any work
    bar = progress_bar(total=3, desc="export", unit="step", enabled=progress)
    checkpoint = markov_table_over_target_vocab(read_speculators(source))
    bar.update()
    if target is not None:
        if isinstance(target, (str, Path)):  # a path, a Hub id, or `smollm2` (the offline target)
            target = load_target_heads(str(target))  # the two tensors from the safetensors shards, not the model
        bind_from_target(checkpoint, target)
    bar.update()
    if checkpoint.config.bind_target_embeddings:
        raise ValueError(
            "the checkpoint binds embed_tokens/lm_head from the target at attach time and does not contain them; "
            "pass --target PATH so export can write them (vLLM reads them from the drafter's file)."
        )
    if verifier:
        checkpoint.config.verifier_name_or_path = verifier
    if verifier_architectures:
        checkpoint.config.verifier_architectures = list(verifier_architectures)
    if not checkpoint.config.verifier_name_or_path:
        raise ValueError("speculators_config.verifier.name_or_path is unknown; pass --verifier NAME (the target's Hub id).")
    # The source is already in this layout: keep only the record of an earlier conversion into it, if any.
    record = Path(source) / "conversion.json"
    checkpoint.conversion = json.loads(record.read_text()) if record.is_file() else {}
    written = write_output(destination, lambda folder: write_checkpoint(checkpoint, folder, dtype=DTYPES[dtype]), "export")
    bar.update()
    bar.close()
    log(f"export: wrote {destination} (speculators/vLLM layout)" if written
        else f"export: {destination} already holds this export of {source}; nothing to do")
    return destination


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("source", help="drafter directory (this project's layout)")
    parser.add_argument("destination", help="output directory (new or empty)")
    parser.add_argument("--format", default="speculators", choices=FORMATS, help="output layout")
    parser.add_argument("--verifier", help="the target's Hub id, written to speculators_config.verifier.name_or_path")
    parser.add_argument("--verifier-architecture", action="append", dest="verifier_architectures",
                        help="target architecture class name (repeatable), e.g. Qwen3ForCausalLM")
    add_target_argument(parser)  # the model embed_tokens/lm_head are copied from
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="floating-point dtype (auto = keep)")
    add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    destination = export(
        args.source,
        args.destination,
        verifier=args.verifier,
        verifier_architectures=args.verifier_architectures,
        target=args.target,
        dtype=args.dtype,
        format=args.format,
        progress=not args.no_progress,
    )
    return 0


__all__ = ["FORMATS", "add_arguments", "bind_from_target", "export", "run"]
