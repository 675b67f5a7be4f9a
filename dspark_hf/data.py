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


# ------------------------------------------------------------------------------------------------------ targets
SMOLLM2_ALIASES = ("smollm2", "huggingfacetb/smollm2-135m-instruct")


def resolve_target(target: str | None, drafter_dir: str | os.PathLike) -> str:
    """The target a drafter was trained for: `target` when given, else the verifier its config records (written by
    `dspark-hf train` from `--target`), so `eval`/`bench` never load a model the drafter does not fit."""
    if target:
        return target
    config = Path(drafter_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"drafter {drafter_dir} has no config.json; pass --model a drafter directory (e.g. the output of `dspark-hf train`)")
    recorded = json.loads(config.read_text()).get("verifier_name_or_path")
    if not recorded:
        raise ValueError(f"drafter {drafter_dir} does not record its target (no verifier_name_or_path in config.json); pass --target")
    return str(recorded)


def _target_location(name_or_path: str) -> str:
    """A local directory, a dense copy of a `.gguf` file, or a Hub id that is cached (or reachable); else one clear
    error instead of transformers' connection traceback or "Repo id must be in the form ..."."""
    from huggingface_hub import is_offline_mode, model_info, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file {name_or_path} does not exist; pass an existing .gguf file")
        from .assets import dense_copy_of_gguf

        return str(dense_copy_of_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target {name_or_path} is a directory without config.json; pass a model directory saved with save_pretrained, a .gguf file or a Hub id")
        return str(path)
    try:
        validate_repo_id(name_or_path)
    except ValueError:
        raise FileNotFoundError(f"target {name_or_path} does not exist; pass a model directory, a .gguf file, a Hub id (org/name) or `smollm2`") from None
    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return name_or_path
    hint = f"download it first (`hf download {name_or_path}`) or pass a local model directory or .gguf file"
    if is_offline_mode():
        raise FileNotFoundError(f"target {name_or_path} is neither a local directory nor in the Hugging Face cache (HF_HUB_OFFLINE is set); {hint}")
    try:
        model_info(name_or_path)  # one request, no retry storm
    except Exception as error:  # not found, gated, or no network: all end the same way for the user
        raise FileNotFoundError(f"target {name_or_path} is not a local directory, not in the Hugging Face cache and not reachable on the Hub ({type(error).__name__}); {hint}") from None
    return name_or_path


def _load_model(location: str, name: str | None, dtype: str, device: str, placement: dict):
    from transformers import AutoModelForCausalLM

    if placement.get("device_map") is None:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype)).to(device)
    else:  # Accelerate big-model loading: layers spread over the devices (and disk) of the plan
        from .target_weights import plan_device_map

        device_map = plan_device_map(location, getattr(torch, dtype), **placement)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype), device_map=device_map,
                                                     max_memory=placement.get("max_memory"),
                                                     offload_folder=placement.get("offload_folder"))
    model.eval()
    if name:  # record the file or name the user gave, not the cache's dense copy
        model.name_or_path = name
    return model


def _location_and_name(name_or_path: str) -> tuple[str, str | None]:
    """Where the weights are, and the name a loaded model carries (and a drafter records as its verifier): the Hub
    name for `smollm2`, the absolute path for a local directory or `.gguf` file (so a drafter trained with a
    relative --target finds it from any directory), None for a Hub id (it keeps its own name)."""
    if name_or_path.lower() in SMOLLM2_ALIASES:
        from .assets import SMOLLM2_NAME, smollm2_path

        return str(smollm2_path()), SMOLLM2_NAME
    location = _target_location(name_or_path)
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".gguf"):
        return location, str(path.resolve())
    return location, os.path.abspath(path) if path.is_dir() else None


def load_target_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", device_map: str | dict | None = None,
                      max_memory: dict | None = None, offload_folder: str | None = None):
    """The target model alone (eval mode): `smollm2` is the offline SmolLM2-135M-Instruct of ASSETS.md; a `.gguf`
    file is dequantized once into a cached dense copy (`assets.dense_copy_of_gguf`). With `device_map` (e.g.
    "auto") it is spread over the devices by Accelerate within `max_memory` (`target_weights.plan_device_map`)."""
    placement = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    return _load_model(*_location_and_name(name_or_path), dtype, device, placement)


def load_target(name_or_path: str, dtype: str = "float32", device: str = "cpu", device_map: str | dict | None = None,
                max_memory: dict | None = None, offload_folder: str | None = None):
    """(model, tokenizer) for a target, resolved and placed as `load_target_model` does."""
    from transformers import AutoTokenizer

    location, name = _location_and_name(name_or_path)
    placement = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    return _load_model(location, name, dtype, device, placement), AutoTokenizer.from_pretrained(location)


def load_target_tokenizer(name_or_path: str):
    """The target's tokenizer alone (e.g. to bound prompts sent to a server that holds the model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_location_and_name(name_or_path)[0])


def load_target_heads(name_or_path: str):
    """The target's input embedding and LM head (fp32) and its config, read from its safetensors shards without
    loading the model (`target_weights.read_target_heads`); a target without safetensors is loaded whole."""
    from .target_weights import read_target_heads

    location, name = _location_and_name(name_or_path)
    return read_target_heads(location, name) or load_target_model(name_or_path, dtype="float32")


def add_placement_arguments(parser) -> None:
    """`--device-map` / `--max-memory` / `--offload-folder`: a target bigger than one device (Accelerate)."""
    parser.add_argument("--device-map", default=None,
                        help="spread the target over devices with Accelerate: auto, balanced or sequential "
                             "(default: all of it on --device)")
    parser.add_argument("--max-memory", default=None, metavar="DEVICE=SIZE,...",
                        help="per-device budget for --device-map, e.g. 0=70GiB,1=70GiB,cpu=200GiB (default: all free memory)")
    parser.add_argument("--offload-folder", default=None,
                        help="let --device-map put what does not fit --max-memory on disk, here (slow; default: refuse)")


def placement_from_args(args) -> dict:
    """The keyword arguments of `load_target` for the placement flags (none when --device-map is not given)."""
    from .target_weights import parse_max_memory

    max_memory = parse_max_memory(args.max_memory)
    if args.device_map is None:
        if max_memory is not None or args.offload_folder is not None:
            raise ValueError("--max-memory and --offload-folder apply to --device-map; add --device-map auto")
        return {}
    return {"device_map": args.device_map, "max_memory": max_memory, "offload_folder": args.offload_folder}
