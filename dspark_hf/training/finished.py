"""A finished training run is not run again: rerunning the command that made it does nothing.

Long pipelines (`make drafter`) are rerun to continue where they stopped; a stage that already finished must cost
nothing and change nothing. The run writes `finished.json` (the settings that shape the weights and the run's summary)
after its final drafter; a later `train` into that directory with the same settings returns that summary at once,
and one with other settings is refused in one line instead of overwriting the drafter (but `--resume` with more
`--max-steps` continues it, as before).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..files import write_json_atomic

FINISHED = "finished.json"
# Settings that do not change the weights a run ends with (how it is logged, checkpointed, time-boxed, resumed).
BOOKKEEPING = ("output_dir", "resume", "max_steps_per_run", "progress", "report_to", "logging_steps", "num_workers",
               "save_total_limit", "save_steps", "eval_steps")


def shaping_settings(args) -> dict:
    """The arguments that shape the final drafter, as JSON would write them."""
    settings = {k: v for k, v in asdict(args).items() if k not in BOOKKEEPING}
    return json.loads(json.dumps(settings, default=str))


def record_finished(args, summary: dict) -> None:
    write_json_atomic(Path(args.output_dir) / FINISHED, {"settings": shaping_settings(args), "summary": summary})


def finished_summary(args) -> dict | None:
    """The summary of a run that finished in `args.output_dir` with these settings; None where none did; one clear
    line where one did with other settings."""
    path = Path(args.output_dir) / FINISHED
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text())
    asked = shaping_settings(args)
    changed = [f"{key} {json.dumps(recorded['settings'].get(key))} -> {json.dumps(asked.get(key))}"
               for key in sorted(set(recorded["settings"]) | set(asked)) if recorded["settings"].get(key) != asked.get(key)]
    if args.resume and [c.split()[0] for c in changed] == ["max_steps"]:
        return None  # more steps asked of the finished run: `--resume` continues it from its last checkpoint
    if changed:
        raise ValueError(
            f"{args.output_dir} holds a finished run with other settings ({'; '.join(changed[:3])}); pass another "
            f"--output-dir (with --init-from {Path(args.output_dir) / 'drafter'} to continue from its weights)"
        )
    return recorded["summary"]
