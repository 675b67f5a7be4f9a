"""Prompts for `eval` and `bench`: held-out chats, bench domains, and the long context of the overhead measurement.

A drafter is judged on what it never trained on, so prompts come from a hash split of a corpus or JSONL file by
conversation id (`data.split_conversations`: the test split by default, `all` for a corpus never trained on, such as
the humaneval code prompts), each cut right after a user turn so the target writes the next reply. A bench domain
(`SOURCE[:SPLIT[:TURNS]]`) may keep several user turns of history, so long multi-turn contexts are measured as users
send them.
"""

from __future__ import annotations

import sys

import torch

from .data import load_conversations, split_conversations, split_summary

DEFAULT_PROMPT_SOURCES = ("chitchat",)


def conversation_prompts(source, split: str, limit: int, turns: int = 1) -> list[list[dict]]:
    """The first `limit` conversations of `split` (hash split by conversation id; `all` for a corpus never trained
    on) of `source`, each up to its `turns`-th user turn with the replies between (one user message when turns = 1);
    conversations with fewer user turns are skipped."""
    conversations = load_conversations(source)
    if split != "all":
        conversations = split_conversations(conversations)[split]
    prompts = []
    for conv in conversations:
        history, users = [], 0
        for message in conv["messages"]:
            if message["role"] == "user" and message["content"].strip():
                users += 1
                history.append({"role": "user", "content": message["content"].strip()})
                if users == turns:
                    break
            elif history and message["role"] == "assistant":
                history.append({"role": "assistant", "content": message["content"].strip()})
        if users == turns:
            prompts.append(history)
        if len(prompts) == limit:
            break
    return prompts


def domain_prompts(spec: str, split: str, limit: int) -> list[list[dict]]:
    """Prompts of one bench domain, `SOURCE[:SPLIT[:TURNS]]`: SPLIT overrides `split`; TURNS > 1 keeps the
    conversation up to its TURNS-th user turn, earlier replies included, so long multi-turn contexts are measured as
    users send them."""
    source, _, rest = spec.partition(":")
    chosen_split, _, turns = rest.partition(":")
    chosen_split, turns = chosen_split or split, int(turns or 1)
    prompts = conversation_prompts(source, chosen_split, limit, turns)
    fix = f"--split validation or --prompts {source}:validation (also never trained on)"
    if not prompts:
        raise ValueError(f"no prompts with {turns} user turn(s) in the {chosen_split!r} split of {_sizes(source)}; "
                         f"pass {fix}, or another --prompts source.")
    _say_if_short(prompts, limit, chosen_split, source, fix)
    return prompts


def held_out_prompts(sources=DEFAULT_PROMPT_SOURCES, split: str = "test", limit: int = 8) -> list[list[dict]]:
    """First user turn of the first `limit` conversations of `split` (hash split by conversation id, never trained
    on), interleaving the given sources. Each prompt is a one-message chat."""
    per_source = [conversation_prompts(source, split, limit) for source in sources]
    out: list[list[dict]] = []
    for i in range(max((len(p) for p in per_source), default=0)):
        for prompts in per_source:
            if i < len(prompts) and len(out) < limit:
                out.append(prompts[i])
    names = ", ".join(map(str, sources))
    if not out:
        raise ValueError(f"no prompts with a user turn in the {split!r} split of {'; '.join(map(_sizes, sources))}; "
                         "pass --split validation (also never trained on), or another --prompts source.")
    _say_if_short(out, limit, split, names, "--split validation (also never trained on)")
    return out


def _sizes(source) -> str:
    """`source` with its split sizes, for the line that says a split is too small."""
    conversations = load_conversations(source)
    return split_summary(conversations, source) if conversations else f"{source} (empty)"


def _say_if_short(prompts: list, limit: int, split: str, source, fix: str) -> None:
    """One line on stderr when a split holds fewer prompts than asked: the run goes on with those, and says how to
    get more."""
    if split != "all" and len(prompts) < limit:
        print(f"prompts: the {split!r} split of {source} holds {len(prompts)} of the {limit} prompts asked; measuring "
              f"those (for more, pass {fix})", file=sys.stderr)


def encode_prompt(tokenizer, messages: list[dict], device="cpu") -> dict[str, torch.Tensor]:
    """`generate`'s inputs for one chat: its chat template with the generation prompt, so the target writes the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return {"input_ids": ids["input_ids"].to(device), "attention_mask": ids["attention_mask"].to(device)}


def encode_batches(tokenizer, prompts: list[list[dict]], batch_size: int, device="cpu") -> list[dict[str, torch.Tensor]]:
    """`generate`'s inputs for batches of `batch_size` chats in order, each left-padded (the last may be smaller)."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    batches = []
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[start : start + batch_size], padding=True, padding_side="left", return_tensors="pt",
                            add_special_tokens=False)
        batches.append({"input_ids": encoded["input_ids"].to(device), "attention_mask": encoded["attention_mask"].to(device)})
    return batches


def long_context(encoded: list[dict[str, torch.Tensor]], length: int) -> dict[str, torch.Tensor]:
    """`length` tokens of the encoded prompts repeated end to end: a context as long as asked, for timing a drafting
    round against a verify pass at that length."""
    ids = torch.cat([e["input_ids"] for e in encoded] * (1 + length // sum(e["input_ids"].shape[1] for e in encoded)), dim=1)
    ids = ids[:, :length]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


__all__ = ["DEFAULT_PROMPT_SOURCES", "conversation_prompts", "domain_prompts", "encode_batches", "encode_prompt", "held_out_prompts", "long_context"]
