"""On-policy data: let the target write every assistant turn itself.

A drafter is judged by how often the target accepts its guesses, so it should learn the target's own answers, not a
human's or another model's (this matters more for τ than anything else). We keep the user (and system) turns, and
turn by turn let the target answer with its chat template and the given sampling settings, with plain transformers
`generate`: batched with left padding for short chats (a few tokens at a time, so a finished reply leaves the batch),
one conversation at a time with its KV cache kept across turns for long multi-turn data. The history sent to the
target is bounded by a token budget (oldest turns dropped first). At scale the turns go to a serving engine instead
(`--server URL`: vLLM, SGLang, TGI; `serving.ChatServer`), which applies the chat template and batches the concurrent
conversations itself.

Resumable: each finished conversation is appended to the output JSONL as one whole line (one `write` + fsync); on
restart the ids already written are skipped, and a partial last line left by a kill is cut off, never counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path

import torch

from .flags import non_negative_float, non_negative_int, nucleus_mass, positive_float, positive_int, seed
from .progress import add_progress_argument, progress as progress_bar
from .targets import input_device

DEFAULT_MAX_BATCH_TOKENS = 8192  # padded prompt tokens per generate call (rows x longest prompt)
DEFAULT_CHUNK_TOKENS = 16  # new tokens per generate call of a batch, after which finished rows leave it


def _read_done(path: Path) -> set[str]:
    """Ids already regenerated; truncates a partial (unterminated or unparsable) last line left by a kill."""
    if not path.is_file():
        return set()
    done, good_bytes = set(), 0
    with open(path, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                break
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            good_bytes += len(line)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as handle:
            handle.truncate(good_bytes)
    return done


def _append_line(fd: int, conversation: dict, path: Path) -> None:
    line = (json.dumps({"id": conversation["id"], "messages": conversation["messages"]}, ensure_ascii=False) + "\n").encode()
    written = 0
    try:
        while written < len(line):
            written += os.write(fd, line[written:])
        os.fsync(fd)
    except OSError as error:  # a full disk: name the file (a raw fd error names none)
        raise OSError(error.errno, error.strerror, str(path)) from error


class Dialogue:
    """One conversation being rewritten: the system/user turns to replay, the messages written so far, where the prompt
    window starts, and (when generated alone) the target's KV cache of the last prompt and reply."""

    def __init__(self, conversation: dict):
        self.id = conversation["id"]
        self.source = [m for m in conversation["messages"] if m["role"] != "assistant"]
        self.head = next((i for i, m in enumerate(self.source) if m["role"] != "system"), len(self.source))
        self.messages: list[dict] = []
        self.cursor = 0
        self.window = self.head  # index of the oldest non-system message still sent to the target
        self.cache = None
        self.cached_ids: list[int] = []

    def next_user_turn(self) -> bool:
        """Append the turns up to and including the next user turn; False when none is left."""
        while self.cursor < len(self.source):
            message = self.source[self.cursor]
            self.messages.append(message)
            self.cursor += 1
            if message["role"] == "user":
                return True
        return False

    def prompt_ids(self, tokenizer, budget: int | None) -> list[int]:
        """Chat-template ids of the prompt for the next reply, at most `budget` tokens.

        The leading system turns are always kept. When the rest outgrows the budget, the oldest turns are dropped
        (from a user turn on, so the history still starts with one) until it fills at most half the budget: the window
        then stays put for several turns, and so does a cached prefix, instead of sliding every turn. A single user
        turn longer than the budget keeps its last `budget` tokens.
        """
        ids = self._encode(tokenizer, self.window)
        if budget is None or len(ids) <= budget:
            return ids
        starts = [i for i in range(self.window + 1, len(self.messages)) if self.messages[i]["role"] == "user"]
        low, high = 0, len(starts) - 1  # the first start whose prompt fits half the budget (lengths fall with i)
        while low < high:
            middle = (low + high) // 2
            if len(self._encode(tokenizer, starts[middle])) <= budget // 2:
                high = middle
            else:
                low = middle + 1
        if starts:
            self.window = starts[low]
            ids = self._encode(tokenizer, self.window)
        return ids[-budget:]

    def prompt_messages(self, tokenizer, budget: int | None) -> list[dict]:
        """The messages of the next prompt, for a server that applies the chat template itself: all of them, or with
        a tokenizer and a budget the window `prompt_ids` keeps (a single turn longer than the budget is sent whole;
        the server refuses it if it does not fit its context)."""
        if tokenizer is not None and budget is not None:
            self.prompt_ids(tokenizer, budget)
        return self.messages[: self.head] + self.messages[self.window :]

    def _encode(self, tokenizer, start: int) -> list[int]:
        history = self.messages[: self.head] + self.messages[start:]
        return list(tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


class Throughput:
    """Replies and new tokens written, and the tokens/s since the start."""

    def __init__(self):
        self.replies = self.tokens = 0
        self.started = time.perf_counter()

    def add(self, lengths: list[int]) -> None:
        self.replies += len(lengths)
        self.tokens += sum(lengths)

    @property
    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def __str__(self) -> str:
        seconds = time.perf_counter() - self.started
        return f"{self.replies} replies, {self.tokens} new tokens in {seconds:.1f} s ({self.rate:.1f} tokens/s)"


def _sampling(max_new_tokens: int, temperature: float, top_p: float, pad_token_id: int) -> dict:
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    return {"max_new_tokens": max_new_tokens, "pad_token_id": pad_token_id, "top_k": None, **sampling}


def _reply_lengths(new_tokens: list[list[int]], stop_ids: set[int]) -> list[int]:
    """Tokens each row generated, through the first stop token (later columns are padding)."""
    lengths = []
    for row in new_tokens:
        lengths.append(next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row)))
    return lengths


def _stop_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return {*eos, tokenizer.pad_token_id}


def length_groups(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Row indices grouped for separate generate calls, shortest prompts first, each group's padded size (rows x
    longest prompt) within `max_batch_tokens` (a longer prompt goes alone). Left padding pads every row to the longest:
    one long prompt among 48 short ones made prefill attention (rows x length^2) cost 8-14 GB."""
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[index] <= max_batch_tokens:  # sorted: this row is the longest
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def generate_batches(model, tokenizer, prompts: list[list[int]], settings: dict,
                     max_batch_tokens: int) -> tuple[list[str], list[int]]:
    """`generate_batch` over length groups of at most `max_batch_tokens` padded tokens, replies in prompt order."""
    texts, lengths = [""] * len(prompts), [0] * len(prompts)
    for group in length_groups([len(p) for p in prompts], max_batch_tokens):
        group_texts, group_lengths = generate_batch(model, tokenizer, [prompts[i] for i in group], settings)
        for i, text, length in zip(group, group_texts, group_lengths):
            texts[i], lengths[i] = text, length
    return texts, lengths


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts: list[list[int]], settings: dict,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[list[str], list[int]]:
    """One reply per prompt (token ids), batched with left padding; (texts, tokens generated per row).

    Generated `chunk_tokens` at a time: after each chunk the rows that have finished leave the batch, their KV cache
    rows dropped, and the rest go on from their own cache. In one `generate` call a finished row rides along until the
    longest reply ends, and chat replies average about half of `max_new_tokens`. Each row's tokens are those of one
    call (greedy: identical; sampling: the same distribution, other draws). A target with recurrent layers (linear
    attention) keeps state that cannot drop rows, so it generates in one call.
    """
    from transformers import DynamicCache

    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")  # rows end together
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    stop_ids = _stop_ids(model, tokenizer)
    cache, rows, replies = DynamicCache(config=model.config), torch.arange(len(prompts)), [[] for _ in prompts]
    left, device = settings["max_new_tokens"], input_device(model)
    if not _rows_can_leave(cache) or "assistant_model" in settings:  # a drafter's batched loop drops rows itself
        chunk_tokens = left
    while left > 0:
        step = min(chunk_tokens, left)
        generated = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), cache=cache,
                                   **{**settings, "max_new_tokens": step}).cpu()
        new_tokens = generated[:, input_ids.shape[1] :]
        for row, tokens in zip(rows.tolist(), new_tokens.tolist()):
            replies[row] += tokens
        left -= step
        going = _unfinished_rows(new_tokens, stop_ids, step)
        if left <= 0 or going.numel() == 0:
            break
        if going.numel() < rows.numel():
            cache.batch_select_indices(going)  # CPU indices index the cache rows on any device
        rows, input_ids = rows[going], generated[going]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(new_tokens.shape)], dim=1)[going]
    lengths = _reply_lengths(replies, stop_ids)
    texts = tokenizer.batch_decode([reply[:n] for reply, n in zip(replies, lengths)], skip_special_tokens=True)
    return [text.strip() for text in texts], lengths


def _rows_can_leave(cache) -> bool:
    """Whether every layer of `cache` holds only keys and values per row (attention), which rows can be dropped from."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


def _unfinished_rows(new_tokens: torch.Tensor, stop_ids: set[int], step: int) -> torch.Tensor:
    """Indices of the rows that wrote `step` tokens none of which ends the reply."""
    if new_tokens.shape[1] < step:  # generate stops early only when every row has finished
        return torch.arange(0)
    return (~torch.isin(new_tokens, torch.tensor(sorted(stop_ids)))).all(dim=1).nonzero().flatten()


@torch.inference_mode()
def generate_with_prefix_cache(model, tokenizer, dialogue: Dialogue, prompt: list[int], settings: dict) -> tuple[str, int]:
    """One reply for a conversation generated alone, reusing its KV cache for the prefix the new prompt shares with
    the last prompt and reply (usually all of it but the new user turn), so a turn costs its own tokens only."""
    from transformers import DynamicCache

    keep = 0
    for cached, token in zip(dialogue.cached_ids, prompt[:-1]):  # at least one prompt token must be fed
        if cached != token:
            break
        keep += 1
    if keep == 0 or dialogue.cache is None:
        dialogue.cache = DynamicCache(config=model.config)
    else:
        dialogue.cache.crop(keep - dialogue.cache.get_seq_length())
    input_ids = torch.tensor([prompt], device=input_device(model))
    generated = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               cache=dialogue.cache, **settings)  # [1, T_prompt + new]
    dialogue.cached_ids = generated[0, : dialogue.cache.get_seq_length()].tolist()
    new_tokens = generated[:, len(prompt) :]
    text = tokenizer.decode(new_tokens[0], skip_special_tokens=True).strip()
    return text, _reply_lengths(new_tokens.tolist(), _stop_ids(model, tokenizer))[0]


def context_length(model) -> int | None:
    """The target's context (max_position_embeddings), the default `--max-length`."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def default_batch_size(conversations: list[dict]) -> int:
    """8 conversations per generate call for short chats; 1 for multi-turn data (more than 2 user turns on average),
    where reusing each conversation's KV cache across its turns saves far more than batching does."""
    users = sum(m["role"] == "user" for c in conversations for m in c["messages"])
    return 1 if users > 2 * max(len(conversations), 1) else 8


def _check_conversations(conversations: list[dict]) -> None:
    from .data import check_dataset

    check_dataset(conversations, need_assistant=False)
    ids = [c["id"] for c in conversations]
    if len(set(ids)) != len(ids):
        repeated = Counter(ids).most_common(1)[0][0]
        raise ValueError(f"conversation ids are not unique ({len(ids) - len(set(ids))} repeats, e.g. {repeated!r}), so a "
                         "restart could not tell which are done; drop the repeats or give each record a unique `id`")


def _prompt_budget(max_length: int | None, max_new_tokens: int) -> int | None:
    """Tokens left for the prompt, or None for no bound."""
    if max_length is None:
        return None
    if max_length - max_new_tokens < 1:
        raise ValueError(f"--max-length {max_length} leaves no room for the prompt after --max-new-tokens {max_new_tokens}; raise --max-length or lower --max-new-tokens")
    return max_length - max_new_tokens


def regenerate_conversations(model, tokenizer, conversations: list[dict], output: str | os.PathLike,
                             max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                             batch_size: int | None = None, progress: bool = True, max_length: int | None = None,
                             max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, drafter=None) -> int:
    """Regenerate every assistant turn of `conversations` into `output` (messages JSONL with `id`); resumes.

    Each prompt is the conversation so far, bounded to `max_length - max_new_tokens` tokens (default `max_length`: the
    target's context) by dropping the oldest turns (`Dialogue.prompt_ids`). With `batch_size` 1 a conversation's KV
    cache is reused across its turns. Batched rows are not: left padding re-aligns every row at each turn (the rows'
    new turns differ in length), so a row's cached keys would sit at other columns than its new prompt, and transformers
    has no per-row cache crop; batched prompts are re-encoded, bounded by the same budget, and split by length so no
    generate call pads more than `max_batch_tokens` tokens (`length_groups`). `batch_size` None picks
    `default_batch_size`. Progress counts replies (turns); with `progress`, the tokens/s is printed at the end. A
    DSpark `drafter` speeds every call up by batched speculation (greedy replies identical; each reply is generated
    whole, the loop dropping finished rows itself, and a single conversation re-encodes its prompt each turn).
    Returns the number of conversations written by this call.
    """
    from .tokenization import check_chat_template

    check_chat_template(tokenizer)
    _check_conversations(conversations)
    budget = _prompt_budget(max_length or context_length(model), max_new_tokens)
    batch_size = batch_size or default_batch_size(conversations)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    settings = _sampling(max_new_tokens, temperature, top_p, tokenizer.pad_token_id)
    if drafter is not None:
        settings["assistant_model"] = drafter
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(output)
    todo = [c for c in conversations if c["id"] not in done]
    model.eval()
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    written, throughput = 0, Throughput()
    turns = {c["id"]: sum(m["role"] == "user" for m in c["messages"]) for c in conversations}
    bar = progress_bar(total=sum(turns.values()), initial=sum(turns[i] for i in done if i in turns), unit="turn",
                       desc="regenerate", enabled=progress)
    try:
        for start in range(0, len(todo), batch_size):
            dialogues = [Dialogue(c) for c in todo[start : start + batch_size]]
            # Seeded per batch by its first id, so a resumed run samples the same way for the same batch.
            torch.manual_seed(int(hashlib.sha256(f"{seed}:{dialogues[0].id}".encode()).hexdigest()[:15], 16))
            while active := [d for d in dialogues if d.next_user_turn()]:  # one round per user turn
                lengths = _reply_to_turn(model, tokenizer, active, budget, settings, max_batch_tokens, len(dialogues))
                throughput.add(lengths)
                bar.update(len(active))
                bar.set_postfix_str(f"{throughput.rate:.1f} tok/s", refresh=False)
            for dialogue in dialogues:
                _append_line(fd, {"id": dialogue.id, "messages": dialogue.messages}, output)
                written += 1
    finally:
        bar.close()
        os.close(fd)
    if progress:
        print(f"regenerate: {throughput}")
    return written


def _turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    return int(hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).hexdigest()[:8], 16)


def _converse(server, dialogue: Dialogue, sampling: dict, seed: int | None, tokenizer, budget: int | None):
    """Every turn of one conversation through the server, one after another; (dialogue, reply tokens per turn)."""
    lengths = []
    while dialogue.next_user_turn():
        extra = {} if seed is None else {"seed": _turn_seed(seed, dialogue.id, len(lengths))}
        reply, tokens = server.complete(dialogue.prompt_messages(tokenizer, budget), **sampling, **extra)
        dialogue.messages.append({"role": "assistant", "content": reply.strip()})
        lengths.append(tokens or 0)
    return dialogue, lengths


def _unless_stopped(stop: threading.Event, work, *args):
    """`work(*args)` unless an earlier conversation failed; a failure stops the conversations queued behind it."""
    if stop.is_set():
        raise CancelledError()  # never reaches the caller: it raises the earlier conversation's error first
    try:
        return work(*args)
    except BaseException:
        stop.set()
        raise


def regenerate_through_server(server, conversations: list[dict], output: str | os.PathLike, max_new_tokens: int = 256,
                              temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, concurrency: int = 8,
                              tokenizer=None, max_length: int | None = None, progress: bool = True) -> int:
    """`regenerate_conversations` through an OpenAI-compatible server (`serving.ChatServer`): the same JSONL, resume
    and line order, with `concurrency` conversations in flight (the server batches them; each sends its turns in turn).

    Messages go as messages (the server applies the chat template); greedy sends temperature 0, sampling also sends a
    seed per turn derived from `seed` and the id, so a rerun asks for the same samples. With `tokenizer` and
    `max_length` the history is bounded as on the local path; without, it is sent whole. Lines are written in input
    order as conversations finish (at most 2 × `concurrency` run ahead of the oldest unwritten one); on an error the
    rest is cancelled and what was written stays: rerun to resume. Returns the conversations written by this call.
    """
    _check_conversations(conversations)
    budget = _prompt_budget(max_length, max_new_tokens) if tokenizer is not None else None
    sampling = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(output)
    todo = iter([Dialogue(c) for c in conversations if c["id"] not in done])
    turns = {c["id"]: sum(m["role"] == "user" for m in c["messages"]) for c in conversations}
    bar = progress_bar(total=sum(turns.values()), initial=sum(turns[i] for i in done if i in turns), unit="turn",
                       desc="regenerate", enabled=progress)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate")
    pending: deque = deque()
    stop = threading.Event()  # set by the first failed conversation, before a free worker can start the next one
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    written, throughput = 0, Throughput()
    try:
        while True:
            while len(pending) < 2 * concurrency and (dialogue := next(todo, None)) is not None:
                pending.append(pool.submit(_unless_stopped, stop, _converse, server, dialogue, sampling,
                                           seed if temperature > 0 else None, tokenizer, budget))
            if not pending:
                break
            dialogue, lengths = pending.popleft().result()
            _append_line(fd, {"id": dialogue.id, "messages": dialogue.messages}, output)
            written += 1
            throughput.add(lengths)
            bar.update(len(lengths))
            bar.set_postfix_str(f"{throughput.rate:.1f} tok/s", refresh=False)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # on an error: drop what has not started
        bar.close()
        os.close(fd)
    if progress:
        print(f"regenerate: {throughput}")
    return written


# ---------------------------------------------------------------------------------------------------------- CLI
def _reply_to_turn(model, tokenizer, active: list[Dialogue], budget, settings: dict, max_batch_tokens: int,
                   batch_size: int) -> list[int]:
    """Append the target's reply to the current user turn of every active dialogue; the tokens of each reply. A lone
    conversation reuses its KV cache across turns, except under a drafter (its loop starts from an empty cache)."""
    prompts = [d.prompt_ids(tokenizer, budget) for d in active]
    if batch_size == 1 and "assistant_model" not in settings:
        reply, length = generate_with_prefix_cache(model, tokenizer, active[0], prompts[0], settings)
        replies, lengths = [reply], [length]
    else:
        replies, lengths = generate_batches(model, tokenizer, prompts, settings, max_batch_tokens)
    for dialogue, reply in zip(active, replies):
        dialogue.messages.append({"role": "assistant", "content": reply})
    return lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .data import add_dataset_arguments
    from .targets import add_placement_arguments, add_target_argument

    parser.description = (
        "Keep the user turns of a chat dataset and let the target write every assistant turn with its own chat "
        "template and sampling settings (on-policy data). Output: messages JSONL with an `id` per conversation; "
        "rerunning the same command resumes where it stopped."
    )
    add_target_argument(parser, required=True)
    add_dataset_arguments(parser, "regenerate", flags=("--input", "--dataset"))
    parser.add_argument("--output", required=True, help="output JSONL (appended to; ids already present are skipped)")
    parser.add_argument("--max-turns", type=positive_int, default=None, help="keep at most this many user turns per conversation")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens per assistant turn (default: 256)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default), > 0 samples")
    parser.add_argument("--top-p", type=nucleus_mass, default=1.0, help="nucleus sampling mass when sampling (default: 1.0)")
    parser.add_argument("--seed", type=seed, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="token budget of prompt + reply; older turns are dropped to fit, the system turn kept "
                             "(default: the target's context length; with --server: unbounded, the server's own limit)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="conversations per generate call (default: 8, or 1 for multi-turn data, where each "
                             "conversation's KV cache is reused across its turns)")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=DEFAULT_MAX_BATCH_TOKENS,
                        help="padded prompt tokens per generate call (rows x longest prompt): a batch is split by "
                             f"prompt length to stay within it; a longer prompt goes alone (default: {DEFAULT_MAX_BATCH_TOKENS})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="device of the target (default: cpu)")
    parser.add_argument("--drafter", default=None, metavar="DIR",
                        help="a DSpark drafter for this target: batched speculative generation (greedy replies identical "
                             "to plain regeneration; the next training cycle's data written faster)")
    add_placement_arguments(parser)
    server = parser.add_argument_group("serving engine (instead of loading the target here)")
    server.add_argument("--server", default=None, metavar="URL",
                        help="base URL of an OpenAI-compatible server (vLLM, SGLang, TGI), e.g. http://localhost:8000; "
                             "turns are sent to URL/v1/chat/completions")
    server.add_argument("--model-name", default=None, help="the `model` of each request (default: --target)")
    server.add_argument("--concurrency", type=positive_int, default=8, help="conversations in flight at once (default: 8)")
    server.add_argument("--retries", type=non_negative_int, default=5,
                        help="retries of a request after a connection error, 429 or 5xx, with exponential backoff (default: 5)")
    server.add_argument("--request-timeout", type=positive_float, default=600.0, help="seconds to wait for one reply (default: 600)")
    add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    from .data import load_selected_conversations
    from .provenance import check_or_record_settings
    from .targets import check_drafter_dir, load_target, placement_from_args

    if args.drafter and not args.server:
        check_drafter_dir(args.drafter, "--drafter")

    conversations = load_selected_conversations(args.dataset, args.split, args.limit, need_assistant=False,
                                                messages_column=args.messages_column, unique_ids=True,
                                                log=lambda line: print(f"regenerate: {line}"))
    if args.max_turns is not None:
        conversations = [_first_user_turns(c, args.max_turns) for c in conversations]
    placement = placement_from_args(args)
    check_or_record_settings(args.output, _recorded_settings(args))
    if args.server:
        if placement:
            raise ValueError("--device-map places a target loaded here; with --server the server holds the target, so drop --device-map")
        if args.drafter:
            raise ValueError("--drafter speeds up a target loaded here; with --server the server decodes, so drop --drafter")
        written = _run_through_server(args, conversations)
    else:
        model, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device, **placement)
        drafter = _load_drafter(args.drafter, model) if args.drafter else None
        written = regenerate_conversations(
            model, tokenizer, conversations, args.output, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, batch_size=args.batch_size,
            max_length=args.max_length, max_batch_tokens=args.max_batch_tokens, progress=not args.no_progress,
            drafter=drafter,
        )
    print(f"regenerate: wrote {written} conversations ({len(conversations) - written} already done) -> {args.output}")
    return 0


def _recorded_settings(args: argparse.Namespace) -> dict:
    """What shapes the replies, recorded beside the output so a resumed run cannot mix in others (`provenance`); the
    number of conversations (--limit), the batching and a --drafter are not among them."""
    from .targets import target_identity

    served = {"name": args.model_name or args.target, "server": True}
    return {
        "target": served if args.server else target_identity(args.target),
        "dtype": None if args.server else args.dtype,
        "input": str(args.dataset), "messages_column": args.messages_column, "split": args.split,
        "max_turns": args.max_turns, "max_length": args.max_length, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
    }


def _load_drafter(directory: str, model):
    """The drafter in its checkpoint's dtype, on the target's device, bound to the target."""
    from .remote_code.drafting_dspark import DSparkForDrafting

    drafter = DSparkForDrafting.from_pretrained(directory, dtype="auto").to(input_device(model)).eval()
    drafter.attach_to(model)
    return drafter


def _run_through_server(args: argparse.Namespace, conversations: list[dict]) -> int:
    from .targets import load_target_tokenizer
    from .serving import ChatServer

    tokenizer = load_target_tokenizer(args.target) if args.max_length else None  # to bound the history as locally
    server = ChatServer(args.server, args.model_name or args.target, retries=args.retries,
                        timeout=args.request_timeout, concurrency=args.concurrency)
    try:
        return regenerate_through_server(
            server, conversations, args.output, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, seed=args.seed, concurrency=args.concurrency, tokenizer=tokenizer,
            max_length=args.max_length, progress=not args.no_progress,
        )
    finally:
        server.close()


def _first_user_turns(conversation: dict, max_turns: int) -> dict:
    messages, users = [], 0
    for message in conversation["messages"]:
        if message["role"] == "user":
            users += 1
            if users > max_turns:
                break
        messages.append(message)
    return {"id": conversation["id"], "messages": messages}
