"""The README's "Training your own drafter" runs as written on a target that is not SmolLM2.

The bash block is read out of README.md, so the README cannot drift from what is tested: the same commands with the
same flags, only `TARGET`/`PROMPTS` pointed at a tiny Qwen2-style chat model with its own template (built here) and
the size flags shrunk. Each command runs as `python -m dspark_hf.cli` in a fresh process, from regenerate to export;
the section's Python snippet then generates with the trained drafter, token-identical to plain greedy (fp32).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from safetensors import safe_open

from dspark_hf.calibration import calibrate
from dspark_hf.data import split_of

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Training your own drafter"
STAGES = ["regenerate", "regenerate", "cache", "cache", "vocab", "train", "calibrate", "eval", "bench", "export"]
# The size flags the README shows, shrunk to what a test can afford; every one must appear in the walk.
SMALL = {"--limit": "6", "--max-new-tokens": "6", "--draft-vocab-size": "512", "--max-steps": "3",
         "--num-prompts": "1", "--repetitions": "1"}
# A Qwen-style ChatML template of this target's own (default system turn), unlike SmolLM2's.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Tiny-Qwen, a test model.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def readme_section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    return readme[start:end if end > 0 else None]


def readme_walk(section: str) -> tuple[dict[str, str], list[list[str]]]:
    """(variables assigned, commands as argv) of the section's bash block; continuations joined, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    variables, commands = {}, []
    for line in block.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if assignment := re.fullmatch(r"([A-Z_]+)=(\S+)", line):
            variables[assignment[1]] = assignment[2]
        else:
            commands.append(shlex.split(line))
    return variables, commands


def shrink(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with $VARIABLES replaced by `values` and size flags set to SMALL."""
    out = [values[a[1:]] if a.startswith("$") else a for a in argv]
    return [SMALL.get(out[i - 1], a) if i else a for i, a in enumerate(out)]


@pytest.fixture(scope="module")
def own_target(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Qwen2 chat model saved as a normal model directory: a real tokenizer, its own chat template."""
    path = tmp_path_factory.mktemp("tiny-qwen")
    smollm2_tokenizer.save_pretrained(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    make_tiny_target("qwen2", vocab_size=len(tokenizer), layers=8).save_pretrained(path)
    return path


def write_prompts(path: Path) -> Path:
    """User-only conversations, enough of each hash split (train 6, validation 3, test 2)."""
    wanted, records = {"train": 6, "validation": 3, "test": 2}, []
    topics = ["the sea", "tea", "trains", "clouds", "bread", "rivers", "owls", "maps", "snow", "bees", "lamps"]
    for i in range(20_000):
        split = split_of(f"chat-{i}")
        if wanted[split] > 0:
            wanted[split] -= 1
            topic = topics[len(records) % len(topics)]
            records.append({"id": f"chat-{i}", "messages": [{"role": "user", "content": f"Tell me about {topic}."}]})
        if not any(wanted.values()):
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DSPARK_HF_DEBUG": "1", "OMP_NUM_THREADS": "1"}


def test_the_section_shows_every_stage_for_the_users_own_target():
    variables, commands = readme_walk(readme_section())
    assert set(variables) == {"TARGET", "PROMPTS"}
    assert [argv[:2] for argv in commands] == [["dspark-hf", stage] for stage in STAGES]
    flags = {a for argv in commands for a in argv}
    assert set(SMALL) <= flags, f"size flags the test shrinks are missing from the README: {set(SMALL) - flags}"
    for argv in commands:
        assert "smollm2" not in " ".join(argv).lower() and "--mask-token-id" not in argv and "--aux-layers" not in argv
        if argv[1] in ("eval", "bench", "calibrate"):
            assert "--target" not in argv  # the drafter records its target
    outputs = [argv[argv.index("--output") + 1] for argv in commands if argv[1] == "cache"]
    assert outputs == ["cache/train", "cache/validation"]  # the validation cache train/calibrate/eval use is built


@pytest.mark.slow
def test_the_readme_walk_trains_a_lossless_drafter_for_a_qwen2_target(own_target, tmp_path):
    section = readme_section()
    _, commands = readme_walk(section)
    values = {"TARGET": str(own_target), "PROMPTS": str(write_prompts(tmp_path / "prompts.jsonl"))}
    for argv in commands:
        argv = shrink(argv, values)
        result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", *argv[1:]], cwd=tmp_path, env=_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{shlex.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    with safe_open(tmp_path / "runs/calibrated/model.safetensors", "pt") as trained, \
            safe_open(tmp_path / "exported/model.safetensors", "pt") as exported:
        assert not {"embed_tokens.weight", "lm_head.weight"} & set(trained.keys())  # bound from the target
        assert {"embed_tokens.weight", "lm_head.weight"} <= set(exported.keys())  # written in for vLLM
    # calibrate without --target (as written) binds the embedding and head of the target the drafter records
    explicit = calibrate(str(tmp_path / "runs/dspark/drafter"), str(tmp_path / "cache/validation"),
                         str(tmp_path / "explicit"), target=str(own_target), log=lambda *_: None)
    written = json.loads((tmp_path / "runs/calibrated/config.json").read_text())["confidence_temperatures"]
    assert written == pytest.approx(explicit["temperatures"])
    evaluation = json.loads((tmp_path / "runs/eval.json").read_text())
    assert evaluation["online"] and evaluation["offline"]["tau"] >= 1
    bench = json.loads((tmp_path / "runs/bench.json").read_text())
    assert bench["assistant"].startswith(f"{own_target} truncated")  # the recorded target, not SmolLM2

    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for placeholder, value in (("path/to/your-model", own_target), ("runs/calibrated", tmp_path / "runs/calibrated")):
        snippet = snippet.replace(placeholder, str(value))
    scope: dict = {}
    exec(snippet, scope)
    target, tokenizer, drafter, inputs, out = (scope[k] for k in ("target", "tokenizer", "drafter", "inputs", "out"))
    assert target.dtype == drafter.dtype == torch.float32 and "Tiny-Qwen" in tokenizer.decode(inputs["input_ids"][0])
    assert torch.equal(out, target.generate(**inputs, max_new_tokens=64, do_sample=False))
    for record in map(json.loads, Path(values["PROMPTS"]).read_text().splitlines()):
        if split_of(record["id"]) == "test":
            prompt = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)
            plain = target.generate(**prompt, max_new_tokens=32, do_sample=False)
            assert torch.equal(target.generate(**prompt, assistant_model=drafter, max_new_tokens=32, do_sample=False), plain)
            assert drafter.last_generation_stats.mean_accepted_length >= 1  # the drafter did draft
