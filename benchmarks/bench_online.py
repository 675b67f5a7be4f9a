"""Online (cache-free) vs cached training throughput on the real target, measured in one run (issue 12.4).

The same conversations, drafter and schedule three ways: `build_cache` (one target pass, written once),
training on that cache, and online training (the target runs inside the loop, every epoch). Training tokens/s is the
trainer's own logged number (one log window over the whole run: data loading, capture, forward, backward, step;
setup excluded). One epoch of cached training costs the capture once plus the cached epochs; online pays the capture
again every epoch, so the table also gives the epoch count past which a cache is cheaper.

    OMP_NUM_THREADS=1 python benchmarks/bench_online.py [--samples 36] [--target-dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf.assets import load_smollm2
from dspark_hf.cache import HiddenStateCache, build_cache, default_aux_layer_ids
from dspark_hf.corpora import chitchat_conversations
from dspark_hf.data import split_conversations, write_jsonl
from dspark_hf.training.trainer import TrainingArguments, train
from dspark_hf.vocab import build_draft_vocab, count_assistant_tokens, save_draft_vocab


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def first_turns(conversations: list[dict], count: int, max_turns: int) -> list[dict]:
    """The first `count` conversations, each cut after `max_turns` user turns."""
    kept = []
    for conv in conversations[:count]:
        messages, users = [], 0
        for message in conv["messages"]:
            users += message["role"] == "user"
            if users > max_turns:
                break
            messages.append(message)
        kept.append({"id": conv["id"], "messages": messages})
    return kept


def logged_tokens_per_s(args: TrainingArguments) -> float:
    """Train and return the tokens/s the trainer logs for its single window (the whole run, setup excluded)."""
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        train(args)
    rates = re.findall(r"tokens/s=(\d+)", console.getvalue())
    if not rates:
        raise RuntimeError(f"no tokens/s in the training log:\n{console.getvalue()[-2000:]}")
    return float(rates[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=36)
    parser.add_argument("--max-turns", type=int, default=3, help="user turns kept per chitchat conversation")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--target-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    model, tokenizer = load_smollm2(dtype=args.target_dtype)
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    convs = first_turns(split_conversations(chitchat_conversations())["train"], args.samples, args.max_turns)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_jsonl(root / "chats.jsonl", convs)
        start = time.perf_counter()
        build_cache(model, tokenizer, convs, root / "cache", aux, dtype="bfloat16", max_length=args.max_length,
                    progress=False, log=lambda *_: None)
        capture_s = time.perf_counter() - start
        del model
        cache = HiddenStateCache(root / "cache")
        tokens = cache.num_tokens
        save_draft_vocab(root / "vocab.safetensors", *build_draft_vocab(count_assistant_tokens(cache), args.draft_vocab_size))
        steps = -(-len(cache) // args.batch_size)  # one epoch
        common = dict(target="smollm2", draft_vocab=str(root / "vocab.safetensors"), max_steps=steps,
                      batch_size=args.batch_size, max_anchors=16, logging_steps=steps, report_to=None, progress=False)
        cached_tps = logged_tokens_per_s(TrainingArguments(output_dir=str(root / "cached"), train_cache=str(root / "cache"), **common))
        online_tps = logged_tokens_per_s(TrainingArguments(
            output_dir=str(root / "online"), online=True, dataset=str(root / "chats.jsonl"), max_length=args.max_length,
            target_dtype=args.target_dtype, online_dtype="bfloat16", **common))

    capture_tps = tokens / capture_s
    per_epoch = {"cached": tokens / cached_tps, "online": tokens / online_tps}
    break_even = capture_s / max(per_epoch["online"] - per_epoch["cached"], 1e-9)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"target: SmolLM2-135M-Instruct ({args.target_dtype}), aux layers {aux}, states in bfloat16; "
          f"drafter: 1 layer, draft vocab {args.draft_vocab_size}, batch {args.batch_size}, 16 anchors/sample")
    print(f"data: {len(convs)} chitchat conversations (≤{args.max_turns} user turns), {tokens} tokens, one epoch = {steps} steps")
    print(f"build_cache (capture + write, once)  {capture_s:8.2f} s  {capture_tps:8.0f} tok/s")
    print(f"cached training                      {per_epoch['cached']:8.2f} s  {cached_tps:8.0f} tok/s")
    print(f"online training                      {per_epoch['online']:8.2f} s  {online_tps:8.0f} tok/s")
    print(f"online / cached training tokens/s: {online_tps / cached_tps:.3f}x; "
          f"one epoch end to end (cache + train vs online): {(capture_s + per_epoch['cached']) / per_epoch['online']:.3f}x; "
          f"a cache pays for itself after {break_even:.2f} epochs")


if __name__ == "__main__":
    main()
