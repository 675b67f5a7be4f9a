"""The shipped drafter's climb, cycle by cycle: one record in git and its plot.

Written for docs/results.md, "The climb in one record".

A cycle's logs and checkpoints stay under build/ and are gone when a later session starts; the record keeps what the
next session needs to see where the drafter stands and how fast it climbed: each cycle's settings, the trainer's
validation τ against steps, and the offline τ of the drafter it shipped.

    python examples/cycles_report.py RECORD.json                                       # redraw RECORD.png
    python examples/cycles_report.py RECORD.json NAME RUN_DIR EVAL_JSON LOG [LOG ...]  # add (or replace) a cycle

RUN_DIR is the cycle's `dspark-hf train --output-dir` (its training_args.json), EVAL_JSON the shipped drafter's
`dspark-hf eval --cache ... --json`, and each LOG a log of the run (a resumed run has several; a later log's
validation at a step wins). Only cycles whose drafter was shipped belong in the record: it is the shipped drafter's
lineage.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from study_report import validation_curve

SETTINGS = ("max_steps", "learning_rate", "warmup_steps", "max_anchors", "batch_size", "seed", "mixed_precision")


def merged_curve(logs: list[str]) -> list[list[float]]:
    taus = {}
    for log in logs:
        taus.update(validation_curve(Path(log).read_text()))
    return [[step, taus[step]] for step in sorted(taus)]


def offline_taus(eval_json: str) -> dict:
    offline = json.loads(Path(eval_json).read_text())["offline"]
    return {"tau_T1": round(offline["tau"], 3), "tau_greedy": round(offline["greedy"]["tau"], 3),
            "acceptance_T1": [round(a, 3) for a in offline["acceptance"]]}


def cycle_entry(name: str, run_dir: str, eval_json: str, logs: list[str]) -> dict:
    args = json.loads((Path(run_dir) / "training_args.json").read_text())
    return {"name": name, **{key: args[key] for key in SETTINGS}, "init_from": args.get("init_from"),
            "validation_curve": merged_curve(logs), "offline": offline_taus(eval_json)}


def add_cycle(record: dict, entry: dict) -> None:
    names = [cycle["name"] for cycle in record["cycles"]]
    if entry["name"] in names:
        record["cycles"][names.index(entry["name"])] = entry
    else:
        record["cycles"].append(entry)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(9, 4))
    start = 0
    for cycle in record["cycles"]:
        if cycle["validation_curve"]:
            steps, taus = zip(*cycle["validation_curve"])
            axis.plot([start + s for s in steps], taus, marker="o", markersize=3, label=f"{cycle['name']} (validation)")
        if cycle.get("offline"):
            end = start + cycle["max_steps"]
            axis.plot([end], [cycle["offline"]["tau_T1"]], "k*", markersize=9)
            axis.annotate(f"{cycle['offline']['tau_T1']:.3f}", (end, cycle["offline"]["tau_T1"]), fontsize=7,
                          textcoords="offset points", xytext=(-12, 7))
        start += cycle["max_steps"]
    axis.plot([], [], "k*", label="offline T = 1 τ of the shipped drafter (calibrated, bf16)")
    axis.set_xlabel("training steps, all cycles")
    axis.set_ylabel("τ at T = 1 (of 8)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="lower right")
    fig.suptitle(record["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(record_path: str, name: str | None = None, run_dir: str | None = None, eval_json: str | None = None,
         *logs: str) -> None:
    path = Path(record_path)
    record = json.loads(path.read_text())
    if name is not None:
        if not (run_dir and eval_json and logs):
            sys.exit(__doc__)
        add_cycle(record, cycle_entry(name, run_dir, eval_json, list(logs)))
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    plot(record, path.with_suffix(".png"))
    total = sum(cycle["max_steps"] for cycle in record["cycles"])
    last = record["cycles"][-1]["offline"]
    print(f"{len(record['cycles'])} cycles, {total:,} steps; "
          f"offline τ T = 1 {last['tau_T1']}, greedy {last['tau_greedy']}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:])
