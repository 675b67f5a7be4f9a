"""The command line: split defaults that agree, and one clear line (never a traceback) for what users actually hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_tiny_target

from dspark_hf import cli
from dspark_hf.data import read_jsonl, split_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random chat target saved as a normal model directory (SmolLM2's tokenizer and template)."""
    path = tmp_path_factory.mktemp("tiny-target")
    make_tiny_target("llama", vocab_size=len(smollm2_tokenizer), layers=2).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


def _records_of_split(split: str, n: int) -> list[dict]:
    ids = (f"conv-{i}" for i in range(10_000))
    chosen = [i for i in ids if split_of(i) == split][:n]
    return [{"id": i, "messages": [{"role": "user", "content": f"Hello {i}?"}, {"role": "assistant", "content": "Hi."}]}
            for i in chosen]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_cache_takes_a_regenerated_validation_file_whole_by_default(tiny_dir, tmp_path, capsys):
    data = _write(tmp_path / "validation.jsonl", _records_of_split("validation", 3))
    rc = cli.main(["cache", "--target", str(tiny_dir), "--dataset", str(data), "--output", str(tmp_path / "cache"),
                   "--aux-layers", "1,2", "--dtype", "float32"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["num_samples"] == 3


def test_an_empty_split_names_the_split_and_the_flags(tiny_dir, tmp_path, capsys):
    data = _write(tmp_path / "train.jsonl", _records_of_split("train", 3))
    for command in (["regenerate", "--input", str(data)], ["cache", "--dataset", str(data)]):
        rc = cli.main([*command, "--target", str(tiny_dir), "--output", str(tmp_path / "out"), "--split", "validation"])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and len(err.splitlines()) == 1
        assert f"the 'validation' split of {data} is empty" in err and "--split all" in err
    rc = cli.main(["regenerate", "--input", str(data), "--target", str(tiny_dir), "--output", str(tmp_path / "o.jsonl"), "--limit", "0"])
    assert rc == 1 and "--limit 0 selects no conversations" in capsys.readouterr().err
