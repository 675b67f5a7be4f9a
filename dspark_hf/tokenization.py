"""Conversations in, token ids and an assistant loss mask out, in time linear in the corpus and cached on disk.

A drafter learns to predict what the target *writes*, so every stage that reads chat data (the hidden-state cache,
online training, the draft vocabulary) needs one exact answer to "which tokens did the assistant produce?". The
definition comes from the target's own chat template: assistant turn i spans from the end of
`render(messages[:i], add_generation_prompt=True)` to the end-of-turn token after its reply in
`render(messages[:i+1])` (`exact_assistant_spans`). Rendering every prefix is quadratic in turns, so the corpus path
(`tokenize_conversations`) renders each conversation once and walks it with the template's generation prompt
(`TemplateLayout`), checks the last turn against the definition, and falls back to the definition for any
conversation the walk cannot place. Conversations are tokenized in batches over forked processes and the result is
kept under `cache_home()/tokenized`, keyed by the conversations, the tokenizer and `max_length`, as memory-mapped
Arrow (HF `datasets`): a second command over the same data starts at once.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .assets import cache_home
from .data import Conversation, check_dataset
from .progress import progress as progress_bar

# Special tokens that close a turn in common templates; the one the target emits counts as assistant.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>", "<|end_of_text|>")
# Bump when the tokenized output of the same inputs could change, so stale caches are never read.
TOKENIZED_FORMAT = "dspark-tokenized/1"
# Below this many conversations one process is faster than starting workers.
CONVERSATIONS_PER_PROCESS = 1000
BATCH_SIZE = 256  # conversations rendered and tokenized per call (one job of a worker)

Sample = dict  # {"input_ids": int64 [T], "loss_mask": uint8 [T]}


# --------------------------------------------------------------------------------------- chat template, loss mask
def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name} has no chat template, so assistant tokens cannot be found; use an instruct/chat "
            "tokenizer or set tokenizer.chat_template"
        )


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def end_of_turn_strings(tokenizer) -> list[str]:
    vocab = tokenizer.get_vocab()
    names = [t for t in (tokenizer.eos_token, *END_OF_TURN_TOKENS) if t and t in vocab]
    return list(dict.fromkeys(names))


def _first_marker(text: str, markers: list[str], start: int, stop: int) -> tuple[int, int] | None:
    """(position, length) of the earliest end-of-turn marker that lies whole in text[start:stop], if any."""
    hits = [(text.find(m, start, stop), len(m)) for m in markers]
    hits = [hit for hit in hits if hit[0] != -1]
    return min(hits) if hits else None


def _reply_end(text: str, content: str, start: int, stop: int) -> int | None:
    """Where the reply ends: after its content, found at or after `start`; None when the template changed it."""
    if not content:
        return start
    found = text.find(content, start, stop)
    return None if found == -1 else found + len(content)


RE_RENDER_ERROR = (
    "the chat template re-renders earlier turns differently as the conversation grows (e.g. it drops reasoning from "
    "past turns), so assistant tokens cannot be located by prefix; split such conversations into one record per "
    "assistant turn"
)


def exact_assistant_span(tokenizer, messages: list[dict], i: int, text: str, markers: list[str]) -> tuple[int, int]:
    """The definition for assistant turn i: the reply and whatever the template appends to it, cut right after the
    end-of-turn token (which the target emits, so it counts as assistant; a newline the template adds does not)."""
    before = _render(tokenizer, messages[:i], add_generation_prompt=True)
    through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
    if not (through.startswith(before) and text.startswith(through)):
        raise ValueError(RE_RENDER_ERROR)
    start, end = len(before), len(through)
    reply_end = _reply_end(through, messages[i]["content"], start, end)
    marker = _first_marker(through, markers, start if reply_end is None else reply_end, end)
    if marker is not None:
        end = marker[0] + marker[1]
    return start, end


def exact_assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end) character span of each assistant turn]) by the definition (quadratic)."""
    check_chat_template(tokenizer)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    markers = end_of_turn_strings(tokenizer)
    return text, [exact_assistant_span(tokenizer, messages, i, text, markers)
                  for i, m in enumerate(messages) if m["role"] == "assistant"]


@dataclass(frozen=True)
class TemplateLayout:
    """What one tokenizer's template appends to open an assistant turn, learned once, so each conversation is
    rendered once: in a prefix-stable template, assistant turn i starts right after the generation prompt that
    follows turn i-1."""

    generation_prompt: str
    end_markers: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer) -> "TemplateLayout | None":
        """None when the template does not append its generation prompt to the conversation (walk impossible)."""
        probe = [{"role": "user", "content": "Which tokens are the assistant's?"}]
        plain = _render(tokenizer, probe, add_generation_prompt=False)
        prompted = _render(tokenizer, probe, add_generation_prompt=True)
        if len(prompted) <= len(plain) or not prompted.startswith(plain):
            return None
        return cls(prompted[len(plain):], tuple(end_of_turn_strings(tokenizer)))

    def walk(self, text: str, messages: list[dict]) -> list[tuple[int, int]] | None:
        """Assistant spans by one left-to-right pass over the rendered text; None where the text does not read as
        the messages in order behind this layout (the caller then applies the definition)."""
        contents = [m["content"] for m in messages]
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                cursor = _reply_end(text, contents[i], cursor, len(text))
                if cursor is None:
                    return None
                continue
            opened = text.find(self.generation_prompt, cursor)
            if opened == -1:
                return None
            start = opened + len(self.generation_prompt)
            reply_end = _reply_end(text, contents[i], start, len(text))
            if reply_end is None:
                return None
            next_content = self._next_content_position(text, contents[i + 1:], reply_end)
            marker = _first_marker(text, list(self.end_markers), reply_end, next_content)
            if marker is None:
                return None
            spans.append((start, marker[0] + marker[1]))
            cursor = reply_end
        return spans

    @staticmethod
    def _next_content_position(text: str, later: list[str], start: int) -> int:
        """Where the next non-empty message shows up: this turn's end-of-turn marker must come before it."""
        for content in later:
            if content:
                found = text.find(content, start)
                return len(text) if found == -1 else found
        return len(text)


def assistant_char_spans(tokenizer, messages: list[dict], layout: TemplateLayout | None = None,
                         markers: list[str] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation once and return (text, assistant spans): by the walk, checked on the last assistant
    turn against the definition, else by the definition (which refuses templates that re-render earlier turns)."""
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = layout.walk(text, messages) if layout is not None else None
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    markers = markers if markers is not None else end_of_turn_strings(tokenizer)
    if spans is not None and assistant_turns:
        if exact_assistant_span(tokenizer, messages, assistant_turns[-1], text, markers) == spans[-1]:
            return text, spans
    return text, [exact_assistant_span(tokenizer, messages, i, text, markers) for i in assistant_turns]


def loss_mask_of(starts: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [T]: 1 exactly on the tokens that start inside an assistant span."""
    mask = np.zeros(len(starts), dtype=np.uint8)
    for start, end in spans:
        mask |= ((starts >= start) & (starts < end)).astype(np.uint8)
    return mask


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None) -> Sample:
    """Chat-template tokens and the assistant loss mask of one conversation, by the definition.

    Returns `input_ids` int64 [T] (identical to `apply_chat_template(messages, tokenize=True)`) and `loss_mask`
    uint8 [T], 1 exactly on tokens that start inside an assistant span (reply + end-of-turn token).
    """
    text, spans = exact_assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([s for s, _ in encoding["offset_mapping"]], dtype=np.int64)
    sample = {"input_ids": torch.tensor(encoding["input_ids"], dtype=torch.int64),
              "loss_mask": torch.from_numpy(loss_mask_of(starts, spans))}
    return {key: value[:max_length] for key, value in sample.items()} if max_length is not None else sample


@dataclass(frozen=True)
class BatchTokenizer:
    """What tokenizing a batch needs from the tokenizer, worked out once per process (the layout probe and the
    vocabulary scan for end-of-turn tokens cost tens of milliseconds each)."""

    tokenizer: Any
    layout: TemplateLayout | None
    markers: list[str]
    max_length: int | None

    @classmethod
    def of(cls, tokenizer, max_length: int | None) -> "BatchTokenizer":
        return cls(tokenizer, TemplateLayout.of(tokenizer), end_of_turn_strings(tokenizer), max_length)

    def __call__(self, conversations: list[list[dict]]) -> dict:
        """A batch of conversations rendered once each, tokenized in one call."""
        rendered = [assistant_char_spans(self.tokenizer, messages, self.layout, self.markers) for messages in conversations]
        encodings = self.tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        ids, masks = [], []
        for (_, spans), input_ids, offsets in zip(rendered, encodings["input_ids"], encodings["offset_mapping"]):
            starts = np.array([s for s, _ in offsets], dtype=np.int64)
            ids.append(np.asarray(input_ids, dtype=np.int64)[: self.max_length])
            masks.append(loss_mask_of(starts, spans)[: self.max_length])
        return {"input_ids": ids, "loss_mask": masks}


# ------------------------------------------------------------------------------------------- the corpus, cached
def tokenized_key(tokenizer, conversations: Sequence[Conversation], max_length: int | None) -> str:
    """Content key of a tokenization: the messages, the whole tokenizer (vocabulary, template, special tokens) and
    the truncation, so a changed file or template never reads a stale cache."""
    from datasets.fingerprint import Hasher

    digest = hashlib.sha256(f"{TOKENIZED_FORMAT}|{max_length}|{Hasher.hash(tokenizer)}".encode())
    for conv in conversations:
        digest.update(json.dumps(conv["messages"], ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]


def _samples_of(dataset) -> list[Sample]:
    """One sample per row as views into the memory-mapped Arrow columns (no copy of the token ids)."""
    table = dataset.data.table  # `load_from_disk` maps the Arrow files
    columns = {}
    for name in ("input_ids", "loss_mask"):
        column = table.column(name).combine_chunks()
        with warnings.catch_warnings():  # the mapped buffer is read-only; samples are never written
            warnings.simplefilter("ignore", UserWarning)
            values = torch.from_numpy(column.values.to_numpy(zero_copy_only=True))
        columns[name] = (values, column.offsets.to_numpy())
    ids, mask = columns["input_ids"], columns["loss_mask"]
    return [{"input_ids": ids[0][a:b], "loss_mask": mask[0][a:b]}
            for a, b in zip(ids[1][:-1].tolist(), ids[1][1:].tolist())]


def _num_proc(count: int, num_proc: int | None) -> int:
    if num_proc is not None:
        return max(1, num_proc)
    return max(1, min(os.cpu_count() or 1, count // CONVERSATIONS_PER_PROCESS))


_WORKER_BATCHES: BatchTokenizer | None = None  # each worker process's own, set once by `_start_worker`


def _start_worker(batches: BatchTokenizer) -> None:
    """A worker leaves Ctrl-C to the main process (which stops it), so one keypress prints one line, not one per
    process."""
    global _WORKER_BATCHES
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_BATCHES = batches


def _tokenize_in_worker(conversations: list[list[dict]]) -> dict:
    return _WORKER_BATCHES(conversations)


def _build(tokenizer, conversations: Sequence[Conversation], max_length: int | None, num_proc: int, progress: bool):
    """Tokenize into a fresh Arrow dataset, batches of conversations over `num_proc` processes (forked, each with
    the tokenizer once), counted on a bar or log line; Ctrl-C stops the workers at once."""
    import datasets

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("uint8"))})
    jobs = [[conv["messages"] for conv in conversations[i : i + BATCH_SIZE]] for i in range(0, len(conversations), BATCH_SIZE)]
    columns = {"input_ids": [], "loss_mask": []}
    batches = BatchTokenizer.of(tokenizer, max_length)
    pool = multiprocessing.get_context("fork").Pool(num_proc, _start_worker, (batches,)) if num_proc > 1 else None
    try:
        results = pool.imap(_tokenize_in_worker, jobs) if pool else map(batches, jobs)
        with progress_bar(total=len(conversations), desc="tokenize", unit="conv", enabled=progress) as bar:
            for messages, result in zip(jobs, results):
                for name in columns:
                    columns[name] += result[name]
                bar.update(len(messages))
    finally:
        if pool is not None:
            pool.terminate()
    return datasets.Dataset.from_dict(columns, features=features)


def _save(dataset, folder: Path, path: Path) -> None:
    """Write the cache entry whole or not at all: a killed run leaves a .tmp folder, never one that looks complete.
    Processes that tokenize the same data at once (`accelerate launch`) each write their own; the first rename wins
    and the others keep the winner's (the same bits)."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp"))
    datasets.disable_progress_bars()  # a copy of a few MB: no bar
    try:
        dataset.save_to_disk(str(scratch))
        try:
            os.replace(scratch, path)
        except OSError:
            if not path.is_dir():  # not a lost race: a real problem (disk, permissions)
                raise
    finally:
        datasets.enable_progress_bars()
        shutil.rmtree(scratch, ignore_errors=True)


def tokenize_conversations(tokenizer, conversations: Sequence[Conversation], max_length: int | None = None,
                           name: str = "dataset", num_proc: int | None = None, cache_dir: str | os.PathLike | None = None,
                           progress: bool = True, log=None) -> list[Sample]:
    """Tokenize a dataset (refusing an empty one, one without assistant turns, a tokenizer without a template), from
    the on-disk cache when the same conversations were tokenized before with the same tokenizer and `max_length`.

    `cache_dir` defaults to `cache_home()/tokenized`. Samples are the same, bit for bit, as `tokenize_conversation`
    on each conversation.
    """
    import datasets

    check_chat_template(tokenizer)
    check_dataset(conversations, name)
    log = log or (lambda line: None)  # the bar (or its log lines, on a long run) tells a user what happens
    began = time.perf_counter()
    folder = Path(cache_dir) if cache_dir is not None else cache_home() / "tokenized"
    path = folder / tokenized_key(tokenizer, conversations, max_length)
    if not path.is_dir():
        procs = _num_proc(len(conversations), num_proc)
        log(f"tokenize: {len(conversations)} conversations of {name} over {procs} process{'es' * (procs > 1)}")
        _save(_build(tokenizer, conversations, max_length, procs, progress), folder, path)
        how = "tokenized"
    else:
        how = "read from the tokenization cache"
    samples = _samples_of(datasets.load_from_disk(str(path)))
    tokens = sum(len(s["input_ids"]) for s in samples)
    log(f"tokenize: {len(samples)} conversations, {tokens} tokens {how} in {time.perf_counter() - began:.1f} s")
    return samples
