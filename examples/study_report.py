"""The capacity study's table, JSON and learning curves, from the runs themselves (docs/results.md, "Capacity study").

    python examples/study_report.py STUDY_DIR OUT_PREFIX NAME [NAME ...]

Each NAME is a `dspark-hf train` output directory under STUDY_DIR, trained with `--eval-steps` (its log,
STUDY_DIR/NAME.log, holds the validation τ of every evaluation and `/usr/bin/time -v`'s wall clock and peak RSS) and
evaluated offline (STUDY_DIR/eval/NAME.json from `dspark-hf eval --cache ... --json`). This script adds what neither
records: the parameters the checkpoint stores (the bound embedding and LM head excluded) and the drafter's time per
block (bf16, one thread, 256 tokens of context: the context pass once, then a full block of drafts, median of 200).
Writes OUT_PREFIX.json and OUT_PREFIX.png (validation T = 1 τ against training steps and against target tokens read),
prints the Markdown table.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark_hf import DSparkContextCache
from dspark_hf.evaluation import load_drafter
from dspark_hf.hub import markdown_table
from dspark_hf.targets import load_target

BOUND = ("embed_tokens.weight", "lm_head.weight")


def validation_curve(log: str) -> list[tuple[int, float]]:
    return [(int(step), float(tau)) for step, tau in re.findall(r"step (\d+): eval tau=([0-9.]+)", log)]


def wall_seconds(log: str) -> float | None:
    match = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([0-9:.]+)", log)
    if not match:
        return None
    seconds = 0.0
    for part in match.group(1).split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def tokens_per_step(run: Path) -> float:
    """Target tokens one optimizer step reads: batch × the cache's mean sample length."""
    args = json.loads((run / "training_args.json").read_text())
    manifest = json.loads((Path(args["train_cache"]) / "manifest.json").read_text())
    return args["batch_size"] * manifest["num_tokens"] / manifest["num_samples"]


@torch.no_grad()
def draft_ms_per_block(drafter, context: int = 256, repetitions: int = 200) -> float:
    torch.manual_seed(0)
    aux = torch.randn(1, context, drafter.fc.in_features, dtype=drafter.fc.weight.dtype)
    cache = drafter.extend_context(DSparkContextCache(), aux)
    drafter.draft_block(cache, 42)  # warm-up
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        drafter.draft_block(cache, 42)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def study_row(study: Path, name: str, target) -> dict:
    run, log = study / name, (study / f"{name}.log").read_text()
    offline = json.loads((study / "eval" / f"{name}.json").read_text())["offline"]
    drafter = load_drafter(str(run / "drafter"), target, torch.bfloat16)
    config = drafter.config
    stored = sum(p.numel() for n, p in drafter.named_parameters() if n not in BOUND)
    curve = validation_curve(log)
    return {
        "layers": config.num_hidden_layers, "intermediate_size": config.intermediate_size, "block_size": config.block_size,
        "markov_rank": config.markov_rank, "markov_input_vocab": config.markov_input_vocab,
        "max_anchors": json.loads((run / "training_args.json").read_text())["max_anchors"],
        "parameters_M": round(stored / 1e6, 2), "steps": curve[-1][0] if curve else None,
        "tau_T1": round(offline["tau"], 3), "tau_greedy": round(offline["greedy"]["tau"], 3),
        "acceptance_T1": [round(a, 3) for a in offline["acceptance"]],
        "acceptance_greedy": [round(a, 3) for a in offline["greedy"]["acceptance"]],
        "draft_ms_per_block": round(draft_ms_per_block(drafter), 2),
        "train_wall_s": wall_seconds(log), "tokens_per_step": round(tokens_per_step(run), 1), "validation_curve": curve,
    }


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, row in rows.items():
        steps, taus = zip(*row["validation_curve"]) if row["validation_curve"] else ((), ())
        by_step.plot(steps, taus, marker="o", markersize=3, label=name)
        by_tokens.plot([s * row["tokens_per_step"] / 1e6 for s in steps], taus, marker="o", markersize=3, label=name)
    by_step.set_xlabel("training steps")
    by_tokens.set_xlabel("target tokens read (M)")
    by_step.set_ylabel("validation τ at T = 1 (of 8)")
    by_step.legend(fontsize=7)
    for axis in (by_step, by_tokens):
        axis.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct drafters: validation τ while training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(study: str, prefix: str, *names: str) -> None:
    torch.set_num_threads(1)
    target, _ = load_target("smollm2", dtype="bfloat16")
    rows = {name: study_row(Path(study), name, target) for name in names}
    Path(f"{prefix}.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, Path(f"{prefix}.png"))
    columns = ("layers", "intermediate_size", "markov_rank", "markov_input_vocab", "max_anchors", "parameters_M", "steps",
               "tau_greedy", "tau_T1", "draft_ms_per_block", "train_wall_s")
    print(markdown_table({name: {c: row[c] for c in columns} for name, row in rows.items()}, "row"))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
