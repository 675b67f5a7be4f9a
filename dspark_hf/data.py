"""Chat datasets in, token ids and an assistant loss mask out.

A drafter learns to predict what the target *writes*, so everything downstream (regeneration, the hidden-state cache,
the draft vocabulary, the training loss) needs one normalized conversation form and one exact answer to "which tokens
did the assistant produce?". The answer comes from the target's own chat template, by rendering growing prefixes of
the conversation, so it holds for any template that renders earlier turns unchanged (ChatML, Llama 3, Gemma, ...).

Normalized form: ``{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from .corpora import CORPORA

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
# Special tokens that close a turn in common templates; the one the target emits counts as assistant.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>", "<|end_of_text|>")
SPLITS = ("train", "validation", "test")

Conversation = dict  # {"id": str, "messages": list[dict[str, str]]}


# ----------------------------------------------------------------------------------------------- reading datasets
def _conversation_id(messages: list[dict]) -> str:
    """Stable id from the content, for records without an `id` (reordering the file never moves a split)."""
    blob = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def normalize_record(record: dict, where: str = "<record>") -> Conversation:
    """One OpenAI-messages or ShareGPT record -> normalized conversation; `where` names file:line in errors."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with 'messages' or 'conversations', got {type(record).__name__}")
    if isinstance(record.get("messages"), list):
        messages = []
        for turn in record["messages"]:
            if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
                raise ValueError(f"{where}: every entry of 'messages' needs 'role' and 'content' (OpenAI format)")
            if turn["role"] not in ROLES:
                raise ValueError(f"{where}: unknown role {turn['role']!r}; expected one of {', '.join(ROLES)}")
            messages.append({"role": turn["role"], "content": str(turn["content"] or "")})
    elif isinstance(record.get("conversations"), list):
        messages = []
        for turn in record["conversations"]:
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise ValueError(f"{where}: every entry of 'conversations' needs 'from' and 'value' (ShareGPT format)")
            role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise ValueError(f"{where}: unknown ShareGPT speaker {turn['from']!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
            messages.append({"role": role, "content": str(turn["value"] or "")})
    else:
        raise ValueError(
            f"{where}: unknown record format (keys: {', '.join(sorted(record)) or 'none'}); expected OpenAI "
            "{'messages': [{'role', 'content'}]} or ShareGPT {'conversations': [{'from', 'value'}]}"
        )
    conv_id = record.get("id")
    return {"id": str(conv_id) if conv_id is not None else _conversation_id(messages), "messages": messages}


def read_jsonl(path: str | os.PathLike) -> list[Conversation]:
    """Read a JSONL dataset (OpenAI messages or ShareGPT, mixed freely) into normalized conversations."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    conversations = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg}); each line must be one JSON object") from None
            conversations.append(normalize_record(record, where))
    return conversations


def check_dataset(conversations: list[Conversation], name: str = "dataset", need_assistant: bool = True) -> None:
    """The two data errors every stage shares: nothing to read, or nothing to learn from."""
    if not conversations:
        raise ValueError(f"{name} is empty: no conversations found; pass a JSONL file with at least one record")
    if need_assistant and not any(m["role"] == "assistant" for c in conversations for m in c["messages"]):
        raise ValueError(
            f"{name} has no assistant turns, so there is nothing to learn; run `dspark-hf regenerate` first to let the "
            "target write them"
        )
    if not any(m["role"] == "user" for c in conversations for m in c["messages"]):
        raise ValueError(f"{name} has no user turns; every conversation needs at least one user prompt")


def write_jsonl(path: str | os.PathLike, conversations: Iterable[Conversation]) -> int:
    """Write normalized conversations as messages JSONL (atomically: temp file then rename). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        for conv in conversations:
            handle.write(json.dumps({"id": conv["id"], "messages": conv["messages"]}, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


# -------------------------------------------------------------------------------------------- real corpora (ASSETS)
def load_conversations(source: str | os.PathLike) -> list[Conversation]:
    """A JSONL path, or a built-in corpus by name (`corpora.CORPORA`: chitchat, chatterbot, wordnet-nouns, ...)."""
    if str(source) in CORPORA:
        return CORPORA[str(source)]()
    return read_jsonl(source)


# ----------------------------------------------------------------------------------------------------- splitting
def split_of(conv_id: str, validation: float = 0.02, test: float = 0.02, salt: str = "dspark-hf") -> str:
    """Deterministic split of one conversation id: a hash, not a position, so adding data never moves a test
    conversation into train."""
    digest = hashlib.sha256(f"{salt}:{conv_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    if u < test:
        return "test"
    if u < test + validation:
        return "validation"
    return "train"


def split_conversations(
    conversations: list[Conversation], validation: float = 0.02, test: float = 0.02, salt: str = "dspark-hf"
) -> dict[str, list[Conversation]]:
    """{"train", "validation", "test"} -> conversations, by `split_of` on each id (order preserved)."""
    if validation < 0 or test < 0 or validation + test >= 1:
        raise ValueError(f"split fractions validation={validation}, test={test} must be >= 0 and sum to < 1")
    out: dict[str, list[Conversation]] = {name: [] for name in SPLITS}
    for conv in conversations:
        out[split_of(conv["id"], validation, test, salt)].append(conv)
    return out


def select_conversations(conversations: list[Conversation], source: str | os.PathLike, split: str = "all",
                         limit: int | None = None) -> list[Conversation]:
    """The conversations of one hash split of `source` (or all of them), the first `limit`; refuses an empty result
    with the split that was empty and the flags that fix it."""
    chosen = conversations if split == "all" else split_conversations(conversations)[split]
    if limit is not None:
        chosen = chosen[: max(limit, 0)]
    if chosen:
        return chosen
    if limit is not None and limit <= 0:
        raise ValueError(f"--limit {limit} selects no conversations of {source}; pass --limit 1 or more")
    check_dataset(conversations, str(source), need_assistant=False)
    raise ValueError(
        f"the {split!r} split of {source} is empty ({len(conversations)} conversations, none hashed to {split}); "
        "pass --split all (a regenerated file is already split) or another --split"
    )


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


def _end_of_turn_strings(tokenizer) -> list[str]:
    vocab = tokenizer.get_vocab()
    names = [t for t in (tokenizer.eos_token, *END_OF_TURN_TOKENS) if t and t in vocab]
    return list(dict.fromkeys(names))


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation and return (text, [(start, end) character span of each assistant turn]).

    Span of assistant turn i = render(messages[:i+1]) minus render(messages[:i], add_generation_prompt=True): the
    reply and whatever the template appends to it, cut right after the end-of-turn token (which the target emits,
    so it counts as assistant; a newline the template adds after it does not).
    """
    check_chat_template(tokenizer)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    end_markers = _end_of_turn_strings(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template re-renders earlier turns differently as the conversation grows (e.g. it drops "
                "reasoning from past turns), so assistant tokens cannot be located by prefix; split such "
                "conversations into one record per assistant turn"
            )
        start, end = len(before), len(through)
        found = through.find(message["content"], start) if message["content"] else -1
        reply_end = found + len(message["content"]) if found != -1 else start
        hits = [through.find(m, reply_end) for m in end_markers]
        hits = [(h, len(m)) for h, m in zip(hits, end_markers) if h != -1]
        if hits and min(hits)[0] < end:
            position, length = min(hits)
            end = position + length
        spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Chat-template tokens and the assistant loss mask of one conversation.

    Returns `input_ids` int64 [T] (identical to `apply_chat_template(messages, tokenize=True)`) and `loss_mask`
    uint8 [T], 1 exactly on tokens that start inside an assistant span (reply + end-of-turn token).
    """
    text, spans = assistant_char_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = torch.tensor(encoding["input_ids"], dtype=torch.int64)  # [T]
    starts = torch.tensor([s for s, _ in encoding["offset_mapping"]], dtype=torch.int64)  # [T]
    loss_mask = torch.zeros_like(input_ids, dtype=torch.uint8)  # [T]
    for start, end in spans:
        loss_mask |= ((starts >= start) & (starts < end)).to(torch.uint8)
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_conversations(
    tokenizer, conversations: list[Conversation], max_length: int | None = None, name: str = "dataset"
) -> list[dict[str, torch.Tensor]]:
    """Tokenize a dataset; refuses an empty one, one without assistant turns, and a tokenizer without a template."""
    check_chat_template(tokenizer)
    check_dataset(conversations, name)
    return [tokenize_conversation(tokenizer, c["messages"], max_length) for c in conversations]


# ------------------------------------------------------------------------------------------------ the command line
def add_dataset_arguments(parser, stage: str, flags: tuple[str, ...] = ("--dataset",)) -> None:
    """`--dataset`, `--split` and `--limit`: which conversations a stage that reads a chat dataset (`cache`,
    `regenerate`) reads, defined once so both read and select them alike (`load_selected_conversations`)."""
    parser.add_argument(*flags, dest="dataset", required=True,
                        help="JSONL (OpenAI messages or ShareGPT), or `chitchat` / `chatterbot`")
    parser.add_argument("--split", default="all", choices=[*SPLITS, "all"],
                        help=f"hash split to {stage} (default: all; a regenerated file is already split)")
    parser.add_argument("--limit", type=int, default=None, help=f"{stage} only the first N conversations of the split")


def load_selected_conversations(source: str | os.PathLike, split: str = "all", limit: int | None = None,
                                need_assistant: bool = True) -> list[Conversation]:
    """`source` read (`load_conversations`), refused with the data errors every stage shares (`check_dataset`), and
    one split's first `limit` conversations (`select_conversations`): what `cache`, `regenerate` and online training
    read, so each refuses a bad file the same way before any target loads."""
    conversations = load_conversations(source)
    check_dataset(conversations, str(source), need_assistant)
    return select_conversations(conversations, source, split, limit)
