"""`make demo`: SmolLM2-135M-Instruct answers held-out chat prompts with the shipped DSpark drafter.

Offline (HF_HUB_OFFLINE=1): the target comes from the PyPI GGUF (dspark_hf.assets), the drafter from
examples/smollm2-dspark/ through `AutoModel.from_pretrained(..., trust_remote_code=True)`, exactly as a user loads
it. Each prompt is answered twice, with plain greedy `generate` and with `generate(..., assistant_model=drafter)`;
the target runs in fp32, the dtype in which speculative and plain greedy decoding agree token for token (in bf16 an
8-token verify pass and eight 1-token steps round differently, see docs/results.md); the drafter in its checkpoint's bf16,
as `from_pretrained` loads it (what it drafts never changes the text, only how fast it comes). The demo prints both
texts, whether they are identical, τ (mean accepted length per verify round, bonus token included), the per-position
acceptance, how many drafts the shipped hardware-aware schedule chose per round, and the speed-up measured in this run,
and exits non-zero if any text differs. The schedule measures the target's verify cost once per machine and dtype (a
few seconds, stored under the Hugging Face cache home; `dspark-hf profile` re-measures it).

    python examples/demo.py [--drafter DIR] [--max-new-tokens 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

DEFAULT_DRAFTER = Path(__file__).resolve().parent / "smollm2-dspark"


def run_demo(target, tokenizer, drafter, prompts: list[list[dict]], max_new_tokens: int = 64, log=print) -> dict:
    """Answer every prompt plainly and with the drafter (same process, alternating); return the comparison."""
    from dspark_hf.evaluation import merged_stats
    from dspark_hf.prompts import encode_prompt
    from dspark_hf.timing import timed_generate

    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    timed_generate(target, encoded[0], 4, False)  # warm-up, not timed
    timed_generate(target, encoded[0], 4, False, assistant_model=drafter)
    plain_tokens = plain_s = spec_tokens = spec_s = 0
    all_identical, stats = True, []
    for messages, inputs in zip(prompts, encoded):
        plain, t_plain = timed_generate(target, inputs, max_new_tokens, False)
        spec, t_spec = timed_generate(target, inputs, max_new_tokens, False, assistant_model=drafter)
        s = drafter.last_generation_stats
        stats.append(s)
        identical = plain.shape == spec.shape and torch.equal(plain, spec)
        all_identical &= identical
        plain_tokens, plain_s, spec_tokens, spec_s = plain_tokens + plain.numel(), plain_s + t_plain, spec_tokens + spec.numel(), spec_s + t_spec
        log(f"\nuser: {messages[-1]['content']}")
        log(f"  plain greedy  ({plain.numel() / t_plain:5.1f} tok/s): {tokenizer.decode(plain, skip_special_tokens=True)!r}")
        log(f"  DSpark        ({spec.numel() / t_spec:5.1f} tok/s): {tokenizer.decode(spec, skip_special_tokens=True)!r}")
        log(f"  identical: {'yes' if identical else 'NO'}   τ = {s.mean_accepted_length:.2f} tokens/round "
            f"over {s.rounds} rounds, {sum(s.drafted) / max(s.rounds, 1):.2f} drafts/round")
    merged = merged_stats(stats)
    result = {
        "identical": bool(all_identical),
        "tau": merged.mean_accepted_length,
        "acceptance_conditional": merged.acceptance_conditional(),
        "acceptance_cumulative": merged.acceptance_cumulative(),
        "rounds": merged.rounds,
        "drafts_per_round": sum(merged.drafted) / max(merged.rounds, 1),
        "drafts_per_round_histogram": [merged.drafted.count(k) for k in range(merged.num_draft_tokens + 1)],
        "lookup_rounds": getattr(merged, "lookup_rounds", 0),  # rounds whose drafts came from prompt lookup
        "plain_tokens_per_s": plain_tokens / max(plain_s, 1e-9),
        "dspark_tokens_per_s": spec_tokens / max(spec_s, 1e-9),
    }
    result["speedup"] = result["dspark_tokens_per_s"] / max(result["plain_tokens_per_s"], 1e-9)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the target's dtype (fp32: the text must be identical; bf16 may drift); the drafter "
                        "keeps its checkpoint's dtype")
    args = parser.parse_args(argv)

    drafter_dir = Path(args.drafter)
    if not (drafter_dir / "config.json").is_file():
        print(f"no drafter at {drafter_dir}; build it with `make drafter`.", file=sys.stderr)
        return 1
    from transformers import AutoModel

    from dspark_hf.assets import load_smollm2
    from dspark_hf.prompts import held_out_prompts
    from dspark_hf.reporting import machine_description

    start = time.perf_counter()
    target, tokenizer = load_smollm2(dtype=args.dtype)
    # the drafter as a user loads it: its checkpoint dtype (bf16), whatever the target's (verification keeps the text
    # the target's own; a bf16 draft round costs half an fp32 one)
    drafter = AutoModel.from_pretrained(str(drafter_dir), trust_remote_code=True).eval()
    prompts = held_out_prompts(["chitchat"], "test", args.num_prompts)
    drafter_dtype = str(drafter.dtype).replace("torch.", "")
    print(f"dspark-hf demo: SmolLM2-135M-Instruct + {drafter_dir.name} ({drafter.config.num_hidden_layers} draft layer(s), "
          f"B = {drafter.config.block_size}), target {args.dtype}, drafter {drafter_dtype}, {len(prompts)} held-out "
          "chitchat prompts (test split)")
    print(f"machine: {machine_description()}")
    schedule = getattr(drafter.generation_config, "dspark_schedule", None) or "fixed"
    print(f"draft schedule: {schedule} (drafts per round chosen from the measured verify cost and the calibrated "
          "confidences)" if schedule == "hardware" else f"draft schedule: {schedule}")
    result = run_demo(target, tokenizer, drafter, prompts, args.max_new_tokens)
    print()
    print(f"texts identical to plain greedy: {'yes' if result['identical'] else 'NO'} ({args.dtype})")
    print(f"τ (mean accepted length, bonus included): {result['tau']:.2f} of {drafter.config.block_size}")
    print("acceptance per position, conditional: " + " ".join(f"{a:.2f}" for a in result["acceptance_conditional"]))
    print("acceptance per position, cumulative : " + " ".join(f"{a:.2f}" for a in result["acceptance_cumulative"]))
    histogram = ", ".join(f"{k}: {n}" for k, n in enumerate(result["drafts_per_round_histogram"]) if n)
    print(f"drafts per round chosen by the schedule: {result['drafts_per_round']:.2f} on average (rounds by drafts: {histogram}; "
          f"{result['lookup_rounds']} of {result['rounds']} rounds verified prompt-lookup drafts)")
    print(f"speed: plain {result['plain_tokens_per_s']:.1f} tok/s, DSpark {result['dspark_tokens_per_s']:.1f} tok/s "
          f"-> {result['speedup']:.2f}× (this run, {args.dtype})")
    print(f"demo wall time {time.perf_counter() - start:.0f} s")
    if not result["identical"]:
        print(f"ERROR: the speculative text differs from plain greedy ({args.dtype})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
