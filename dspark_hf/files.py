"""Files written whole: under a temporary name beside the destination, synced, then renamed over it.

Every long stage resumes from what it finds on disk, so a file that a kill cut in half must never look complete: a
rename within one folder is atomic, and a kill leaves the old file or the new one, plus at most a hidden
`.NAME.*.tmp` that the next run ignores (the cache stage sweeps its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temporary path to write `path` through (by any writer: safetensors, a stream); renamed into place on success,
    removed on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(staging)
        with open(staging, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as staging:
        staging.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, payload: dict, sort_keys: bool = False) -> None:
    """`payload` as indented JSON with a final newline (values JSON cannot hold, such as paths, as strings)."""
    write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=sort_keys, default=str) + "\n").encode())


__all__ = ["atomic_path", "write_bytes_atomic", "write_json_atomic"]
