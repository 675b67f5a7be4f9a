"""On-policy data: let the target write every assistant turn itself.

A drafter is judged by how often the target accepts its guesses, so it should learn the target's own answers, not a
human's or another model's (this matters more for τ than anything else). We keep the user (and system) turns, and
turn by turn let the target answer with its chat template and the given sampling settings, with plain transformers
`generate`, batched with left padding.

Resumable: each finished conversation is appended to the output JSONL as one whole line (one `write` + fsync); on
restart the ids already written are skipped, and a partial last line left by a kill is cut off, never counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm


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


def _append_line(fd: int, conversation: dict) -> None:
    line = (json.dumps({"id": conversation["id"], "messages": conversation["messages"]}, ensure_ascii=False) + "\n").encode()
    written = 0
    while written < len(line):
        written += os.write(fd, line[written:])
    os.fsync(fd)


@torch.inference_mode()
def generate_replies(model, tokenizer, histories: list[list[dict]], max_new_tokens: int = 256, temperature: float = 0.0,
                     top_p: float = 1.0) -> list[str]:
    """One assistant reply per history (each ends with a user turn), batched with left padding."""
    prompts = [tokenizer.apply_chat_template(h, tokenize=False, add_generation_prompt=True) for h in histories]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # every row must end at the same column
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    batch = batch.to(next(model.parameters()).device)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    generated = model.generate(
        **batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, top_k=None, **sampling
    )  # [b, T_prompt + new]
    new_tokens = generated[:, batch["input_ids"].shape[1] :]
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def regenerate_conversations(model, tokenizer, conversations: list[dict], output: str | os.PathLike,
                             max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                             batch_size: int = 8, progress: bool = True) -> int:
    """Regenerate every assistant turn of `conversations` into `output` (messages JSONL with `id`); resumes.

    Returns the number of conversations written by this call.
    """
    from .data import check_chat_template, check_dataset

    check_chat_template(tokenizer)
    check_dataset(conversations, need_assistant=False)
    ids = [c["id"] for c in conversations]
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids are not unique, so a restart could not tell which are done; give each record a unique `id`")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(output)
    todo = [c for c in conversations if c["id"] not in done]
    model.eval()
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    written = 0
    try:
        bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), unit="conv", desc="regenerate", disable=not progress)
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            # Seeded per batch by its first id, so a resumed run samples the same way for the same batch.
            torch.manual_seed(int(hashlib.sha256(f"{seed}:{batch[0]['id']}".encode()).hexdigest()[:15], 16))
            prompts = [[m for m in c["messages"] if m["role"] != "assistant"] for c in batch]  # user/system turns
            rewritten: list[list[dict]] = [[] for _ in batch]
            cursor = [0] * len(batch)
            while True:  # one round per user turn: answer it for every conversation that still has one
                active, histories = [], []
                for row, turns in enumerate(prompts):
                    while cursor[row] < len(turns) and turns[cursor[row]]["role"] != "user":
                        rewritten[row].append(turns[cursor[row]])
                        cursor[row] += 1
                    if cursor[row] < len(turns):
                        rewritten[row].append(turns[cursor[row]])
                        cursor[row] += 1
                        active.append(row)
                        histories.append(rewritten[row])
                if not active:
                    break
                replies = generate_replies(model, tokenizer, histories, max_new_tokens, temperature, top_p)
                for row, reply in zip(active, replies):
                    rewritten[row].append({"role": "assistant", "content": reply})
            for conv, messages in zip(batch, rewritten):
                _append_line(fd, {"id": conv["id"], "messages": messages})
                written += 1
            bar.update(len(batch))
        bar.close()
    finally:
        os.close(fd)
    return written


# ---------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Keep the user turns of a chat dataset and let the target write every assistant turn with its own chat "
        "template and sampling settings (on-policy data). Output: messages JSONL with an `id` per conversation; "
        "rerunning the same command resumes where it stopped."
    )
    parser.add_argument("--target", required=True, help="target model path or Hub id; `smollm2` = the offline SmolLM2-135M-Instruct")
    parser.add_argument("--input", "--dataset", dest="input", required=True,
                        help="JSONL (OpenAI messages or ShareGPT), or `chitchat` / `chatterbot`")
    parser.add_argument("--output", required=True, help="output JSONL (appended to; ids already present are skipped)")
    parser.add_argument("--split", default="all", choices=["train", "validation", "test", "all"], help="hash split to regenerate (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="regenerate only the first N conversations")
    parser.add_argument("--max-turns", type=int, default=None, help="keep at most this many user turns per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per assistant turn (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--batch-size", type=int, default=8, help="conversations per generate call (default: 8)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="device of the target (default: cpu)")


def run(args: argparse.Namespace) -> int:
    from .data import check_dataset, load_conversations, load_target, split_conversations

    conversations = load_conversations(args.input)
    check_dataset(conversations, str(args.input), need_assistant=False)
    if args.split != "all":
        conversations = split_conversations(conversations)[args.split]
    if args.limit is not None:
        conversations = conversations[: args.limit]
    if args.max_turns is not None:
        conversations = [_first_user_turns(c, args.max_turns) for c in conversations]
    model, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    written = regenerate_conversations(
        model, tokenizer, conversations, args.output, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, batch_size=args.batch_size,
    )
    print(f"regenerate: wrote {written} conversations ({len(conversations) - written} already done) -> {args.output}")
    return 0


def _first_user_turns(conversation: dict, max_turns: int) -> dict:
    messages, users = [], 0
    for message in conversation["messages"]:
        if message["role"] == "user":
            users += 1
            if users > max_turns:
                break
        messages.append(message)
    return {"id": conversation["id"], "messages": messages}
