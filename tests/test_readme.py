"""The README's usage example runs as written and is lossless (fp32 target, shipped drafter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_readme_usage_example_runs_and_matches_plain_generate(tmp_path):
    readme = (REPO_ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    check = (
        "\nreference = target.generate(**inputs, max_new_tokens=64)\n"
        "assert (reference == out).all(), 'the drafter changed the output'\n"
        "assert 'Paris' in tokenizer.decode(out[0])\n"
    )
    script = tmp_path / "example.py"
    script.write_text(example + check)
    subprocess.run([sys.executable, str(script)], check=True, cwd=REPO_ROOT, capture_output=True, timeout=300)
