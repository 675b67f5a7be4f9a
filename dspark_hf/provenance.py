"""What wrote a regenerated file: its target and generation settings, recorded beside it as `FILE.settings.json`.

A corpus grows over many runs, often in different working sessions. A resumed run with other settings (another
temperature, another target) would mix two distributions in one file without a trace, so `regenerate` records its
settings on the first run and refuses a later run whose settings differ, in one line naming what differs. The
record is also what `dspark-hf corpus pack` carries into a packed corpus's manifest. How many conversations a file
holds is not a setting: a later run may ask for more (`--limit`) and extend the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .files import write_json_atomic

SETTINGS_SUFFIX = ".settings.json"


def settings_path(output: str | os.PathLike) -> Path:
    output = Path(output)
    return output.with_name(output.name + SETTINGS_SUFFIX)


def read_settings(output: str | os.PathLike) -> dict | None:
    """The settings `output` was written with, or None where no record lies beside it."""
    path = settings_path(output)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON; delete it and {Path(output).name} to regenerate that file") from None


def write_settings(output: str | os.PathLike, settings: dict) -> None:
    """The record, written whole (a temporary file renamed), so a kill never leaves half of one."""
    write_json_atomic(settings_path(output), settings, sort_keys=True)


def differences(recorded: dict, asked: dict, prefix: str = "") -> list[str]:
    """`key recorded -> asked` for every setting that differs (nested dicts by dotted key)."""
    found = []
    for key in sorted(set(recorded) | set(asked)):
        old, new = recorded.get(key), asked.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            found += differences(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append(f"{prefix}{key} {json.dumps(old)} -> {json.dumps(new)}")
    return found


def check_or_record_settings(output: str | os.PathLike, settings: dict) -> None:
    """Record `settings` beside a new (or unrecorded) `output`; refuse a run that would extend it with others."""
    recorded = read_settings(output)
    empty = not Path(output).is_file() or Path(output).stat().st_size == 0  # nothing written yet under the record
    if recorded is None or empty:
        write_settings(output, settings)
        return
    changed = differences(recorded, settings)
    if changed:
        raise ValueError(
            f"{output} was written with other settings ({'; '.join(changed[:4])}); rerun with the recorded ones "
            f"(see {settings_path(output).name}) or write to another --output"
        )
