"""Online (cache-free) vs cached training throughput on the real target, measured in one run (issue 12.4).

The same conversations, drafter and schedule three ways: `build_cache` (one target pass, written once),
training on that cache, and online training (the target runs inside the loop, every epoch). The cost of one training
epoch is the cost of a 2-epoch run minus that of a 1-epoch run (setup cancels: loading the target, building the
drafter), in wall time and in process CPU time (steadier on a shared machine). A cache costs the capture once plus
the cached epochs; online pays the capture again every epoch, so the table also gives the epoch count past which a
cache is cheaper.

    OMP_NUM_THREADS=1 python benchmarks/bench_online.py [--samples 36] [--target-dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf.assets import load_smollm2
from dspark_hf.cache import HiddenStateCache, build_cache, default_aux_layer_ids
from dspark_hf.corpora import chitchat_conversations
from dspark_hf.data import split_conversations, write_jsonl
from dspark_hf.reporting import machine_description
from dspark_hf.training.trainer import TrainingArguments, train
from dspark_hf.vocab import build_draft_vocab, count_assistant_tokens, save_draft_vocab


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


def timed(function, *args, **kwargs) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call, its console output swallowed."""
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        function(*args, **kwargs)
    return time.perf_counter() - wall, time.process_time() - cpu


def epoch_cost(root: Path, name: str, steps: int, **settings) -> tuple[float, float]:
    """(wall, CPU) seconds of one training epoch: a 2-epoch run minus a 1-epoch run."""
    runs = [timed(train, TrainingArguments(output_dir=str(root / f"{name}-{epochs}"), max_steps=epochs * steps,
                                           logging_steps=epochs * steps, **settings)) for epochs in (1, 2)]
    return runs[1][0] - runs[0][0], runs[1][1] - runs[0][1]


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
        capture = timed(build_cache, model, tokenizer, convs, root / "cache", aux, dtype="bfloat16",
                        max_length=args.max_length, progress=False, log=lambda *_: None)
        del model
        cache = HiddenStateCache(root / "cache")
        tokens = cache.num_tokens
        save_draft_vocab(root / "vocab.safetensors", *build_draft_vocab(count_assistant_tokens(cache), args.draft_vocab_size))
        steps = -(-len(cache) // args.batch_size)  # one epoch
        common = dict(target="smollm2", draft_vocab=str(root / "vocab.safetensors"), batch_size=args.batch_size,
                      max_anchors=16, report_to=None, progress=False)
        cached = epoch_cost(root, "cached", steps, train_cache=str(root / "cache"), **common)
        online = epoch_cost(root, "online", steps, online=True, dataset=str(root / "chats.jsonl"),
                            max_length=args.max_length, target_dtype=args.target_dtype, online_dtype="bfloat16", **common)

    print(f"machine: {machine_description()}")
    print(f"target: SmolLM2-135M-Instruct ({args.target_dtype}), aux layers {aux}, states in bfloat16; "
          f"drafter: 1 layer, draft vocab {args.draft_vocab_size}, batch {args.batch_size}, 16 anchors/sample")
    print(f"data: {len(convs)} chitchat conversations (≤{args.max_turns} user turns), {tokens} tokens, one epoch = {steps} steps")
    print(f"{'':38s}{'wall s':>9s}{'tok/s':>9s}{'CPU s':>9s}{'tok/s':>9s}")
    for label, (wall, cpu) in (("build_cache (capture + write, once)", capture), ("cached training, one epoch", cached),
                               ("online training, one epoch", online)):
        print(f"{label:38s}{wall:9.2f}{tokens / wall:9.0f}{cpu:9.2f}{tokens / cpu:9.0f}")
    for clock, i in (("wall", 0), ("CPU", 1)):
        break_even = capture[i] / max(online[i] - cached[i], 1e-9)
        print(f"{clock}: online / cached training tokens/s = {cached[i] / online[i]:.3f}x; one epoch end to end "
              f"(cache + cached epoch) / online epoch = {(capture[i] + cached[i]) / online[i]:.3f}x; "
              f"a cache is cheaper from {break_even:.2f} epochs on")


if __name__ == "__main__":
    main()
