"""`dspark-hf bench`: tokens/s of DSpark against plain `generate` and the other speculative baselines (DESIGN §7–§8).

One process, one target, the same held-out chat prompts (test split) for every method, repetitions interleaved
(rep → prompt → method, the method order rotated each repetition) so a noisy shared machine slows every method
alike. Per method and repetition, tokens/s = new tokens over all prompts / wall time; the table shows the median
over repetitions and its ratio to plain greedy. Methods:

- `plain`: `target.generate` alone.
- `assisted-lm`: transformers' assisted generation with a small same-tokenizer LM, a truncated-depth copy of the
  target (its first `--assistant-layers` decoder layers + final norm + LM head, no training), with transformers'
  default assistant settings (`num_assistant_tokens` 20, heuristic schedule).
- `prompt-lookup`: prompt lookup decoding (`prompt_lookup_num_tokens`).
- `dflash`: a DFlash-only drafter (Markov and confidence heads off) trained with the DSpark drafter's budget.
- `dspark`: the DSpark drafter, fixed block length (B - 1 drafts).
- `dspark-conf`: the DSpark drafter with confidence scheduling (`dspark_confidence_threshold`).

Greedy and T = 1 (`--modes`). Also measured: drafter context update + one parallel block pass + Markov loop as a
fraction of one verify pass (the target's forward of B tokens on a cached context of the same length).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from . import DSparkContextCache
from .data import load_target
from .evaluation import encode_prompt, held_out_prompts, load_drafter, merge_generation_stats, timed_generate
from .reporting import emit_report, machine_description, set_threads

ALL_METHODS = ["plain", "assisted-lm", "prompt-lookup", "dflash", "dspark", "dspark-conf"]


def truncated_assistant(target, num_layers: int):
    """A same-tokenizer small LM: the target's first `num_layers` decoder layers + final norm + LM head (shared
    weights, no training). State it with every result: it is a cheap stand-in for a distilled small model."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    assistant = type(target)(config).to(dtype=target.dtype).eval()
    missing, unexpected = assistant.load_state_dict(target.state_dict(), strict=False)
    unexpected = [k for k in unexpected if not k.startswith("model.layers.")]
    if missing or unexpected:
        raise ValueError(f"truncated assistant does not fit the target: missing {missing[:3]}, unexpected {unexpected[:3]}")
    assistant.generation_config = copy.deepcopy(target.generation_config)
    return assistant


@torch.no_grad()
def drafter_overhead(target, drafter, inputs: dict[str, torch.Tensor], repeats: int = 20, commit: int = 4) -> dict[str, float]:
    """Median time of one drafting round (extend the drafter context by `commit` positions, one parallel pass and the
    Markov loop over B-1 drafts) vs one verify pass (target forward of B tokens on a cache of the same context)."""
    aux_ids = list(drafter.config.aux_hidden_state_layer_ids)
    ids = inputs["input_ids"]
    n = ids.shape[1]
    out = target(input_ids=ids, output_hidden_states=True, use_cache=True)
    aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1).to(drafter.fc.weight.dtype)  # (1, n, m·d)
    cache = DSparkContextCache()
    drafter.extend_context(cache, aux[:, : n - 1 - commit])
    block = drafter.config.block_size
    verify_ids = ids[:, -1:].repeat(1, block)
    target_cache = getattr(out, "cache", None) or out.past_key_values
    draft_times, verify_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        drafter.extend_context(cache, aux[:, n - 1 - commit : n - 1])
        drafter.draft_block(cache, ids[0, -1])
        draft_times.append(time.perf_counter() - start)
        cache.crop(n - 1 - commit)

        start = time.perf_counter()
        target(input_ids=verify_ids, cache=target_cache, use_cache=True, output_hidden_states=aux_ids)
        verify_times.append(time.perf_counter() - start)
        target_cache.crop(-block)  # back to the n context positions
    draft, verify = statistics.median(draft_times), statistics.median(verify_times)
    return {"context_tokens": n, "draft_round_ms": 1e3 * draft, "verify_pass_ms": 1e3 * verify,
            "fraction": draft / verify}


def _method_kwargs(method: str, models: dict[str, Any], args) -> dict[str, Any]:
    if method == "plain":
        return {}
    if method == "assisted-lm":
        return {"assistant_model": models["assistant"]}
    if method == "prompt-lookup":
        return {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}
    return {"assistant_model": models[method]}


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, dtype=args.dtype)
    methods = [m for m in args.methods]
    models: dict[str, Any] = {}
    if "assisted-lm" in methods:
        models["assistant"] = truncated_assistant(target, args.assistant_layers)
    if "dflash" in methods:
        models["dflash"] = load_drafter(args.dflash, target, dtype)
    if "dspark" in methods or "dspark-conf" in methods:
        models["dspark"] = load_drafter(args.model, target, dtype)
        models["dspark"].generation_config.dspark_confidence_threshold = None
    if "dspark-conf" in methods:
        conf = load_drafter(args.model, target, dtype)
        conf.generation_config.dspark_confidence_threshold = args.confidence_threshold
        models["dspark-conf"] = conf

    prompts = held_out_prompts(args.prompts, args.split, args.num_prompts)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    report: dict[str, Any] = {
        "machine": machine_description(), "dtype": args.dtype, "prompts": len(prompts), "split": args.split,
        "max_new_tokens": args.max_new_tokens, "repetitions": args.repetitions,
        "assistant": f"SmolLM2 truncated to its first {args.assistant_layers} of {target.config.num_hidden_layers} "
                     "layers + final norm + LM head (untrained), transformers' default assistant settings",
        "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
        "confidence_threshold": args.confidence_threshold, "modes": {},
    }
    for mode in args.modes:
        do_sample = mode == "sample"
        for m in methods:  # warm-up: one short call each
            timed_generate(target, encoded[0], 8, do_sample, 0, **_method_kwargs(m, models, args))
        tokens = {m: [0] * args.repetitions for m in methods}
        seconds = {m: [0.0] * args.repetitions for m in methods}
        stats = {m: [] for m in methods}
        outputs: dict[int, dict[str, torch.Tensor]] = {}  # first repetition's texts, compared with plain
        for rep in range(args.repetitions):
            order = methods[rep % len(methods):] + methods[: rep % len(methods)]
            for i, inputs in enumerate(encoded):
                for m in order:
                    new, elapsed = timed_generate(target, inputs, args.max_new_tokens, do_sample, 1000 * rep + i,
                                                  **_method_kwargs(m, models, args))
                    tokens[m][rep] += new.numel()
                    seconds[m][rep] += elapsed
                    if m in ("dflash", "dspark", "dspark-conf") and rep == 0:
                        stats[m].append(models[m].last_generation_stats)
                    if rep == 0:
                        outputs.setdefault(i, {})[m] = new
        rows = {}
        for m in methods:
            rates = [t / max(s, 1e-9) for t, s in zip(tokens[m], seconds[m])]
            rows[m] = {"tokens_per_s": statistics.median(rates), "all_tokens_per_s": rates}
        base = rows.get("plain", {}).get("tokens_per_s")
        for m in methods:
            if base:
                rows[m]["speedup_vs_plain"] = rows[m]["tokens_per_s"] / base
            if not do_sample and "plain" in methods:
                rows[m]["identical_to_plain"] = sum(
                    bool(torch.equal(o["plain"], o[m])) if o["plain"].shape == o[m].shape else False for o in outputs.values())
            if stats.get(m):
                merged = merge_generation_stats(stats[m])
                rows[m]["mean_accepted_length"] = merged.mean_accepted_length
                rows[m]["acceptance_conditional"] = merged.acceptance_conditional()
                rows[m]["mean_drafts_per_round"] = sum(merged.drafted) / max(merged.rounds, 1)
        for m in ("dspark", "dspark-conf"):
            if m in rows:
                for other in ("assisted-lm", "prompt-lookup", "dflash"):
                    if other in rows:
                        rows[m][f"speedup_vs_{other}"] = rows[m]["tokens_per_s"] / rows[other]["tokens_per_s"]
        report["modes"][mode] = rows
    if "dspark" in models:
        report["drafter_overhead"] = drafter_overhead(target, models["dspark"], encoded[0] if not args.overhead_context
                                                      else _long_context(tokenizer, encoded, args.overhead_context))
        if "dflash" in models:
            report["dflash_overhead"] = drafter_overhead(target, models["dflash"], encoded[0] if not args.overhead_context
                                                         else _long_context(tokenizer, encoded, args.overhead_context))
    if "dspark" in methods and "dflash" in methods and "greedy" in report["modes"]:
        g = report["modes"]["greedy"]
        report["tau_ratio_dspark_vs_dflash_online"] = g["dspark"]["mean_accepted_length"] / g["dflash"]["mean_accepted_length"]
    return report


def _long_context(tokenizer, encoded, length: int) -> dict[str, torch.Tensor]:
    ids = torch.cat([e["input_ids"] for e in encoded] * (1 + length // sum(e["input_ids"].shape[1] for e in encoded)), dim=1)
    ids = ids[:, :length]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"machine: {report['machine']}", f"dtype: {report['dtype']}   prompts: {report['prompts']} ({report['split']} split)"
             f"   max_new_tokens: {report['max_new_tokens']}   repetitions: {report['repetitions']} (interleaved, median)",
             f"assisted-lm = {report['assistant']}",
             f"prompt-lookup: prompt_lookup_num_tokens={report['prompt_lookup_num_tokens']}; "
             f"dspark-conf: confidence threshold {report['confidence_threshold']}"]
    for mode, rows in report["modes"].items():
        lines += ["", f"[{mode}, {report['dtype']}]",
                  f"{'method':<14}{'tok/s':>8}{'× plain':>9}{'τ live':>8}{'drafts/rd':>10}{'same text':>10}"]
        for m, r in rows.items():
            tau = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
            drafts = f"{r['mean_drafts_per_round']:.2f}" if "mean_drafts_per_round" in r else "-"
            same = f"{r['identical_to_plain']}/{report['prompts']}" if "identical_to_plain" in r else "-"
            lines.append(f"{m:<14}{r['tokens_per_s']:>8.1f}{r.get('speedup_vs_plain', float('nan')):>9.2f}{tau:>8}{drafts:>10}{same:>10}")
        for m in ("dspark", "dspark-conf"):
            if m in rows:
                ratios = ", ".join(f"{k[len('speedup_vs_'):]} ×{v:.2f}" for k, v in rows[m].items()
                                   if k.startswith("speedup_vs_") and k != "speedup_vs_plain")
                if ratios:
                    lines.append(f"{m} vs: {ratios}")
    for key in ("drafter_overhead", "dflash_overhead"):
        o = report.get(key)
        if o:
            lines.append(f"\n{key.replace('_', ' ')} ({report['dtype']}, context {o['context_tokens']} tokens): "
                         f"drafting round {o['draft_round_ms']:.2f} ms vs verify pass {o['verify_pass_ms']:.2f} ms "
                         f"= {o['fraction']:.1%}")
    if "tau_ratio_dspark_vs_dflash_online" in report:
        lines.append(f"online τ DSpark / DFlash-only (greedy): {report['tau_ratio_dspark_vs_dflash_online']:.3f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="examples/smollm2-dspark", help="DSpark drafter directory")
    parser.add_argument("--dflash", default="examples/smollm2-dflash", help="DFlash-only baseline drafter directory")
    parser.add_argument("--target", default="smollm2", help="target path or Hub id (default: the offline SmolLM2)")
    parser.add_argument("--methods", nargs="+", default=ALL_METHODS, choices=ALL_METHODS)
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"],
                        help="decoding modes (sample = T=1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", nargs="+", default=["chitchat"], help="prompt sources (chitchat, chatterbot, JSONL)")
    parser.add_argument("--split", default="test", choices=["train", "validation", "test", "all"])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--assistant-layers", type=int, default=4, help="depth of the truncated small-LM assistant")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10)
    parser.add_argument("--confidence-threshold", type=float, default=0.1, help="survival threshold of dspark-conf")
    parser.add_argument("--overhead-context", type=int, default=0,
                        help="context length of the overhead measurement (default: the first prompt)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="also write the report as JSON (file or '-')")


def run(args: argparse.Namespace) -> int:
    emit_report(benchmark(args), args.json, format_report)
    return 0


__all__ = ["ALL_METHODS", "benchmark", "drafter_overhead", "format_report", "truncated_assistant"]
