"""Draft vocabulary: the V_d target tokens the assistant actually writes most often.

The drafter's LM head is the target's restricted to V_d rows, which cuts the head's cost by V_t / V_d with almost no
loss in acceptance when the rows are the frequent assistant tokens. Two tensors describe the choice (docs/design.md §5):
`d2t` int64 [V_d] with target id = j + d2t[j] (draft ids ascending in target id) and `t2d` bool [V_t].
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import load_file, save_file

from .cache import HiddenStateCache
from .data import load_conversations, split_conversations
from .files import atomic_path
from .flags import positive_int
from .progress import add_progress_argument, progress as progress_bar
from .tokenization import tokenize_conversations
from .targets import add_target_argument, load_target_config, load_target_tokenizer


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `draft_vocab_size` ids by (-count, id), padded with the smallest unused ids, sorted ascending.

    counts: [V_t] token frequencies. Returns (d2t int64 [V_d], t2d bool [V_t]).
    """
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} is larger than the vocabulary ({vocab_size} tokens); use at most "
            f"{vocab_size} (or --full for the whole vocabulary)"
        )
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be >= 1")
    counts = counts.to(torch.int64).flatten()
    ids = torch.arange(vocab_size, dtype=torch.int64)
    # Stable sort on -count keeps ascending ids among ties: order = (-count, id). Zero-count ids come last in
    # ascending order, which is exactly "pad with the smallest unused ids".
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(ids[order[:draft_vocab_size]]).values  # [V_d], ascending target ids
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)  # [V_d]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V_t]
    t2d[chosen] = True
    return d2t, t2d


def full_draft_vocab(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary mode: identity map (d2t all zeros, t2d all true)."""
    return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)


def count_assistant_tokens(source, vocab_size: int | None = None, progress: bool = True) -> torch.Tensor:
    """Frequencies [V_t] of tokens with loss_mask == 1, over a `HiddenStateCache` (read shard by shard, ids and
    mask only) or any iterable of {input_ids, loss_mask} samples (e.g. `tokenization.tokenize_conversations`).
    `progress`: a bar, else log lines (`dspark_hf.progress`)."""
    if isinstance(source, HiddenStateCache):
        vocab_size = vocab_size or int(source.manifest["vocab_size"])
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        shards = range(len(source.manifest["shards"]))
        for shard in progress_bar(shards, desc="vocab", unit="shard", enabled=progress):
            handle, _ = source._open(shard)
            ids, mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts
    if vocab_size is None:
        raise ValueError("count_assistant_tokens needs vocab_size for a tokenized dataset (the target's vocabulary size)")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    total = len(source) if hasattr(source, "__len__") else None
    for sample in progress_bar(source, total=total, desc="vocab", unit="sample", enabled=progress):
        ids = sample["input_ids"][sample["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def save_draft_vocab(path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write `d2t`/`t2d` to a small safetensors file, atomically."""
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"t2d selects {int(t2d.sum())} tokens but d2t has {d2t.numel()}; they must describe the same vocabulary")
    with atomic_path(path) as staging:
        save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}, str(staging))


def load_draft_vocab(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [V_d], t2d bool [V_t]) from a file written by `save_draft_vocab`."""
    tensors = load_file(str(path))
    if set(tensors) < {"d2t", "t2d"}:
        raise ValueError(f"{path} is not a draft vocabulary file (needs tensors d2t and t2d, found {sorted(tensors)})")
    return tensors["d2t"], tensors["t2d"]


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of assistant tokens the draft vocabulary can produce."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


# ---------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Build the draft vocabulary (d2t/t2d) from assistant-token frequencies in a hidden-state cache (or a "
        "dataset tokenized with the target's chat template): the top V_d tokens by count, ties by id."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--cache", help="hidden-state cache directory (from `dspark-hf cache`)")
    source.add_argument("--dataset", help="JSONL dataset or `chitchat` / `chatterbot` (needs --target for the tokenizer)")
    add_target_argument(parser)  # its tokenizer and chat template tokenize --dataset
    parser.add_argument("--draft-vocab-size", type=positive_int, help="V_d, the number of draft tokens (e.g. 32000)")
    parser.add_argument("--full", action="store_true", help="full-vocabulary mode: d2t zeros, t2d all true")
    parser.add_argument("--max-length", type=positive_int, default=2048, help="truncation when tokenizing --dataset (default: 2048)")
    parser.add_argument("--output", required=True, help="output safetensors file with d2t and t2d")
    add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    if not args.full and args.draft_vocab_size is None:
        raise ValueError("pass --draft-vocab-size N (or --full for the whole vocabulary)")
    if args.cache:
        cache = HiddenStateCache(args.cache)
        vocab_size = int(cache.manifest["vocab_size"])
        counts = count_assistant_tokens(cache, progress=not args.no_progress)
    else:
        if not args.target:
            raise ValueError("--dataset needs --target (its tokenizer and chat template find the assistant tokens)")
        tokenizer, config = load_target_tokenizer(args.target), load_target_config(args.target)
        vocab_size = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
        conversations = split_conversations(load_conversations(args.dataset))["train"]  # never count test tokens
        samples = tokenize_conversations(tokenizer, conversations, args.max_length, name=str(args.dataset),
                                         progress=not args.no_progress)
        counts = count_assistant_tokens(samples, vocab_size, progress=not args.no_progress)
    if args.full:
        d2t, t2d = full_draft_vocab(vocab_size)
    else:
        d2t, t2d = build_draft_vocab(counts, args.draft_vocab_size)
    save_draft_vocab(args.output, d2t, t2d)
    print(
        f"vocab: {d2t.numel()} of {vocab_size} tokens, {int((counts > 0).sum())} distinct assistant tokens seen, "
        f"coverage {coverage(counts, t2d):.4f} of {int(counts.sum())} assistant tokens -> {args.output}"
    )
    return 0
