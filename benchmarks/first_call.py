"""The first `generate` of a fresh process with no stored profile, against the same call warm.

    HF_HUB_OFFLINE=1 python benchmarks/first_call.py [--dtype bfloat16] [--runs 3] [--isa native avx2]

Each run is a new process with an empty HF_HOME (no verify profile, nothing learned): it times DSpark generate on
a chat test prompt twice, first call then warm, and plain generate the same way (in a process of its own, so plain's
own first-call cost is the reference). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from dspark_hf.benchmark import ISA_CAPS

CHILD = r"""
import json, sys, time, torch
from dspark_hf.evaluation import load_drafter
from dspark_hf.prompts import encode_prompt, held_out_prompts
from dspark_hf.reporting import machine_description
from dspark_hf.targets import load_target
torch.set_num_threads(1)
dtype, method, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
target, tokenizer = load_target("smollm2", dtype=dtype)
inputs = encode_prompt(tokenizer, held_out_prompts(limit=1)[0])
kwargs = {"assistant_model": load_drafter("examples/smollm2-dspark", target, torch.bfloat16)} if method == "dspark" else {}
seconds = []
for _ in range(2):
    start = time.perf_counter()
    target.generate(**inputs, max_new_tokens=tokens, do_sample=False, **kwargs)
    seconds.append(time.perf_counter() - start)
print(json.dumps({"machine": machine_description(), "first_s": seconds[0], "warm_s": seconds[1]}))
"""


def one_run(dtype: str, method: str, tokens: int, isa: str) -> dict:
    with tempfile.TemporaryDirectory() as home:
        env = {name: value for name, value in os.environ.items() if name not in ISA_CAPS["avx2"]}
        env.update(ISA_CAPS[isa], HF_HOME=home, HF_HUB_OFFLINE="1")
        out = subprocess.run([sys.executable, "-c", CHILD, dtype, method, str(tokens)], env=env, check=True,
                             capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--isa", nargs="+", default=["native"], choices=list(ISA_CAPS))
    args = parser.parse_args()
    result = {}
    for isa in args.isa:
        for method in ("plain", "dspark"):
            runs = [one_run(args.dtype, method, args.tokens, isa) for _ in range(args.runs)]
            ratios = [r["first_s"] / r["warm_s"] for r in runs]
            result[f"{isa}/{method}"] = {"machine": runs[0]["machine"], "first_s": [round(r["first_s"], 3) for r in runs],
                                         "warm_s": [round(r["warm_s"], 3) for r in runs],
                                         "first_over_warm_median": round(statistics.median(ratios), 3)}
    print(json.dumps({"dtype": args.dtype, "tokens": args.tokens, "runs": result}, indent=2))


if __name__ == "__main__":
    main()
