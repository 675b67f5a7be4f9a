"""A regenerated corpus outlives the run that wrote it: settings recorded beside each file, packed into gzips and a
manifest, unpacked, resumed and grown; corrupt, foreign or conflicting data refused in one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import make_tiny_target

from dspark_hf import cli
from dspark_hf.provenance import settings_path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me about {i}."}]}) + "\n"
                            for i in range(12)))
    return path


def _regenerate(target, prompts, output, limit, *extra) -> int:
    return cli.main(["regenerate", "--target", str(target), "--input", str(prompts), "--limit", str(limit),
                     "--max-new-tokens", "4", "--batch-size", "4", "--no-progress", "--output", str(output), *extra])


def _one_line(capsys, *expected) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(e in err for e in expected), err
    return err


@pytest.fixture
def regenerated(tiny_dir, prompts, tmp_path, capsys):
    """A data folder with two regenerated files (greedy and sampled) and their records."""
    data = tmp_path / "data"
    assert _regenerate(tiny_dir, prompts, data / "greedy.jsonl", 4) == 0
    assert _regenerate(tiny_dir, prompts, data / "sampled.jsonl", 3, "--temperature", "0.8", "--seed", "3") == 0
    capsys.readouterr()
    return data


def test_regenerate_records_its_settings_and_refuses_to_extend_a_file_with_others(regenerated, tiny_dir, prompts, capsys):
    record = json.loads(settings_path(regenerated / "sampled.jsonl").read_text())
    assert record["temperature"] == 0.8 and record["seed"] == 3 and record["max_new_tokens"] == 4
    assert record["target"]["name"] == str(tiny_dir) and len(record["target"]["config_sha256"]) == 64
    assert "limit" not in record  # growing a file is not a change of settings
    assert _regenerate(tiny_dir, prompts, regenerated / "sampled.jsonl", 6, "--temperature", "0.8", "--seed", "3") == 0
    assert len((regenerated / "sampled.jsonl").read_text().splitlines()) == 6
    capsys.readouterr()
    assert _regenerate(tiny_dir, prompts, regenerated / "sampled.jsonl", 8, "--seed", "3") == 1
    _one_line(capsys, "sampled.jsonl was written with other settings", "temperature 0.8 -> 0.0", "another --output")
    assert len((regenerated / "sampled.jsonl").read_text().splitlines()) == 6


def test_a_packed_corpus_unpacks_to_the_same_files_and_regenerate_grows_them(regenerated, tiny_dir, prompts, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    assert cli.main(["corpus", "pack", "--data", str(regenerated), "--output", str(corpus), "--target", str(tiny_dir)]) == 0
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["greedy.jsonl", "sampled.jsonl"]
    assert manifest["files"]["greedy.jsonl"]["conversations"] == 4 and manifest["total"]["conversations"] == 7
    assert manifest["files"]["greedy.jsonl"]["assistant_tokens"] > 0 and manifest["files"]["greedy.jsonl"]["user_turns"] == 4
    assert manifest["files"]["sampled.jsonl"]["settings"]["temperature"] == 0.8
    packed = {p.name: p.read_bytes() for p in corpus.iterdir()}
    assert cli.main(["corpus", "pack", "--data", str(regenerated), "--output", str(corpus), "--target", str(tiny_dir)]) == 0
    assert {p.name: p.read_bytes() for p in corpus.iterdir()} == packed  # deterministic: git stores it once

    fresh = tmp_path / "fresh"
    assert cli.main(["corpus", "unpack", "--corpus", str(corpus), "--output", str(fresh), "--target", str(tiny_dir)]) == 0
    for name in ("greedy.jsonl", "sampled.jsonl"):
        assert (fresh / name).read_bytes() == (regenerated / name).read_bytes()
        assert json.loads(settings_path(fresh / name).read_text()) == json.loads(settings_path(regenerated / name).read_text())
    # a later session grows the unpacked file: the packed conversations stay, new ones follow, a rerun unpack keeps them
    assert _regenerate(tiny_dir, prompts, fresh / "greedy.jsonl", 7) == 0
    grown = (fresh / "greedy.jsonl").read_bytes()
    assert grown.startswith((regenerated / "greedy.jsonl").read_bytes()) and grown.count(b"\n") == 7
    assert cli.main(["corpus", "unpack", "--corpus", str(corpus), "--output", str(fresh)]) == 0
    assert (fresh / "greedy.jsonl").read_bytes() == grown
    # a file cut short (a deleted tail) is restored from the corpus
    (fresh / "sampled.jsonl").write_bytes(b"".join((regenerated / "sampled.jsonl").read_bytes().splitlines(True)[:1]))
    assert cli.main(["corpus", "unpack", "--corpus", str(corpus), "--output", str(fresh)]) == 0
    assert (fresh / "sampled.jsonl").read_bytes() == (regenerated / "sampled.jsonl").read_bytes()


def test_corrupt_foreign_or_conflicting_data_is_refused_in_one_line(regenerated, tiny_dir, smollm2_tokenizer, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    assert cli.main(["corpus", "pack", "--data", str(regenerated), "--output", str(corpus), "--target", str(tiny_dir)]) == 0
    capsys.readouterr()

    other = tmp_path / "other-target"  # another model: its config differs
    make_tiny_target("llama", vocab_size=len(smollm2_tokenizer), layers=3).save_pretrained(other)
    smollm2_tokenizer.save_pretrained(other)
    capsys.readouterr()
    assert cli.main(["corpus", "check", "--corpus", str(corpus), "--target", str(other)]) == 1
    _one_line(capsys, "was written by another target than --target", "install the recorded target")
    assert cli.main(["corpus", "pack", "--data", str(regenerated), "--output", str(tmp_path / "c2"), "--target", str(other)]) == 1
    _one_line(capsys, "greedy.jsonl was written by another target")

    conflicting = tmp_path / "conflicting"  # a local file that is neither a prefix nor an extension of the packed one
    conflicting.mkdir()
    lines = (regenerated / "greedy.jsonl").read_text().splitlines(True)
    (conflicting / "greedy.jsonl").write_text(lines[1] + lines[0])
    assert cli.main(["corpus", "unpack", "--corpus", str(corpus), "--output", str(conflicting)]) == 1
    _one_line(capsys, "greedy.jsonl differs from the packed greedy.jsonl", "delete it")

    data = gzip.decompress((corpus / "sampled.jsonl.gz").read_bytes())  # one byte changed, recompressed: hashes catch it
    (corpus / "sampled.jsonl.gz").write_bytes(gzip.compress(data.replace(b"p", b"q", 1)))
    for command in (["corpus", "check", "--corpus", str(corpus)], ["corpus", "unpack", "--corpus", str(corpus), "--output", str(tmp_path / "x")]):
        assert cli.main(command) == 1
        _one_line(capsys, "sampled.jsonl.gz is corrupt", "git checkout --")
    assert not (tmp_path / "x" / "sampled.jsonl").exists()

    (corpus / "manifest.json").unlink()
    assert cli.main(["corpus", "check", "--corpus", str(corpus)]) == 1
    _one_line(capsys, "is not a packed corpus (no manifest.json)")
    assert cli.main(["corpus", "pack", "--data", str(tmp_path / "conflicting"), "--output", str(corpus), "--target", str(tiny_dir)]) == 1
    _one_line(capsys, "holds no regenerated file")


def test_the_corpus_in_git_is_whole_and_was_written_by_the_smollm2_target_installed_here(capsys):
    """`make drafter` reuses the committed corpus instead of hours of regeneration: every gzip matches its manifest,
    the manifest names this SmolLM2 (release and weights hash), and each domain's settings are the recipe's."""
    corpus = Path(__file__).resolve().parents[1] / "examples" / "smollm2-corpus"
    assert cli.main(["corpus", "check", "--corpus", str(corpus), "--target", "smollm2"]) == 0, capsys.readouterr().err
    manifest = json.loads((corpus / "manifest.json").read_text())
    sampled = {name for name, entry in manifest["files"].items() if entry["settings"]["temperature"] > 0}
    assert sampled == {"chatterbot-train.jsonl", "wordnet-verbs-train.jsonl", "stdlib-write-train.jsonl",
                       "chitchat-long-train.jsonl"}
    assert {e["settings"]["dtype"] for e in manifest["files"].values()} == {"bfloat16"}
    assert manifest["total"]["conversations"] >= 3000 and manifest["total"]["assistant_tokens"] >= 300_000
