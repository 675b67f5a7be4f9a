"""Peak resident memory of one batched call, DSpark against plain batched `generate`.

    HF_HUB_OFFLINE=1 python benchmarks/peak_rss.py [--batch-size 16] [--tokens 512] [--dtype bfloat16] [--threads 2]

Each method runs in a process of its own (peak RSS is per process), the drafter loaded in both so that the ratio is
what drafting costs, not the drafter's weights. Every row is forced to `--tokens` new tokens (`min_new_tokens`), so
the caches reach their full length. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
from dspark_hf.evaluation import load_drafter
from dspark_hf.prompts import encode_batches, held_out_prompts
from dspark_hf.reporting import machine_description
from dspark_hf.targets import load_target
dtype, method, batch, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
target, tokenizer = load_target("smollm2", dtype=dtype)
drafter = load_drafter("examples/smollm2-dspark", target, None)
inputs = encode_batches(tokenizer, held_out_prompts(sources=["chitchat"], limit=batch), batch)[0]
kwargs = {"assistant_model": drafter} if method == "dspark" else {}
start = time.perf_counter()
out = target.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **kwargs)
seconds = time.perf_counter() - start
print(json.dumps({"machine": machine_description(), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": seconds, "new_tokens": int(out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1]))}))
"""


def one_run(dtype: str, method: str, batch: int, tokens: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, dtype, method, str(batch), str(tokens), str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runs = {method: one_run(args.dtype, method, args.batch_size, args.tokens, args.threads) for method in ("plain", "dspark")}
    ratio = runs["dspark"]["peak_rss_mib"] / runs["plain"]["peak_rss_mib"]
    print(json.dumps({"dtype": args.dtype, "batch_size": args.batch_size, "tokens": args.tokens, "threads": args.threads,
                      "runs": runs, "dspark_over_plain_rss": round(ratio, 3)}, indent=2))


if __name__ == "__main__":
    main()
