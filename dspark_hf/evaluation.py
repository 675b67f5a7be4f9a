"""`dspark-hf eval`: how good a drafter is, offline and online (docs/design.md §7).

Three views of the same drafter:

- **offline** (teacher-forced on a hidden-state cache): for every valid anchor the drafter's Markov-corrected q_k is
  compared with the target's p_k (both restricted to the draft vocabulary, teacher-forced with the data tokens as
  previous tokens); 1 - TV_k is the acceptance of draft k given the drafts before it. τ = mean over blocks of
  1 + Σ_k Π_{i≤k} (1 - TV_i), "out of B" — the Kimi-K2.6 DSpark card's definitions (docs/design.md §3), so the numbers
  are comparable with it. Computed with `dspark_hf.metrics`, the functions training reports with. Greedy τ puts
  1 where the drafter's argmax is the target's in place of 1 - TV_k (on a corpus of the target's greedy answers the
  data tokens are the ones greedy decoding would have accepted).
- **online** (real `target.generate(..., assistant_model=drafter)` on held-out chat prompts, the test split):
  mean accepted length per verify round including the bonus token, cumulative and conditional per-position
  acceptance, the accepted-length histogram, and tokens/s next to plain `generate` on the same prompts in the same
  process; greedy and T = 1.
- **calibration** of the confidence head on held-out rollouts (`dspark_hf.calibration`): per-position ECE, AUC and
  Brier of the predicted prefix survival, before (T = 1) and after the checkpoint's STS temperatures, with a
  reliability-diagram PNG.

`--json` prints one JSON document for machines; otherwise tables for people. PNGs go to `--plots`.

`bench` measures with the same pieces, through this public surface: `load_drafter`, `drafter_name`,
`live_acceptance_over_calls`, `live_curve` and `plot_acceptance`; the prompts come from `dspark_hf.prompts` and the
timed `generate` calls from `dspark_hf.timing`, for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from . import DSparkConfig, DSparkForDrafting
from .cache import HiddenStateCache
from .calibration import calibration_report, survival_predictions
from .flags import non_negative_int, positive_int, probability
from .metrics import brier_score, per_position_acceptance, survival, tau
from .progress import add_progress_argument, progress as progress_bar
from .prompts import DEFAULT_PROMPT_SOURCES, encode_batches, encode_prompt, held_out_prompts
from .remote_code.generation_dspark import PER_ROUND_STATS, SUMMED_STATS, DSparkGenerationStats
from .remote_code.settings_dspark import DSparkDraftingSettings, prepare_drafter
from .reporting import emit_report, machine_description, set_threads
from .rollouts import offline_acceptance, rollouts_from_blocks
from .targets import add_target_argument, check_drafter_dir, load_target, resolve_target
from .timing import timed_batch_generation, timed_generate


# ---------------------------------------------------------------------------------------------------- offline
def offline_metrics(accept: torch.Tensor, mask: torch.Tensor, block_size: int) -> dict[str, Any]:
    """τ (out of B), τ/B, per-position conditional acceptance (mean 1 - TV_k) and mean cumulative survival."""
    t = tau(accept, mask)
    reached = torch.cumprod(mask.float(), dim=-1)
    cumulative = (survival(accept, mask).sum(0) / reached.sum(0).clamp(min=1)).tolist()
    return {
        "blocks": int(accept.shape[0]),
        "tau": t,
        "tau_over_B": t / block_size,
        "block_size": block_size,
        "acceptance": per_position_acceptance(accept, mask).tolist(),
        "acceptance_cumulative": cumulative,
        "blocks_per_position": reached.sum(0).long().tolist(),
    }


# ---------------------------------------------------------------------------------------------------- calibration
def calibration_metrics(confidence_logits: torch.Tensor, accept: torch.Tensor, mask: torch.Tensor,
                        temperatures: list[float], draws: int = 8, seed: int = 0) -> dict[str, Any]:
    """ECE/AUC/Brier of predicted survival vs sampled survival events, before (T = 1) and after STS."""
    N = accept.shape[1]
    rollouts = rollouts_from_blocks(confidence_logits, accept, mask, draws, seed)
    survived = rollouts.survived
    out: dict[str, Any] = {"temperatures": list(temperatures)}
    for name, temps in (("before", [1.0] * N), ("after", list(temperatures))):
        report = calibration_report(rollouts, temps)
        predicted_all = survival_predictions(rollouts, temps)
        reach = rollouts.reachable()
        brier, bins = [], []
        for k in range(N):
            predicted = predicted_all[reach[:, k], k][:, None].expand(-1, draws).reshape(-1)
            observed = survived[reach[:, k]][:, :, k].reshape(-1).float()
            brier.append(brier_score(predicted, observed) if predicted.numel() else float("nan"))
            bins.append(reliability_bins(predicted, observed))
        report["brier"] = brier
        report["reliability"] = bins
        out[name] = report
    return out


def reliability_bins(predicted: torch.Tensor, observed: torch.Tensor, num_bins: int = 10) -> list[list[float]]:
    """[mean predicted, mean observed, count] per non-empty equal-width bin."""
    if predicted.numel() == 0:
        return []
    index = torch.clamp((predicted * num_bins).long(), max=num_bins - 1)
    rows = []
    for b in range(num_bins):
        sel = index == b
        if sel.any():
            rows.append([float(predicted[sel].mean()), float(observed[sel].mean()), int(sel.sum())])
    return rows


# ---------------------------------------------------------------------------------------------------- online
def online_metrics(target, tokenizer, drafter, prompts: list[list[dict]], max_new_tokens: int = 96,
                   do_sample: bool = False, seed: int = 0, warmup: bool = True, progress: bool = True,
                   batch_size: int = 1) -> dict[str, Any]:
    """Plain generate vs generate with the drafter on each prompt (or each left-padded batch of `batch_size`
    prompts), alternating, same process; `progress`: a bar over the calls, else log lines."""
    device = next(target.parameters()).device
    calls, generate = _online_calls(target, tokenizer, prompts, max_new_tokens, do_sample, batch_size, device)
    if warmup:
        generate(calls[0], seed)
        generate(calls[0], seed, assistant_model=drafter)
    plain_tokens = plain_time = spec_tokens = spec_time = 0.0
    stats, identical = [], []
    unit = "prompt" if batch_size == 1 else "batch"
    bar = progress_bar(calls, desc=f"eval {'sample' if do_sample else 'greedy'}", unit=unit, enabled=progress)
    for i, inputs in enumerate(bar):
        plain, t_plain = generate(inputs, seed + i)
        spec, t_spec = generate(inputs, seed + i, assistant_model=drafter)
        stats.append(drafter.last_generation_stats)
        plain_tokens, plain_time = plain_tokens + plain.numel(), plain_time + t_plain
        spec_tokens, spec_time = spec_tokens + spec.numel(), spec_time + t_spec
        identical.append(bool(plain.shape == spec.shape and torch.equal(plain, spec)))
    merged = merged_stats(stats)
    summary = {**merged.to_dict(), **live_acceptance(merged)}
    summary.update(
        mode="sampling T=1" if do_sample else "greedy",
        prompts=len(prompts),
        batch_size=batch_size,
        plain_tokens_per_s=plain_tokens / max(plain_time, 1e-9),
        dspark_tokens_per_s=spec_tokens / max(spec_time, 1e-9),
    )
    summary["speedup"] = summary["dspark_tokens_per_s"] / max(summary["plain_tokens_per_s"], 1e-9)
    summary["draft_fraction_of_verify"] = (merged.draft_time_s / max(merged.rounds, 1)) / max(
        merged.verify_time_s / max(merged.rounds + len(prompts), 1), 1e-9)
    if not do_sample:
        summary["identical_to_plain"] = f"{sum(identical)}/{len(identical)}"
    return summary


def _online_calls(target, tokenizer, prompts, max_new_tokens: int, do_sample: bool, batch_size: int, device):
    """The generate calls' inputs (one prompt each, or left-padded batches) and how one is timed: (new tokens,
    seconds); a batch's new tokens are every row's up to its EOS, as `bench --batch-size` counts them."""
    if batch_size == 1:
        def generate(inputs, seed, **kwargs):
            return timed_generate(target, inputs, max_new_tokens, do_sample, seed, **kwargs)

        return [encode_prompt(tokenizer, p, device) for p in prompts], generate

    def generate_batch(inputs, seed, **kwargs):
        timed = timed_batch_generation(target, inputs, max_new_tokens, do_sample, seed, **kwargs)
        return timed.tokens, timed.seconds

    return encode_batches(tokenizer, prompts, batch_size, device), generate_batch


def live_acceptance(stats) -> dict[str, Any]:
    """Live τ, drafts per round and per-position acceptance, each with the number of rounds it rests on."""
    drafted, accepted, N = stats.drafted, stats.accepted, stats.num_draft_tokens
    proposed = [sum(d >= k for d in drafted) for k in range(1, N + 1)]
    reached = [sum(d >= k and a >= k - 1 for a, d in zip(accepted, drafted)) for k in range(1, N + 1)]
    # drafts verification reached: the drafter's own (prompt-lookup drafts have no confidence); older remote code
    # counted none, and drafted nothing but its own
    verified = getattr(stats, "confidence_verified", None)
    if verified is None:
        verified = sum(min(d, a + 1) for a, d in zip(accepted, drafted))
    live_calibration = {}
    if verified and getattr(stats, "confidence_predicted", 0.0):  # the hardware schedule's recalibrated confidences
        live_calibration = {"live_confidence_mean": stats.confidence_predicted / verified,
                            "live_acceptance_rate": stats.confidence_observed / verified}
    if getattr(stats, "widths", None):  # batched generation: the width the schedule chose for each batch round
        live_calibration.update(batch_rounds=len(stats.widths), mean_width=sum(stats.widths) / len(stats.widths),
                                plain_step_share=sum(w == 0 for w in stats.widths) / len(stats.widths))
    if getattr(stats, "verified_tokens", None):  # ... and the tokens its rounds verified, against padding to the widest
        live_calibration.update(packed=stats.packed, verified_tokens=sum(stats.verified_tokens),
                                padded_tokens=sum(stats.padded_tokens()))
    if getattr(stats, "prefill_padded_tokens", 0):  # ... and the prompt tokens its prefill ran, against left padding
        live_calibration.update(prefill_tokens=stats.prefill_tokens, prefill_padded_tokens=stats.prefill_padded_tokens)
    for with_drafts, name in ((False, "plain"), (True, "drafted")):  # the schedule's price of a round against its time
        ratios = [price / took for d, price, took in getattr(stats, "round_prices", ()) if d == with_drafts and took > 0]
        if ratios:
            live_calibration.update({f"{name}_price_ratio": statistics.median_high(ratios), f"{name}_rounds_priced": len(ratios)})
    if getattr(stats, "lookup_rounds", 0):
        live_calibration.update(lookup_rounds=stats.lookup_rounds, lookup_drafted=stats.lookup_drafted,
                                lookup_accepted=stats.lookup_accepted)
    return {
        **live_calibration,
        "rounds": stats.rounds,
        "mean_accepted_length": stats.mean_accepted_length,
        "mean_drafts_per_round": sum(drafted) / max(stats.rounds, 1),
        "drafts_per_round_histogram": [sum(d == k for d in drafted) for k in range(N + 1)],
        "acceptance_conditional": stats.acceptance_conditional(),
        "acceptance_conditional_rounds": reached,
        "acceptance_cumulative": stats.acceptance_cumulative(),
        "acceptance_cumulative_rounds": proposed,
    }


def merged_stats(stats_list) -> DSparkGenerationStats:
    """One record over several generate calls' `last_generation_stats`: rounds concatenated, times and counters
    summed."""
    merged = DSparkGenerationStats(num_draft_tokens=stats_list[0].num_draft_tokens)
    for stats in stats_list:
        for name in PER_ROUND_STATS:
            getattr(merged, name).extend(getattr(stats, name))
        for name in SUMMED_STATS:
            setattr(merged, name, getattr(merged, name) + getattr(stats, name))
        merged.packed = stats.packed if merged.packed is None else merged.packed
    return merged


def live_acceptance_over_calls(stats_list) -> dict[str, Any]:
    """`live_acceptance` of several generate calls taken together (their stats merged): one drafter's live numbers
    over a set of prompts, reported alike by `eval` and `bench`."""
    return live_acceptance(merged_stats(stats_list))


def live_curve(live: dict[str, Any]) -> dict[str, list]:
    """The `plot_acceptance` curve of `live_acceptance`'s numbers, each point with the rounds it rests on: `eval`'s
    online modes and `bench`'s domains draw the same two panels."""
    return {"conditional": live["acceptance_conditional"], "conditional_n": live["acceptance_conditional_rounds"],
            "cumulative": live["acceptance_cumulative"], "cumulative_n": live["acceptance_cumulative_rounds"]}


# ---------------------------------------------------------------------------------------------------- plots
FEW_BLOCKS = 20  # a point resting on fewer blocks is drawn hollow: noise, not a result


def plot_acceptance(path: str | os.PathLike, curves: dict[str, dict[str, list]], title: str) -> str:
    """Two panels, conditional P(draft k accepted | drafts before it accepted) and cumulative P(drafts 1..k all
    accepted); each point is labelled with the number of blocks it rests on, hollow below FEW_BLOCKS. One drawing for
    `eval` (offline and online curves) and `bench` (one curve per domain and mode), so their plots read alike.

    curves: label -> {"conditional", "conditional_n", "cumulative", "cumulative_n"} (lists over k = 1..N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kind in zip(axes, ("conditional", "cumulative")):
        for label, curve in curves.items():
            values, counts = curve.get(kind), curve.get(f"{kind}_n") or [None] * len(curve.get(kind) or [])
            points = [(k, v, n) for k, (v, n) in enumerate(zip(values or [], counts), 1) if n != 0]  # no block: no point
            if not points:
                continue
            line, = ax.plot([k for k, _, _ in points], [v for _, v, _ in points], label=label, lw=1.2)
            for k, v, n in points:
                solid = n is None or n >= FEW_BLOCKS
                ax.plot([k], [v], marker="o", ms=5, color=line.get_color(), mfc=line.get_color() if solid else "white")
                if n is not None:
                    ax.annotate(str(n), (k, v), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=6)
        ax.set_xlabel("draft position k")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title("conditional: P(k accepted | 1..k-1 accepted)" if kind == "conditional" else "cumulative: P(1..k all accepted)",
                     fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{title}\n(numbers: blocks each point rests on; hollow: fewer than {FEW_BLOCKS})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_reliability(path: str | os.PathLike, calibration: dict[str, Any], positions=(0, 2, 4, 6)) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(calibration["before"]["reliability"])
    positions = [k for k in positions if k < n]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, name in zip(axes, ("before", "after")):
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
        for k in positions:
            bins = calibration[name]["reliability"][k]
            if bins:
                xs, ys, _ = zip(*bins)
                ax.plot(xs, ys, marker="o", label=f"a_{k + 1} (ECE {calibration[name]['ece'][k]:.3f})")
        ax.set_title(f"{name} STS")
        ax.set_xlabel("predicted survival")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("observed survival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------------------- tables
def _fmt(values, digits=3) -> str:
    return " ".join(f"{v:.{digits}f}" for v in values)


def _batch_note(online: dict[str, Any]) -> str:
    size = online.get("batch_size", 1)
    return f" in batches of {size}" if size > 1 else ""


def format_report(report: dict[str, Any]) -> str:
    lines = [f"machine: {report['machine']}",
             f"target dtype: {report['dtype']}, drafter dtype (online): {report.get('drafter_dtype', report['dtype'])}"]
    off = report.get("offline")
    if off:
        lines += [
            "",
            f"offline (teacher-forced, draft-vocab restricted; {off['blocks']} blocks)",
            f"  τ = {off['tau']:.3f} of {off['block_size']}   τ/B = {off['tau_over_B']:.3f}",
            f"  acceptance 1-TV_k      : {_fmt(off['acceptance'])}",
            f"  survival Π(1-TV_i)     : {_fmt(off['acceptance_cumulative'])}",
            f"  greedy τ = {off['greedy']['tau']:.3f} of {off['block_size']} (draft argmax = target argmax)",
            f"  greedy acceptance      : {_fmt(off['greedy']['acceptance'])}",
        ]
    for on in report.get("online", []):
        lines += [
            "",
            f"online ({on['mode']}, {on['prompts']} held-out prompts{_batch_note(on)}, {on['rounds']} rounds)",
            f"  mean accepted length   : {on['mean_accepted_length']:.3f} tokens/round (bonus included)",
            f"  acceptance cumulative  : {_fmt(on['acceptance_cumulative'])}",
            f"  acceptance conditional : {_fmt(on['acceptance_conditional'])}",
            f"  accepted histogram     : {on['accepted_histogram']}",
            f"  tokens/s plain → dspark: {on['plain_tokens_per_s']:.1f} → {on['dspark_tokens_per_s']:.1f}  "
            f"(×{on['speedup']:.2f})",
            f"  draft time / verify    : {on['draft_fraction_of_verify']:.1%} per round",
        ]
        if "batch_rounds" in on:
            lines.append(f"  batch rounds           : {on['batch_rounds']} (mean width {on['mean_width']:.2f}, "
                         f"plain steps {on['plain_step_share']:.0%})")
        if "identical_to_plain" in on:
            lines.append(f"  identical to plain     : {on['identical_to_plain']} {'prompts' if on.get('batch_size', 1) == 1 else 'batches'}")
    cal = report.get("calibration")
    if cal:
        lines += ["", "calibration of predicted survival a_k (sampled acceptance events)",
                  "  k   T_k     ECE before→after   AUC before→after   Brier before→after"]
        for k, t in enumerate(cal["temperatures"]):
            b, a = cal["before"], cal["after"]
            lines.append(f"  {k + 1}  {t:6.3f}   {b['ece'][k]:.4f}→{a['ece'][k]:.4f}     {b['auc'][k]:.3f}→{a['auc'][k]:.3f}"
                         f"      {b['brier'][k]:.4f}→{a['brier'][k]:.4f}")
    for name, path in report.get("plots", {}).items():
        lines.append(f"plot {name}: {path}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- driver
def drafter_name(model_dir: str) -> str:
    """"DSpark drafter for <target> (<folder>)" from the checkpoint's config: `eval`'s and `bench`'s plot titles
    and reports name the drafter they measured."""
    config = DSparkConfig.from_pretrained(model_dir)
    return f"DSpark drafter for {config.verifier_name_or_path or 'its target'} ({Path(model_dir).name})"


def load_drafter(path: str, target=None, dtype: torch.dtype | None = torch.float32, flag: str = "--model"):
    """A drafter from a directory, bound to `target` if its checkpoint omits the frozen embed/head: how `eval` and
    `bench` load every drafter they measure (a checkpoint as shipped binds its embedding and LM head at attach time);
    `flag` is the option that named `path`, for the line a directory that is no drafter gets. A `dtype` given is the
    one it runs in; None: its checkpoint's, then the one its `dspark_drafter_dtype` (auto) picks for `target` here,
    set now so that a report can name it (`drafter_dtype_of`)."""
    check_drafter_dir(path, flag)
    drafter = DSparkForDrafting.from_pretrained(path, dtype=dtype).eval()
    if dtype is not None:
        drafter.generation_config.dspark_drafter_dtype = "as-loaded"
    if target is not None and drafter.config.bind_target_embeddings:
        drafter.bind_target(target)
    if target is not None and dtype is None:
        prepare_drafter(drafter, target, DSparkDraftingSettings.from_drafter(drafter))
    return drafter


def add_drafter_dtype_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    parser.add_argument("--drafter-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help=f"{scope}the drafters' dtype (default auto: as a user's drafter runs, its checkpoint's "
                        "dtype or the one `dspark_drafter_dtype` picks for this machine; the report names it)")


def drafter_dtype_argument(args: argparse.Namespace) -> torch.dtype | None:
    """`--drafter-dtype` for `load_drafter`: None for auto."""
    return None if args.drafter_dtype == "auto" else getattr(torch, args.drafter_dtype)


def drafter_dtype_of(drafter) -> str:
    """The dtype a drafter runs in, as reports name it ("bfloat16")."""
    return str(next(drafter.parameters()).dtype).replace("torch.", "")


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    args.target = resolve_target(args.target, args.model)
    set_threads(args.threads)
    report: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "drafter_dtype": args.drafter_dtype,
                              "machine": machine_description(), "plots": {}}
    plots = Path(args.plots) if args.plots else None
    if plots:
        plots.mkdir(parents=True, exist_ok=True)
    curves: dict[str, dict[str, list]] = {}

    if args.cache:
        target32, _ = load_target(args.target, dtype="float32")
        drafter = load_drafter(args.model, target32, torch.float32)
        cache = HiddenStateCache(args.cache)
        cache.validate_against(drafter.config)
        rollouts = offline_acceptance(drafter, cache, args.max_anchors, max_samples=args.max_samples,
                                      progress=not args.no_progress)
        report["offline"] = offline_metrics(rollouts["accept"], rollouts["mask"], drafter.config.block_size)
        off = report["offline"]
        off["greedy"] = offline_metrics(rollouts["greedy_accept"], rollouts["mask"], drafter.config.block_size)
        curves["offline (teacher-forced)"] = {"conditional": off["acceptance"], "conditional_n": off["blocks_per_position"],
                                              "cumulative": off["acceptance_cumulative"], "cumulative_n": off["blocks_per_position"]}
        if "confidence_logits" in rollouts:
            temperatures = list(drafter.config.confidence_temperatures)
            report["calibration"] = calibration_metrics(rollouts["confidence_logits"], rollouts["accept"],
                                                        rollouts["mask"], temperatures)
            if plots:
                report["plots"]["reliability"] = plot_reliability(plots / "reliability.png", report["calibration"])
        del target32

    if args.num_prompts > 0:
        target, tokenizer = load_target(args.target, dtype=args.dtype)
        drafter = load_drafter(args.model, target, drafter_dtype_argument(args))
        report["drafter_dtype"] = drafter_dtype_of(drafter)
        if args.confidence_threshold is not None:
            drafter.generation_config.dspark_confidence_threshold = args.confidence_threshold
        prompts = held_out_prompts(args.prompts, args.split, args.num_prompts)
        report["online"] = []
        for mode in args.modes:
            on = online_metrics(target, tokenizer, drafter, prompts, args.max_new_tokens, do_sample=(mode == "sample"),
                                progress=not args.no_progress, batch_size=args.batch_size)
            report["online"].append(on)
            curves[f"online {on['mode']}"] = live_curve(on)
    if plots and curves:
        report["plots"]["acceptance"] = plot_acceptance(plots / "acceptance.png", curves, f"{drafter_name(args.model)} ({args.dtype})")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="drafter checkpoint directory")
    add_target_argument(parser, from_drafter=True)
    parser.add_argument("--cache", help="held-out hidden-state cache for offline τ, acceptance and calibration")
    parser.add_argument("--max-anchors", type=positive_int, default=10_000, help="offline: blocks per sample (default: all)")
    parser.add_argument("--max-samples", type=positive_int, default=None, help="offline: only the first N cache samples")
    parser.add_argument("--prompts", nargs="+", default=list(DEFAULT_PROMPT_SOURCES),
                        help="online prompt sources: chitchat, chatterbot or JSONL paths (default: chitchat)")
    parser.add_argument("--split", default="test", choices=["train", "validation", "test", "all"],
                        help="split the online prompts come from (default: test, never trained on)")
    parser.add_argument("--num-prompts", type=non_negative_int, default=8, help="online prompts (0 = offline only)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="online: prompts per generate call, left-padded (batched speculation; default 1)")
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"],
                        help="online decoding modes (sample = T=1)")
    parser.add_argument("--confidence-threshold", type=probability, default=None,
                        help="online: confidence-scheduled block length (default: the drafter's generation_config)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="online: the target's dtype")
    add_drafter_dtype_argument(parser, "online: ")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--plots", help="directory for acceptance.png and reliability.png")
    add_progress_argument(parser)
    parser.add_argument("--json", nargs="?", const="-", default=None,
                        help="write the report as JSON to this file ('-' or no value: stdout instead of tables)")


def run(args: argparse.Namespace) -> int:
    emit_report(evaluate(args), args.json, format_report)
    return 0


__all__ = [
    "add_drafter_dtype_argument",
    "calibration_metrics",
    "drafter_dtype_argument",
    "drafter_dtype_of",
    "drafter_name",
    "evaluate",
    "live_acceptance",
    "live_acceptance_over_calls",
    "live_curve",
    "load_drafter",
    "offline_acceptance",
    "offline_metrics",
    "online_metrics",
    "plot_acceptance",
]
