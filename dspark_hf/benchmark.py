"""`dspark-hf bench`: tokens/s of DSpark against plain `generate` and the other speculative baselines (docs/design.md §7–§8).

One process, one target, the same held-out chat prompts (test split) for every method, repetitions interleaved
(rep → prompt → method, the method order rotated each repetition) so a noisy shared machine slows every method
alike. Per method and repetition, tokens/s = new tokens over all prompts / wall time; the table shows the median
over repetitions and its ratio to plain greedy, and the same ratio for decoding alone ("decode ×": tokens after the
first over the time after the first token arrived). The prefill is the same target forward for every method, so
it dilutes whole-call ratios by prompt length, and at T = 1, where each method samples answers of other lengths,
it weighs differently per method; the decode ratio is the speed-up of what speculative decoding changes. Methods:

- `plain`: `target.generate` alone.
- `plain-reseeded` (on request): `plain` again, sampling from other seeds: the noise floor of a cell, how far the
  ratio moves when nothing changes but the machine's jitter (greedy) and, at T = 1, the sampled answers (their
  lengths and contexts; with a few prompts that alone moves a T = 1 cell by several per cent).
- `assisted-lm`: transformers' assisted generation with a small same-tokenizer LM, a truncated-depth copy of the
  target (its first `--assistant-layers` decoder layers + final norm + LM head, no training), with transformers'
  default assistant settings (`num_assistant_tokens` 20, heuristic schedule).
- `prompt-lookup`: prompt lookup decoding (`prompt_lookup_num_tokens`).
- `dflash`: a DFlash-only drafter (Markov and confidence heads off) trained with the DSpark drafter's budget.
- `dspark-fixed`: the DSpark drafter, fixed block length (B - 1 drafts every round).
- `dspark`: the DSpark drafter as shipped: its generation config's schedule decides how many drafts each round
  verifies (the hardware-aware schedule of the default drafter, possibly none).
- `dspark-conf`: the DSpark drafter with a survival threshold (`dspark_confidence_threshold`), on request.
- `dspark-packed`: batches only, on request: `dspark` with each round verified packed, each row's own tokens and its
  own draft length (`dspark_packed_verification = True`), against the padded rounds of `dspark`.

Each `--prompts` entry is a domain (chat, instructions, code, long multi-turn chats, a held-out corpus), measured and
reported on its own, since a drafter is fast only where its training data reaches. Greedy and T = 1 (`--modes`). Also measured: drafter context update + one parallel block pass + Markov loop as a
fraction of one verify pass (the target's forward of B tokens on a cached context of the same length).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import DSparkContextCache
from .evaluation import (add_drafter_dtype_argument, drafter_dtype_argument, drafter_dtype_of, drafter_name,
                         live_acceptance_over_calls, live_curve, load_drafter, plot_acceptance)
from .flags import non_negative_int, positive_int, probability
from .progress import add_progress_argument, progress as progress_bar
from .prompts import domain_prompts, encode_batches, encode_prompt, long_context
from .reporting import emit_report, machine_description, set_threads
from .targets import add_target_argument, load_target, resolve_target
from .timing import timed_batch_generation, timed_generation

ALL_METHODS = ["plain", "plain-reseeded", "assisted-lm", "prompt-lookup", "dflash", "dspark-fixed", "dspark", "dspark-conf",
               "dspark-packed"]
RESEEDED_SEED_OFFSET = 500_000  # plain-reseeded samples with seeds no other method uses
DEFAULT_METHODS = ["plain", "assisted-lm", "prompt-lookup", "dflash", "dspark-fixed", "dspark"]
ONE_ROW_METHODS = ["assisted-lm", "prompt-lookup"]  # transformers serves these one prompt at a time
# The CPU instruction sets a run can be held to (read by ATen, oneDNN and MKL when they start, so each runs in a
# process of its own): "avx2" shows this machine as a CPU without AVX512 and bf16 matrix units.
ISA_CAPS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


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
    if method in ("plain", "plain-reseeded"):
        return {}
    if method == "assisted-lm":
        return {"assistant_model": models["assistant"]}
    if method == "prompt-lookup":
        return {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}
    return {"assistant_model": models[method]}


def load_methods(args, target, dtype) -> tuple[list[str], dict[str, Any]]:
    """The methods to run and the models they need. `dspark` keeps the drafter's shipped generation config (its
    schedule); `dspark-fixed` always drafts the whole block; `dspark-conf` uses a survival threshold."""
    methods = [m for m in args.methods if m != "dflash" or args.dflash]  # the DFlash baseline runs when given
    if args.batch_size > 1:
        methods = [m for m in methods if m not in ONE_ROW_METHODS]
    models: dict[str, Any] = {}
    if "assisted-lm" in methods:
        models["assistant"] = truncated_assistant(target, args.assistant_layers)
    if "dflash" in methods:
        models["dflash"] = load_drafter(args.dflash, target, dtype, flag="--dflash")
    if "dspark" in methods:
        models["dspark"] = load_drafter(args.model, target, dtype)
    if "dspark-fixed" in methods:
        models["dspark-fixed"] = fixed_length(load_drafter(args.model, target, dtype))
    if "dspark-conf" in methods:
        conf = fixed_length(load_drafter(args.model, target, dtype))
        conf.generation_config.dspark_confidence_threshold = args.confidence_threshold
        models["dspark-conf"] = conf
    if "dspark-packed" in methods:
        models["dspark-packed"] = packed = load_drafter(args.model, target, dtype)
        packed.generation_config.dspark_packed_verification = True
    return methods, models


def fixed_length(drafter):
    """The drafter with every schedule off: each round proposes the whole block."""
    for knob in ("dspark_confidence_threshold", "dspark_verify_cost", "dspark_schedule"):
        setattr(drafter.generation_config, knob, None)
    return drafter


def _length(args) -> dict[str, None]:
    """`--fixed-length`: every answer runs to max_new_tokens with EOS off, so at T = 1 each method decodes the same
    number of tokens at the same context lengths instead of answers of the lengths its own samples happened to take.
    EOS off rather than `min_new_tokens`: no logits processor is added, so no method pays for one."""
    return {"eos_token_id": None} if args.fixed_length else {}


def run_methods(target, encoded, methods, models, args, do_sample: bool) -> dict[str, dict[str, Any]]:
    """Every method on every prompt (or batch of prompts, `--batch-size`), repetitions interleaved (rep → prompt →
    method, order rotated each rep)."""
    timed_call = timed_batch_generation if args.batch_size > 1 else timed_generation
    for m in methods:  # warm-up: one short call each
        timed_call(target, encoded[0], 8, do_sample, 0, **_method_kwargs(m, models, args))
    counters = ("tokens", "seconds", "decode_tokens", "decode_seconds")
    runs = {m: {**{c: [0] * args.repetitions for c in counters}, "stats": [], "outputs": []} for m in methods}
    bar = progress_bar(total=args.repetitions * len(encoded) * len(methods), unit="call",
                       desc=f"bench {'sample' if do_sample else 'greedy'}", enabled=not getattr(args, "no_progress", False))
    for rep in range(args.repetitions):
        order = methods[rep % len(methods):] + methods[: rep % len(methods)]
        for i, inputs in enumerate(encoded):
            for m in order:
                seed = 1000 * rep + i + (RESEEDED_SEED_OFFSET if m == "plain-reseeded" else 0)
                timed = timed_call(target, inputs, args.max_new_tokens, do_sample, seed, **_length(args),
                                   **_method_kwargs(m, models, args))
                for c, value in zip(counters, (timed.tokens.numel(), timed.seconds, timed.decode_tokens, timed.decode_seconds)):
                    runs[m][c][rep] += value
                if rep == 0:
                    runs[m]["outputs"].append(timed.tokens)
                    if m in models and hasattr(models[m], "last_generation_stats"):
                        runs[m]["stats"].append(models[m].last_generation_stats)
                bar.update(1)
    bar.close()
    return runs


def summarize_runs(runs: dict[str, dict[str, Any]], do_sample: bool) -> dict[str, dict[str, Any]]:
    """Median tokens/s per method, ratios to plain and to the other baselines, identical texts, live acceptance."""
    rows = {}
    for m, run in runs.items():
        rates = [t / max(s, 1e-9) for t, s in zip(run["tokens"], run["seconds"])]
        decode_rates = [t / max(s, 1e-9) for t, s in zip(run["decode_tokens"], run["decode_seconds"])]
        rows[m] = {"tokens_per_s": statistics.median(rates), "all_tokens_per_s": rates,
                   "decode_tokens_per_s": statistics.median(decode_rates), "all_decode_tokens_per_s": decode_rates}
        if run["stats"]:
            rows[m].update(live_acceptance_over_calls(run["stats"]))
    for m, row in rows.items():
        if "plain" in rows:
            row["speedup_vs_plain"] = row["tokens_per_s"] / rows["plain"]["tokens_per_s"]
            row["decode_speedup_vs_plain"] = row["decode_tokens_per_s"] / rows["plain"]["decode_tokens_per_s"]
            if not do_sample:
                row["identical_to_plain"] = sum(bool(a.shape == b.shape and torch.equal(a, b))
                                                for a, b in zip(runs["plain"]["outputs"], runs[m]["outputs"]))
        if m.startswith("dspark"):
            for other in ("assisted-lm", "prompt-lookup", "dflash"):
                if other in rows:
                    row[f"speedup_vs_{other}"] = row["tokens_per_s"] / rows[other]["tokens_per_s"]
    return rows


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    target, tokenizer = load_target(resolve_target(args.target, args.model), dtype=args.dtype)
    methods, models = load_methods(args, target, drafter_dtype_argument(args))
    drafters = [models[m] for m in methods if m.startswith(("dspark", "dflash"))]
    report: dict[str, Any] = {
        "machine": machine_description(), "dtype": args.dtype, "split": args.split,
        "drafter_dtype": drafter_dtype_of(drafters[0]) if drafters else args.drafter_dtype,
        "max_new_tokens": args.max_new_tokens, "fixed_length": args.fixed_length, "batch_size": args.batch_size,
        "repetitions": args.repetitions, "drafter": drafter_name(args.model),
        "assistant": f"{target.name_or_path} truncated to its first {args.assistant_layers} of {target.config.num_hidden_layers} "
                     "layers + final norm + LM head (untrained), transformers' default assistant settings",
        "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
        "confidence_threshold": args.confidence_threshold, "domains": {},
    }
    first_prompt = None
    for spec in args.prompts:
        prompts = domain_prompts(spec, args.split, args.num_prompts)
        first_prompt = first_prompt or encode_prompt(tokenizer, prompts[0])
        calls = encode_batches(tokenizer, prompts, args.batch_size) if args.batch_size > 1 else [
            encode_prompt(tokenizer, p) for p in prompts]
        modes = {mode: summarize_runs(run_methods(target, calls, methods, models, args, mode == "sample"), mode == "sample")
                 for mode in args.modes}
        report["domains"][spec] = {"prompts": len(prompts), "calls": len(calls), "modes": modes}
    for name, key in (("dspark", "dspark"), ("dspark-fixed", "dspark"), ("dflash", "dflash")):  # one per drafter
        if name in models and f"{key}_overhead" not in report:
            context = long_context([first_prompt], args.overhead_context) if args.overhead_context else first_prompt
            report[f"{key}_overhead"] = drafter_overhead(target, models[name], context)
    if args.plots and "dspark" in methods:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        report["plots"] = {"acceptance": plot_domain_acceptance(Path(args.plots) / "acceptance.png", report)}
    return report


def plot_domain_acceptance(path, report: dict[str, Any], method: str = "dspark") -> str:
    """The live acceptance of `method`, one curve per domain and mode of the report."""
    curves = {}
    for domain, result in report["domains"].items():
        for mode, rows in result["modes"].items():
            if "acceptance_conditional" in rows.get(method, {}):
                curves[f"{Path(domain).name}, {mode}"] = live_curve(rows[method])
    return plot_acceptance(path, curves, f"{report['drafter']}, live acceptance ({report['dtype']})")


def format_report(report: dict[str, Any]) -> str:
    lines = [f"machine: {report['machine']}", f"drafter: {report['drafter']}",
             f"dtype: {report['dtype']} (drafters: {report.get('drafter_dtype', report['dtype'])})   "
             f"max_new_tokens: {report['max_new_tokens']}{' (fixed length, EOS off)' if report.get('fixed_length') else ''}"
             f"   repetitions: {report['repetitions']} (interleaved, median)   batch size: {report.get('batch_size', 1)}"
             f"{' (left-padded; one-row methods left out; whole calls, no decode split)' if report.get('batch_size', 1) > 1 else ''}",
             f"assisted-lm = {report['assistant']}",
             f"prompt-lookup: prompt_lookup_num_tokens={report['prompt_lookup_num_tokens']}; "
             f"dspark-conf: confidence threshold {report['confidence_threshold']}"]
    for domain, result in report["domains"].items():
        for mode, rows in result["modes"].items():
            lines += ["", f"[{domain}: {result['prompts']} prompts, {mode}, {report['dtype']}]",
                      f"{'method':<14}{'tok/s':>8}{'× plain':>9}{'decode ×':>10}{'τ live':>8}{'drafts/rd':>10}"
                      f"{'same text':>10}{'c_n said/seen':>15}"]
            for m, r in rows.items():
                tau = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
                drafts = f"{r['mean_drafts_per_round']:.2f}" if "mean_drafts_per_round" in r else "-"
                same = f"{r['identical_to_plain']}/{result.get('calls', result['prompts'])}" if "identical_to_plain" in r else "-"
                # the schedule's (recalibrated) confidence against the survival verification then observed
                live = (f"{r['live_confidence_mean']:.2f}/{r['live_acceptance_rate']:.2f}"
                        if "live_confidence_mean" in r else "-")
                widths = batch_round_summary(r) + price_summary(r)
                lines.append(f"{m:<14}{r['tokens_per_s']:>8.1f}{r.get('speedup_vs_plain', float('nan')):>9.2f}"
                             f"{r.get('decode_speedup_vs_plain', float('nan')):>10.2f}{tau:>8}{drafts:>10}{same:>10}{live:>15}"
                             f"{widths}")
    lines += ["", "summary: DSpark (shipped generation config) × plain generate per domain", *summary_table(report)]
    for key in ("dspark_overhead", "dflash_overhead"):
        o = report.get(key)
        if o:
            lines.append(f"\n{key.replace('_', ' ')} ({report['dtype']}, context {o['context_tokens']} tokens): "
                         f"drafting round {o['draft_round_ms']:.2f} ms vs verify pass {o['verify_pass_ms']:.2f} ms "
                         f"= {o['fraction']:.1%}")
    return "\n".join(lines)


def batch_round_summary(row: dict[str, Any]) -> str:
    """Batched: what the schedule chose per round (widest row, plain steps), the per-row draft lengths (row-rounds
    verifying 0, 1, ... drafts), the tokens verified against padding every row to the widest, and the prompt tokens
    the prefill ran against left padding."""
    if "mean_width" not in row:
        return ""
    text = f"   width {row['mean_width']:.2f}, plain steps {row['plain_step_share']:.0%}"
    text += f", row lengths {'/'.join(map(str, row['drafts_per_round_histogram']))}"
    if "verified_tokens" in row:
        text += (f", verified {row['verified_tokens']} of {row['padded_tokens']} padded tokens "
                 f"({'packed' if row['packed'] else 'padded'})")
    if "prefill_tokens" in row:
        text += f", prefill {row['prefill_tokens']} of {row['prefill_padded_tokens']} padded tokens"
    return text


def price_summary(row: dict[str, Any]) -> str:
    """The hardware schedule's price of its rounds against what they took (medians of priced / measured seconds, for
    plain steps and drafted rounds): a price that follows noise drafts where it does not pay."""
    parts = [f"{name} {row[f'{name}_price_ratio']:.2f} ({row[f'{name}_rounds_priced']})"
             for name in ("plain", "drafted") if f"{name}_price_ratio" in row]
    return f"   priced/took: {', '.join(parts)}" if parts else ""


def summary_table(report: dict[str, Any], method: str = "dspark") -> list[str]:
    """One Markdown row per domain: × plain (whole calls, and decoding after the prefill) and live τ of `method` in
    each mode (the README/model-card table)."""
    modes = list(next(iter(report["domains"].values()))["modes"]) if report["domains"] else []
    header = "| domain | " + " | ".join(f"{m} × plain | {m} decode × plain | {m} τ | {m} drafts/round" for m in modes) + " |"
    rows = [header, "|" + "---|" * (1 + 4 * len(modes))]
    for domain, result in report["domains"].items():
        cells = []
        for mode in modes:
            r = result["modes"][mode].get(method, {})
            cells += [f"{r['speedup_vs_plain']:.2f}" if "speedup_vs_plain" in r else "-",
                      f"{r['decode_speedup_vs_plain']:.2f}" if "decode_speedup_vs_plain" in r else "-",
                      f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-",
                      f"{r['mean_drafts_per_round']:.2f}" if "mean_drafts_per_round" in r else "-"]
        rows.append(f"| {domain} | " + " | ".join(cells) + " |")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="DSpark drafter directory (e.g. examples/smollm2-dspark)")
    parser.add_argument("--dflash", default=None,
                        help="DFlash-only baseline drafter directory (e.g. examples/smollm2-dflash); the dflash method runs only when given")
    add_target_argument(parser, from_drafter=True)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=ALL_METHODS,
                        help="dspark = the drafter's shipped generation config (its schedule); dspark-fixed = whole "
                        "blocks; dspark-conf = survival threshold (default: all but dspark-conf)")
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"],
                        help="decoding modes (sample = T=1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the target's dtype")
    add_drafter_dtype_argument(parser)
    parser.add_argument("--prompts", nargs="+", default=["chitchat"], metavar="SOURCE[:SPLIT[:TURNS]]",
                        help="one domain per entry, each reported on its own: a corpus (chitchat, chatterbot, "
                        "wordnet-nouns, stdlib-explain, chitchat-long, humaneval, ...) or a JSONL file; SPLIT overrides "
                        "--split (use all for a corpus never trained on), TURNS > 1 keeps that many user turns of history")
    parser.add_argument("--split", default="test", choices=["train", "validation", "test", "all"])
    parser.add_argument("--num-prompts", type=positive_int, default=6)
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="prompts per generate call, left-padded (batched speculation; default: one at a time)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--fixed-length", action="store_true",
                        help="every answer runs to --max-new-tokens (EOS off): at T = 1 methods then decode the "
                        "same number of tokens at the same context lengths (answers of the lengths each method's own "
                        "samples took move a few-prompt cell by several per cent)")
    parser.add_argument("--assistant-layers", type=positive_int, default=4, help="depth of the truncated small-LM assistant")
    parser.add_argument("--prompt-lookup-tokens", type=positive_int, default=10)
    parser.add_argument("--confidence-threshold", type=probability, default=0.1, help="survival threshold of dspark-conf")
    parser.add_argument("--overhead-context", type=non_negative_int, default=0,
                        help="context length of the overhead measurement (default: the first prompt)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--plots", help="directory for acceptance.png (per-domain conditional and cumulative acceptance)")
    parser.add_argument("--isa", nargs="+", default=["native"], choices=list(ISA_CAPS),
                        help="run the bench once per CPU instruction set, side by side: native, and avx2 (this CPU "
                        "held to AVX2, without AVX512 or bf16 matrix units, as most laptops and many cloud VMs are)")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="also write the report as JSON (file or '-')")
    add_progress_argument(parser)


def benchmark_per_isa(args: argparse.Namespace) -> dict[str, Any]:
    """The whole bench once per `--isa`, each in a process of its own with that ISA cap, reported side by side."""
    reports = {}
    for isa in args.isa:
        env = {name: value for name, value in os.environ.items() if name not in ISA_CAPS["avx2"]}
        env.update(ISA_CAPS[isa])
        with tempfile.TemporaryDirectory() as folder:
            settings, output = Path(folder) / "args.json", Path(folder) / "report.json"
            settings.write_text(json.dumps({**vars(args), "isa": [isa], "json": str(output)}))
            subprocess.run([sys.executable, "-m", "dspark_hf.benchmark", str(settings)], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            reports[isa] = json.loads(output.read_text())
    return {"isa": reports}


def format_isa_report(report: dict[str, Any]) -> str:
    """Each ISA's tables, then DSpark × plain per domain and mode with the ISAs side by side."""
    reports = report["isa"]
    lines = [f"=== ISA {isa} ===\n{format_report(r)}\n" for isa, r in reports.items()]
    lines.append("DSpark (shipped generation config) × plain generate, per ISA:")
    lines.append("| domain | mode | " + " | ".join(f"{isa} × plain" for isa in reports) + " |")
    lines.append("|" + "---|" * (2 + len(reports)))
    first = next(iter(reports.values()))
    for domain, result in first["domains"].items():
        for mode in result["modes"]:
            cells = [reports[isa]["domains"][domain]["modes"][mode].get("dspark", {}).get("speedup_vs_plain") for isa in reports]
            lines.append(f"| {domain} | {mode} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    lines += [f"{isa}: {r['machine']}" for isa, r in reports.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.isa != ["native"]:
        emit_report(benchmark_per_isa(args), args.json, format_isa_report)
        return 0
    emit_report(benchmark(args), args.json, format_report)
    return 0


if __name__ == "__main__":  # one ISA's run of `benchmark_per_isa`: the settings come as a JSON file
    settings = argparse.Namespace(**json.loads(Path(sys.argv[1]).read_text()))
    emit_report(benchmark(settings), settings.json, format_report)


__all__ = ["ALL_METHODS", "benchmark", "drafter_overhead", "format_report", "plot_domain_acceptance", "summary_table",
           "truncated_assistant"]
