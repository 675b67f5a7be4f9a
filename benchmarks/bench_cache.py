"""Cache capture cost and size, measured side by side on the real target (docs/design.md §8: overhead ≤ 1.2×, bf16 floor;
issue 12: fp8 with per-row scales ≤ 0.52× the bf16 floor, capture overhead unchanged).

Overhead = wall time of `build_cache` (tokenize, capture, write, hash, manifest) / wall time of a bare target
forward over the same batches of the same tokens. Size = shard bytes per token / (m+1)·d·2, the bf16 floor. Each
cache dtype is measured in turn inside every repeat (interleaved, best of N).

    python benchmarks/bench_cache.py [--samples 48] [--target-dtype bfloat16] [--batch-size 8]
                                     [--dtypes bfloat16,float8_e4m3fn] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf.assets import load_smollm2
from dspark_hf.cache import (
    CACHE_DTYPES,
    DTYPES,
    HiddenStateCache,
    build_cache,
    default_aux_layer_ids,
)
from dspark_hf.corpora import chitchat_conversations
from dspark_hf.data import split_conversations
from dspark_hf.tokenization import tokenize_conversations
from dspark_hf.reporting import machine_description


@torch.inference_mode()
def bare_forward(model, samples, batch_size, logits_to_keep=0) -> float:
    """The same length-sorted, right-padded batches build_cache runs, with no hidden states requested."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]["input_ids"]), i))
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        rows = [samples[i]["input_ids"] for i in order[first : first + batch_size]]
        longest = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.int64)
        mask = torch.zeros(len(rows), longest, dtype=torch.int64)
        for j, r in enumerate(rows):
            ids[j, : len(r)], mask[j, : len(r)] = r, 1
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=logits_to_keep)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--max-turns", type=int, default=3, help="user turns kept per chitchat conversation")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target-dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn", help="comma-separated cache dtypes to measure")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in CACHE_DTYPES]
    if unknown:
        parser.error(f"unknown cache dtypes {unknown}; use {', '.join(CACHE_DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_smollm2(dtype=args.target_dtype)
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    convs = []
    for conv in split_conversations(chitchat_conversations())["train"][: args.samples]:
        messages, users = [], 0
        for m in conv["messages"]:
            users += m["role"] == "user"
            if users > args.max_turns:
                break
            messages.append(m)
        convs.append({"id": conv["id"], "messages": messages})
    samples = tokenize_conversations(tokenizer, convs, max_length=args.max_length)
    tokens = sum(len(s["input_ids"]) for s in samples)

    bare_forward(model, samples[: args.batch_size], args.batch_size)  # warm up
    bare_full, bare_body = [], []
    cached: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    shard_bytes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):  # interleaved, best of N for each
            bare_full.append(bare_forward(model, samples, args.batch_size))
            bare_body.append(bare_forward(model, samples, args.batch_size, logits_to_keep=1))
            for dtype in dtypes:
                out = Path(scratch) / f"{dtype}-{repeat}"
                start = time.perf_counter()
                manifest = build_cache(model, tokenizer, convs, out, aux, dtype=dtype, batch_size=args.batch_size,
                                       max_length=args.max_length, progress=False, log=lambda *_: None)
                cached[dtype].append(time.perf_counter() - start)
                shard_bytes[dtype] = sum(os.path.getsize(out / s["file"]) for s in manifest["shards"])
                HiddenStateCache(out, verify=True)
    d, m = model.config.hidden_size, len(aux)
    floor = (m + 1) * d * 2
    print(f"machine: {machine_description()}")
    print(f"target: SmolLM2-135M-Instruct ({args.target_dtype}), aux layers {aux}, d={d}")
    print(f"data: {len(samples)} chitchat conversations (≤{args.max_turns} user turns), {tokens} tokens, batch {args.batch_size}")
    print(f"bare forward (full logits)      {min(bare_full):7.3f} s  {tokens / min(bare_full):8.0f} tok/s")
    print(f"bare forward (logits_to_keep=1) {min(bare_body):7.3f} s  {tokens / min(bare_body):8.0f} tok/s")
    for dtype in dtypes:
        best = min(cached[dtype])
        print(f"cache {dtype}:")
        print(f"  build_cache (capture+write)     {best:7.3f} s  {tokens / best:8.0f} tok/s")
        print(f"  overhead vs bare forward (full logits): {best / min(bare_full):.3f}x  (goal <= 1.2)")
        print(f"  overhead vs bare forward (no LM head):  {best / min(bare_body):.3f}x")
        print(f"  bytes/token: {shard_bytes[dtype] / tokens:.1f} vs bf16 floor (m+1)*d*2 = {floor} -> "
              f"{shard_bytes[dtype] / tokens / floor:.4f}x")


if __name__ == "__main__":
    main()
