"""The command line: split defaults that agree, and one clear line (never a traceback) for what users actually hit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from dspark_hf import cli
from dspark_hf.data import read_jsonl, split_of

REPO = Path(__file__).resolve().parents[1]


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
    with pytest.raises(SystemExit) as refused:
        cli.main(["regenerate", "--input", str(data), "--target", str(tiny_dir), "--output", str(tmp_path / "o.jsonl"),
                  "--limit", "0"])
    assert refused.value.code == 2 and "argument --limit: takes a whole number of 1 or more" in capsys.readouterr().err


def _env() -> dict:
    """This checkout first on the path, offline, no progress bars, no debug."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DSPARK_HF_DEBUG": ""}


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`dspark-hf ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "dspark_hf.cli", *args], env=_env(), capture_output=True, text=True)


def _one_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    err = result.stderr.strip()
    assert result.returncode != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert all(e in err for e in expected), err
    return err


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("prompts") / "prompts.jsonl",
                  [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say something about {i}."}]} for i in range(40)])


def test_a_target_neither_on_disk_nor_cached_is_one_line_and_debug_shows_the_traceback(prompts, tmp_path):
    args = ("regenerate", "--target", "no-such-org/no-such-model", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"))
    _one_line(_cli(*args), "dspark-hf regenerate: error: target no-such-org/no-such-model", "Hugging Face cache",
              "hf download no-such-org/no-such-model")
    debug = _cli(*args, "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "hf download" in debug.stderr


def test_bad_targets_and_outputs_are_one_line_in_process(tiny_dir, prompts, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(transformers.utils.logging, "_tqdm_active", False)  # no "Loading weights" bar

    def fails(*args: str) -> str:
        assert cli.main(list(args)) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    out = ("--output", str(tmp_path / "o.jsonl"))
    assert "target ./missing/target does not exist; pass a model directory" in fails(
        "regenerate", "--target", "./missing/target", "--input", str(prompts), *out)
    assert "is a directory without config.json" in fails("regenerate", "--target", str(tmp_path), "--input", str(prompts), *out)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    data = _write(tmp_path / "d.jsonl", _records_of_split("train", 1))
    assert "a file stands where a directory is needed; pass another --output" in fails(
        "cache", "--target", str(tiny_dir), "--dataset", str(data), "--output", str(blocker / "cache"), "--aux-layers", "1,2")
    assert "a file stands where a directory is needed; pass another --output-dir" in fails(
        "train", "--train-cache", str(tmp_path), "--output-dir", str(blocker))
    assert "target smolm2 does not exist; did you mean smollm2?" in fails(
        "regenerate", "--target", "smolm2", "--input", str(prompts), *out)
    monkeypatch.setenv("DSPARK_HF_DEBUG", "1")  # the environment variable shows the traceback too
    with pytest.raises(FileNotFoundError, match="missing/target does not exist"):
        cli.main(["regenerate", "--target", "./missing/target", "--input", str(prompts), *out])


def test_a_full_disk_is_one_line(tiny_dir, prompts):
    result = _cli("regenerate", "--target", str(tiny_dir), "--input", str(prompts), "--limit", "1", "--output", "/dev/full",
                  "--max-new-tokens", "2", "--no-progress")
    _one_line(result, "dspark-hf regenerate: error: No space left on device: /dev/full; free some disk space")


def test_ctrl_c_is_one_line_that_says_how_to_resume(tiny_dir, prompts, tmp_path):
    out = tmp_path / "o.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "dspark_hf.cli", "regenerate", "--target", str(tiny_dir), "--input",
                                str(prompts), "--output", str(out), "--max-new-tokens", "64", "--batch-size", "1",
                                "--no-progress"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.is_file() and out.read_bytes().count(b"\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    err = "\n".join(line for line in err.splitlines() if not line.startswith("regenerate: "))  # --no-progress lines
    assert process.returncode == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "dspark-hf regenerate: interrupted; rerun the same command to resume where it stopped" in err
    assert 1 <= len(read_jsonl(out)) < 40  # whole lines only


def test_eval_and_bench_take_the_target_the_drafter_records(tiny_dir, prompts, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from conftest import make_drafter

    target = AutoModelForCausalLM.from_pretrained(tiny_dir)
    drafter = make_drafter(target, aux_hidden_state_layer_ids=[0, 1, 2])
    drafter.config.verifier_name_or_path = str(tiny_dir)  # what `dspark-hf train --target DIR` records
    drafter.save_pretrained(tmp_path / "drafter")
    common = ["--model", str(tmp_path / "drafter"), "--prompts", str(prompts), "--split", "all", "--num-prompts", "1",
              "--max-new-tokens", "4", "--modes", "greedy", "--dtype", "float32"]
    assert cli.main(["eval", *common, "--json", str(tmp_path / "eval.json")]) == 0, capsys.readouterr().err
    assert cli.main(["bench", *common, "--methods", "plain", "assisted-lm", "dspark", "--repetitions", "1",
                     "--assistant-layers", "1", "--json", str(tmp_path / "bench.json")]) == 0, capsys.readouterr().err
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["assistant"].startswith(f"{tiny_dir} truncated to its first 1 of 2 layers")
    drafter.config.verifier_name_or_path = None
    drafter.save_pretrained(tmp_path / "anonymous")
    assert cli.main(["eval", "--model", str(tmp_path / "anonymous"), "--num-prompts", "1"]) == 1
    assert "does not record its target (no verifier_name_or_path in config.json); pass --target" in capsys.readouterr().err


def test_a_relative_target_directory_is_recorded_absolute(tiny_dir, tmp_path, monkeypatch):
    """`train --target ../model` records where the target is, so `eval`/`bench`/`calibrate` without --target find it
    from any directory; the `smollm2` alias keeps its Hub name."""
    from dspark_hf.targets import load_target, load_target_heads, load_target_model, resolve_target
    from dspark_hf.training.build import drafter_config_from_target

    monkeypatch.chdir(tiny_dir.parent)
    relative = tiny_dir.name
    heads = load_target_heads(relative)  # what `train --target` binds the drafter from
    assert heads.name_or_path == str(tiny_dir)
    assert load_target_model(relative).name_or_path == str(tiny_dir)
    assert load_target(f"./{relative}/")[0].name_or_path == str(tiny_dir)  # what online training and `cache` load
    config = drafter_config_from_target(heads, [1], mask_token_id=3)
    config.save_pretrained(tmp_path / "drafter")
    monkeypatch.chdir(tmp_path)
    recorded = resolve_target(None, tmp_path / "drafter")
    assert recorded == str(tiny_dir) and load_target_model(recorded).config.num_hidden_layers == 2
    assert load_target_heads("smollm2").name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"


# Every flag value of the wrong type, sign or range: one line naming the flag and what it takes, exit status 2,
# before anything is loaded or written (the output path below never appears).
WRONG_VALUES = [
    ("train", "--batch-size", "0"), ("train", "--learning-rate", "nan"), ("train", "--lora-dropout", "1"),
    ("train", "--seed", "-1"), ("train", "--aux-layers", "1,x"), ("regenerate", "--batch-size", "0"),
    ("regenerate", "--top-p", "2"), ("regenerate", "--temperature", "-1"), ("regenerate", "--max-new-tokens", "many"),
    ("cache", "--aux-layers", "a,b"), ("cache", "--shard-size", "0"), ("vocab", "--draft-vocab-size", "-5"),
    ("eval", "--batch-size", "0"), ("eval", "--confidence-threshold", "high"), ("bench", "--repetitions", "0"),
    ("calibrate", "--draws", "0"), ("profile", "--contexts", "0"),
]
REQUIRED = {
    "train": ["--train-cache", "c", "--output-dir", "{out}"], "regenerate": ["--target", "t", "--input", "d", "--output", "{out}"],
    "cache": ["--target", "t", "--dataset", "d", "--output", "{out}"], "vocab": ["--cache", "c", "--output", "{out}"],
    "eval": ["--model", "m", "--plots", "{out}"], "bench": ["--model", "m", "--plots", "{out}"],
    "calibrate": ["--model", "m", "--cache", "c", "--output-dir", "{out}"], "profile": ["--json", "{out}"],
}


@pytest.mark.parametrize("command, flag, value", WRONG_VALUES)
def test_a_flag_value_of_the_wrong_kind_is_one_line_before_any_work(command, flag, value, tmp_path, capsys):
    out = tmp_path / "out"
    args = [a.format(out=out) for a in REQUIRED[command]]
    with pytest.raises(SystemExit) as refused:
        cli.main([command, *args, flag, value])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"dspark-hf {command}: error: argument {flag}: takes ") and repr(value) in err, err
    assert not out.exists()


def test_a_usage_error_is_one_line_that_points_at_help(capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(["regenerate", "--target", "smollm2"])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1, err
    assert "the following arguments are required: --input/--dataset, --output" in err and "(see dspark-hf regenerate --help)" in err


def test_a_train_that_fails_before_its_first_step_leaves_no_output_directory(tmp_path, capsys):
    out = tmp_path / "runs" / "dspark"
    assert cli.main(["train", "--train-cache", str(tmp_path / "no-cache"), "--output-dir", str(out), "--report-to", "none"]) == 1
    assert "no-cache" in capsys.readouterr().err and not out.exists()


def test_a_target_folder_passed_as_the_drafter_says_so(tiny_dir, tmp_path, capsys):
    for command in (["calibrate", "--cache", str(tmp_path)], ["eval"], ["bench"]):
        assert cli.main([*command, "--model", str(tiny_dir)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"{tiny_dir} is a llama model, not a DSpark drafter; pass --model a drafter directory" in err, err
        assert "a target as --target" in err and "mask_token_id" not in err
