"""Tokenization at corpus scale: the whole chitchat corpus cold and from the cache, a 100k-conversation ShareGPT
Parquet file under the Qwen2.5 template, and how soon `cache` / `train --online` over the whole corpus start work.

    HF_HUB_OFFLINE=1 python benchmarks/bench_tokenize.py [--check] [--conversations 100000] [--startup]

`--check` also tokenizes the whole chitchat corpus by the definition (every prefix rendered; minutes) and reports
whether every sample is identical. Prints one JSON object; run it alone (it uses every core).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark_hf.corpora import chitchat_conversations
from dspark_hf.data import load_conversations
from dspark_hf.reporting import machine_description
from dspark_hf.targets import load_target_tokenizer
from dspark_hf.tokenization import tokenize_conversation, tokenize_conversations

QWEN25_TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen2.5-chat-template.jinja"


def timed(function, *args, **kwargs):
    began = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - began


def chitchat_runs(tokenizer, check: bool) -> dict:
    conversations = chitchat_conversations()
    out = {"conversations": len(conversations)}
    for procs in (1, os.cpu_count() or 1):
        with tempfile.TemporaryDirectory() as cache:
            samples, out[f"cold_s_{procs}_proc"] = timed(tokenize_conversations, tokenizer, conversations,
                                                         num_proc=procs, cache_dir=cache, progress=False)
            _, out[f"cached_s_{procs}_proc"] = timed(tokenize_conversations, tokenizer, conversations, cache_dir=cache,
                                                     progress=False)
    out["tokens"] = sum(len(s["input_ids"]) for s in samples)
    if check:
        began = time.perf_counter()
        out["identical_to_definition"] = all(
            torch.equal(s["input_ids"], d["input_ids"]) and torch.equal(s["loss_mask"], d["loss_mask"])
            for s, d in ((s, tokenize_conversation(tokenizer, c["messages"])) for s, c in zip(samples, conversations)))
        out["definition_s"] = time.perf_counter() - began
    return out


def synthetic_sharegpt(count: int, seed: int = 0) -> list[dict]:
    """ShareGPT records of 1-6 exchanges drawn from chitchat's real utterances."""
    utterances = [m["content"] for c in chitchat_conversations() for m in c["messages"] if m["content"]]
    rng = random.Random(seed)
    records = []
    for k in range(count):
        turns = []
        for _ in range(rng.randint(1, 6)):
            turns += [{"from": "human", "value": rng.choice(utterances)}, {"from": "gpt", "value": rng.choice(utterances)}]
        records.append({"id": f"synthetic-{k}", "conversations": turns})
    return records


def sharegpt_run(tokenizer, count: int) -> dict:
    import datasets

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN25_TEMPLATE.read_text()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sharegpt.parquet"
        datasets.Dataset.from_list(synthetic_sharegpt(count)).to_parquet(str(path))
        conversations, read_s = timed(load_conversations, path)
        procs = os.cpu_count() or 1
        samples, cold_s = timed(tokenize_conversations, qwen, conversations, cache_dir=Path(folder) / "cache",
                                progress=False)
        tokens, megabytes = sum(len(s["input_ids"]) for s in samples), path.stat().st_size / 2**20
    return {"conversations": count, "parquet_MB": round(megabytes, 1), "read_s": read_s, "cold_s": cold_s, "tokens": tokens,
            "processes": procs, "tokens_per_s_per_core": tokens / cold_s / procs}


def startup_s(command: list[str], pattern: str, timeout: float = 300) -> float | None:
    """Seconds from launch until stderr shows `pattern` (the first shard or step begun), then stop the run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DSPARK_HF_PROGRESS_INTERVAL": "1"}
    began = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in process.stderr:
            if re.search(pattern, line):
                return time.perf_counter() - began
            if time.perf_counter() - began > timeout:
                return None
        return None
    finally:
        process.kill()
        process.wait()


def startup_runs() -> dict:
    cli = [sys.executable, "-m", "dspark_hf.cli"]
    with tempfile.TemporaryDirectory() as folder:
        cache = [*cli, "cache", "--target", "smollm2", "--dataset", "chitchat", "--output", f"{folder}/cache"]
        train = [*cli, "train", "--online", "--target", "smollm2", "--dataset", "chitchat", "--max-steps", "1",
                 "--output", f"{folder}/run"]
        return {"cache_first_shard_s": startup_s(cache, r"^cache: .*tok"), "train_first_step_s": startup_s(train, r"^train")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="also compare every chitchat sample with the definition")
    parser.add_argument("--conversations", type=int, default=100_000, help="synthetic ShareGPT conversations")
    parser.add_argument("--startup", action="store_true", help="also time how soon cache / train --online start work")
    args = parser.parse_args()
    tokenizer = load_target_tokenizer("smollm2")
    result = {"machine": machine_description(),
              "chitchat": chitchat_runs(tokenizer, args.check), "sharegpt_qwen25": sharegpt_run(tokenizer, args.conversations)}
    if args.startup:
        result["startup"] = startup_runs()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
