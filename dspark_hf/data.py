"""Chat datasets in, normalized conversations out, split deterministically.

Every stage downstream (regeneration, tokenization, the hidden-state cache, the draft vocabulary) reads one
normalized form, whatever the user's data looks like: a built-in corpus, JSONL, or anything HF `datasets` reads
(Parquet, Arrow, a `save_to_disk` folder, a folder of shards, a Hub dataset id from the local cache), with OpenAI
`messages` or ShareGPT `conversations` records (or a column named by `--messages-column`).

Normalized form: ``{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from .corpora import CORPORA
from .files import atomic_path
from .flags import positive_int

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
# File suffix -> the `datasets` builder that reads it (JSONL is read by `read_jsonl`, for its file:line errors).
DATASET_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}
# What a `save_to_disk` folder holds.
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
MESSAGE_COLUMNS = ("messages", "conversations")
SPLITS = ("train", "validation", "test")
# The hash split's shares: 2 % of conversation ids go to validation and 2 % to test, the rest to train.
VALIDATION_SHARE = TEST_SHARE = 0.02
MISSING_DATASET_HINT = ("pass an existing JSONL, Parquet, Arrow, JSON or CSV file, a folder of them, a built-in corpus "
                        f"({', '.join(list(CORPORA)[:3])}, ...) or a Hub dataset id (org/name)")

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


def record_from_column(turns, conv_id, where: str) -> Conversation:
    """A conversation from the turns of a named column (OpenAI or ShareGPT, told apart by the first turn's keys)."""
    key = "conversations" if turns and isinstance(turns[0], dict) and "from" in turns[0] else "messages"
    return normalize_record({key: turns} if conv_id is None else {key: turns, "id": conv_id}, where)


def read_jsonl(path: str | os.PathLike, messages_column: str | None = None) -> list[Conversation]:
    """Read a JSONL dataset (OpenAI messages or ShareGPT, mixed freely) into normalized conversations; with
    `messages_column`, each record's turns are read from that key, as for any other format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist; {MISSING_DATASET_HINT}")
    conversations = []
    for where, record in _jsonl_records(path):
        if messages_column is None:
            conversations.append(normalize_record(record, where))
        elif not isinstance(record, dict) or messages_column not in record:
            keys = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
            raise ValueError(f"{where}: no {messages_column!r} key (keys: {keys or 'none'}); pass --messages-column "
                             "with the key that holds the turns")
        else:
            conversations.append(record_from_column(record[messages_column], record.get("id"), where))
    return conversations


def _jsonl_records(path: Path):
    """(FILE:LINE, parsed record) for every non-blank line."""
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg}); each line must be one JSON object") from None


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
    count = 0
    with atomic_path(path) as staging, open(staging, "w", encoding="utf-8") as handle:
        for conv in conversations:
            handle.write(json.dumps({"id": conv["id"], "messages": conv["messages"]}, ensure_ascii=False) + "\n")
            count += 1
    return count


# ------------------------------------------------------------------------------------ every source a user has
def load_conversations(source: str | os.PathLike, messages_column: str | None = None,
                       hub_split: str = "train") -> list[Conversation]:
    """A built-in corpus by name (`corpora.CORPORA`), a JSONL file, or any dataset `datasets` reads (a file, a
    `save_to_disk` folder, a folder of shards, a Hub id), normalized; `messages_column` names the turns' column."""
    if str(source) in CORPORA:
        return CORPORA[str(source)]()
    path = Path(source)
    if path.is_file() and path.suffix == ".jsonl":
        return read_jsonl(path, messages_column)
    if path.is_dir() and not any((path / name).exists() for name in SAVED_DATASET_FILES):
        shards = _shards_of(path)
        if shards[0].suffix == ".jsonl":
            return [conv for shard in shards for conv in read_jsonl(shard, messages_column)]
        return read_records(_read_files(shards), str(source), messages_column)
    return read_records(_open_dataset(source, path, hub_split), str(source), messages_column)


def _shards_of(folder: Path) -> list[Path]:
    """The data files of a folder of shards, all of one kind."""
    known = (".jsonl", *DATASET_BUILDERS)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in known and not p.name.startswith("."))
    kinds = sorted({p.suffix for p in files})
    if not files:
        raise ValueError(f"dataset folder {folder} holds no data files; expected shards ending in {', '.join(known)} "
                         "or a `save_to_disk` folder")
    if len(kinds) > 1:
        raise ValueError(f"dataset folder {folder} mixes {', '.join(kinds)} files; keep one kind of shard per folder")
    return files


def _read_files(files: list[Path]):
    import datasets

    return datasets.load_dataset(DATASET_BUILDERS[files[0].suffix], data_files=[str(f) for f in files], split="train")


def _open_dataset(source: str | os.PathLike, path: Path, hub_split: str):
    """A `datasets.Dataset` from a data file, a `save_to_disk` folder or a Hub id (offline: from the local cache)."""
    import datasets

    if path.is_file():
        if path.suffix not in DATASET_BUILDERS:
            raise ValueError(f"dataset {path} has an unknown suffix; pass .jsonl, {', '.join(DATASET_BUILDERS)}, a "
                             "`save_to_disk` folder, a folder of shards or a Hub dataset id")
        return _read_files([path])
    if path.is_dir():
        saved = datasets.load_from_disk(str(path))
        return _one_split(saved, hub_split, str(path))
    if path.suffix in (".jsonl", *DATASET_BUILDERS) or (os.sep in str(source) and not _looks_like_hub_id(str(source))):
        raise FileNotFoundError(f"dataset {path} does not exist; {MISSING_DATASET_HINT}")
    try:
        return _one_split(datasets.load_dataset(str(source), split=hub_split), hub_split, str(source))
    except (FileNotFoundError, ConnectionError, ValueError, OSError) as error:
        raise ValueError(
            f"dataset {source!r} is not a file, a folder, a built-in corpus ({', '.join(CORPORA)}) or a Hub dataset "
            f"in the local cache ({str(error).splitlines()[0] if str(error) else type(error).__name__}); pass a path, "
            "or download it once online"
        ) from None


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def _one_split(dataset, split: str, name: str):
    """A DatasetDict (a saved folder of splits) narrowed to `split`, the Hub's usual `train` by default."""
    if not hasattr(dataset, "keys"):
        return dataset
    if split not in dataset:
        raise ValueError(f"dataset {name} has the splits {', '.join(dataset)}, not {split!r}")
    return dataset[split]


def read_records(dataset, name: str, messages_column: str | None = None) -> list[Conversation]:
    """Normalize every row of a `datasets.Dataset`, batch by batch (the table stays memory-mapped); a bad row is
    refused with its index."""
    column = _messages_column(dataset.column_names, name, messages_column)
    wanted = [column, *(["id"] if "id" in dataset.column_names else [])]
    conversations, row = [], 0
    for batch in dataset.select_columns(wanted).iter(batch_size=1024):
        for turns, conv_id in zip(batch[column], batch.get("id") or [None] * len(batch[column])):
            conversations.append(record_from_column(turns, conv_id, f"{name} row {row}"))
            row += 1
    return conversations


def _messages_column(columns: list[str], name: str, messages_column: str | None) -> str:
    if messages_column is not None:
        if messages_column not in columns:
            raise ValueError(f"dataset {name} has no column {messages_column!r} (columns: {', '.join(columns)}); "
                             "pass --messages-column with one of them")
        return messages_column
    for column in MESSAGE_COLUMNS:
        if column in columns:
            return column
    raise ValueError(f"dataset {name} has no 'messages' or 'conversations' column (columns: {', '.join(columns)}); "
                     "pass --messages-column NAME for the column that holds the turns")


# ----------------------------------------------------------------------------------------------------- splitting
def split_of(conv_id: str, validation: float = VALIDATION_SHARE, test: float = TEST_SHARE, salt: str = "dspark-hf") -> str:
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
    conversations: list[Conversation], validation: float = VALIDATION_SHARE, test: float = TEST_SHARE, salt: str = "dspark-hf"
) -> dict[str, list[Conversation]]:
    """{"train", "validation", "test"} -> conversations, by `split_of` on each id (order preserved)."""
    if validation < 0 or test < 0 or validation + test >= 1:
        raise ValueError(f"split fractions validation={validation}, test={test} must be >= 0 and sum to < 1")
    out: dict[str, list[Conversation]] = {name: [] for name in SPLITS}
    for conv in conversations:
        out[split_of(conv["id"], validation, test, salt)].append(conv)
    return out


def split_summary(conversations: list[Conversation], source: str | os.PathLike) -> str:
    """How `source` splits: `prompts.jsonl: 100 conversations, 99 train / 1 validation / 0 test (the hash of each id
    sends 96 % / 2 % / 2 % of them)`, so a newcomer sees why a small file's test split is empty."""
    sizes = {name: len(part) for name, part in split_conversations(conversations).items()}
    shares = " / ".join(f"{share:.0%}" for share in (1 - VALIDATION_SHARE - TEST_SHARE, VALIDATION_SHARE, TEST_SHARE))
    return (f"{source}: {len(conversations)} conversations, {' / '.join(f'{n} {name}' for name, n in sizes.items())} "
            f"(the hash of each id sends {shares} of them)")


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


def check_unique_ids(conversations: list[Conversation], source: str | os.PathLike) -> None:
    """Refuse conversations that share an id, naming where each repeat is: a resumed `regenerate` tells the finished
    ones by id. A record without an `id` is keyed by its turns, so a prompt that appears twice repeats its key."""
    first: dict[str, int] = {}
    repeats = [(first[c["id"]], i) for i, c in enumerate(conversations) if first.setdefault(c["id"], i) != i]
    if not repeats:
        return
    where = _record_locations(source, len(conversations))
    shown = ", ".join(f"{where[j]} repeats {where[i]}" for i, j in repeats[:3])
    more = f" and {len(repeats) - 3} more" if len(repeats) > 3 else ""
    raise ValueError(
        f"{len(repeats)} conversations of {source} repeat an earlier one's id ({shown}{more}; a record without an "
        "\"id\" is keyed by its turns), so a resumed run could not tell which are done; drop the repeats or give each "
        "record a unique \"id\""
    )


def _record_locations(source: str | os.PathLike, count: int) -> list[str]:
    """Where each conversation `load_conversations(source)` returns came from: FILE:LINE for JSONL, else row N."""
    path = Path(source)
    files = [path] if path.is_file() and path.suffix == ".jsonl" else []
    if path.is_dir() and not any((path / name).exists() for name in SAVED_DATASET_FILES):
        files = [f for f in _shards_of(path) if f.suffix == ".jsonl"]
    places = [where for file in files for where, _ in _jsonl_records(file)]
    return places if len(places) == count else [f"{source} row {i}" for i in range(count)]


# ------------------------------------------------------------------------------------------------ the command line
def add_dataset_arguments(parser, stage: str, flags: tuple[str, ...] = ("--dataset",)) -> None:
    """`--dataset`, `--split` and `--limit`: which conversations a stage that reads a chat dataset (`cache`,
    `regenerate`) reads, defined once so both read and select them alike (`load_selected_conversations`)."""
    parser.add_argument(*flags, dest="dataset", required=True,
                        help="JSONL, Parquet, Arrow, a `save_to_disk` folder, a folder of shards, a Hub dataset id "
                        "(OpenAI messages or ShareGPT conversations), or `chitchat` / `chatterbot`")
    parser.add_argument("--messages-column", default=None,
                        help="the column holding each conversation's turns (default: messages or conversations)")
    parser.add_argument("--split", default="all", choices=[*SPLITS, "all"],
                        help=f"hash split to {stage} (default: all; a regenerated file is already split)")
    parser.add_argument("--limit", type=positive_int, default=None, help=f"{stage} only the first N conversations of the split")


def load_selected_conversations(source: str | os.PathLike, split: str = "all", limit: int | None = None,
                                need_assistant: bool = True, messages_column: str | None = None,
                                unique_ids: bool = False, log=None) -> list[Conversation]:
    """`source` read (`load_conversations`), refused with the data errors every stage shares (`check_dataset`), and
    one split's first `limit` conversations (`select_conversations`): what `cache`, `regenerate` and online training
    read, so each refuses a bad file the same way before any target loads. `unique_ids` refuses repeated ids in the
    whole file (`check_unique_ids`: whatever the split and limit); `log` gets `split_summary` when a split is chosen."""
    conversations = load_conversations(source, messages_column)
    check_dataset(conversations, str(source), need_assistant)
    if unique_ids:
        check_unique_ids(conversations, source)
    if log is not None and split != "all":
        log(split_summary(conversations, source))
    return select_conversations(conversations, source, split, limit)
