"""Files written whole: a writer that fails leaves the old file as it was and no staging file behind."""

from __future__ import annotations

import json

import pytest

from dspark_hf.files import atomic_path, write_json_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"b": 1, "a": [2, 3]}, sort_keys=True)
    assert path.read_text() == json.dumps({"a": [2, 3], "b": 1}, indent=2) + "\n"
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_path(path) as staging:
            staging.write_text('{"half": ')
            raise RuntimeError("killed mid-write")
    assert json.loads(path.read_text()) == {"a": [2, 3], "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_new_file_appears_only_once_written_in_a_folder_made_for_it(tmp_path):
    path = tmp_path / "new" / "vocab.bin"
    with atomic_path(path) as staging:
        staging.write_bytes(b"x" * 10)
        assert not path.exists() and staging.parent == path.parent and staging.name.startswith(".vocab.bin.")
    assert path.read_bytes() == b"x" * 10 and [p.name for p in path.parent.iterdir()] == ["vocab.bin"]
