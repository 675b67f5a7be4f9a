"""Pick the drafter size `make drafter` trains, from what its sizing stage measured (examples/make_drafter.sh, 4/8).

    python examples/pick_size.py WORK NAME [NAME ...]   # MAX_MB (default 25): the shipped drafter's size limit

Reads WORK/size-NAME/bench.json (`dspark-hf bench` of each candidate, fixed-length blocks against plain generate, per
domain and mode, validation prompts) and WORK/size-NAME/drafter (its weights), writes WORK/sizing.json with every
number behind the choice, prints the table on stderr and the chosen NAME on stdout. The choice is the highest
geometric mean of the speed-ups over every (domain, mode) among the candidates within MAX_MB in bf16: a drafter that
wins one domain by losing another is not the default.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from safetensors import safe_open

from dspark_hf.hub import markdown_table

BOUND = ("embed_tokens", "lm_head")  # copied from the target at load, not shipped
MAX_MB = float(os.environ.get("MAX_MB", 25))


def shipped_parameters(drafter: Path) -> int:
    """Parameters the shipped checkpoint stores (the bound embedding and LM head excluded)."""
    total = 0
    with safe_open(drafter / "model.safetensors", "pt") as weights:
        for name in weights.keys():
            if not any(part in name for part in BOUND) and weights.get_slice(name).get_dtype() in ("F32", "BF16", "F16"):
                total += math.prod(weights.get_slice(name).get_shape())
    return total


def training_conversations(training: dict) -> int | None:
    """How many conversations the candidates' training cache holds (the sizing may run on an earlier snapshot)."""
    manifest = Path(training.get("train_cache") or "") / "manifest.json"
    return json.loads(manifest.read_text())["num_samples"] if manifest.is_file() else None


def candidate_row(work: Path, name: str) -> dict:
    """Speed-up, accepted length and draft cost of one candidate, per (domain, mode), and their geometric mean."""
    bench = json.loads((work / f"size-{name}" / "bench.json").read_text())
    speedups, row = [], {}
    for domain, result in bench["domains"].items():
        for mode, methods in result["modes"].items():
            drafted = methods["dspark-fixed"]
            speedup, tau = drafted["speedup_vs_plain"], drafted["mean_accepted_length"]
            speedups.append(speedup)
            row[f"{Path(domain).name} {mode}"] = f"{speedup:.2f}× (τ {tau:.2f})"
    row["geo-mean × plain"] = round(math.exp(sum(map(math.log, speedups)) / len(speedups)), 3)
    overhead = bench.get("dspark_overhead")  # absent from benches written before it was measured for fixed blocks
    if overhead:
        row["draft ms / verify ms"] = f"{overhead['draft_round_ms']:.1f} / {overhead['verify_pass_ms']:.1f}"
    row["MB (bf16)"] = round(2 * shipped_parameters(work / f"size-{name}" / "drafter") / 1e6, 1)
    return row


def main(work: Path, names: list[str]) -> str:
    rows = {name: candidate_row(work, name) for name in names}
    eligible = [name for name in names if rows[name]["MB (bf16)"] <= MAX_MB]
    if not eligible:
        raise SystemExit(f"pick_size: every candidate is over MAX_MB={MAX_MB}; add a smaller one")
    chosen = max(eligible, key=lambda name: rows[name]["geo-mean × plain"])
    bench = json.loads((work / f"size-{names[0]}" / "bench.json").read_text())
    training = json.loads((work / f"size-{names[0]}" / "training_args.json").read_text())
    report = {"chosen": chosen, "candidates": rows, "max_mb": MAX_MB, "steps": training.get("max_steps"),
              "training_conversations": training_conversations(training), "machine": bench["machine"],
              "dtype": bench["dtype"], "max_new_tokens": bench["max_new_tokens"], "split": bench["split"]}
    (work / "sizing.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(markdown_table(rows, "candidate"), file=sys.stderr)
    print(f"chosen: {chosen}", file=sys.stderr)
    return chosen


if __name__ == "__main__":
    print(main(Path(sys.argv[1]), sys.argv[2:]))
