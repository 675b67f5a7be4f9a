"""`dspark-hf calibrate`: Sequential Temperature Scaling (STS) of the confidence head (docs/design.md §2).

The confidence head predicts c_k = P(draft k accepted | drafts 1..k-1 accepted); scheduling uses the prefix survival
a_k = Π_{i≤k} c_i, so errors compound along the block. STS fixes that in order: for k = 1..N, with T_1..T_{k-1}
already chosen, grid-search the T_k that minimizes a proper score (log loss by default, or Brier) of
a_k = a_{k-1} · σ(logit_k / T_k) against observed survival. A proper score, because the schedule acts on the value
of a_k: ECE, which a constant at the base rate minimizes, once set T_1 to the grid edge and made c_1 ≈ 0.5 for every
input. The grid is bounded ([0.25, 4]) so no position collapses to a constant, and a position at which no draft of
the calibration set survived is left uncalibrated (T = 1) rather than fitted to noise. ECE, AUC and Brier are
reported before and after. The temperatures go into the checkpoint's `confidence_temperatures`, which `draft_block`
applies.

Rollouts come from `dspark_hf.rollouts` (teacher-forced on a held-out cache, with sampled survival events, so AUC
is defined; several draws per block reduce the noise). Blocks that cannot reach position k at all are left out of
position k's ECE.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from . import DSparkForDrafting
from .cache import HiddenStateCache
from .flags import positive_int, seed
from .metrics import brier_score, expected_calibration_error, log_loss, roc_auc
from .progress import add_progress_argument
from .rollouts import Rollouts, collect_rollouts
from .targets import add_target_argument, check_drafter_dir, load_target_heads, resolve_target

DEFAULT_GRID = [0.25 * 16 ** (i / 48) for i in range(49)]  # 0.25 .. 4, geometric
SCORES = {"nll": log_loss, "brier": brier_score}


def survival_predictions(rollouts: Rollouts, temperatures: list[float]) -> torch.Tensor:
    """a_k = Π_{i≤k} σ(logit_i / T_i) -> (M, N)."""
    t = torch.tensor(temperatures, dtype=torch.float32)
    return torch.cumprod(torch.sigmoid(rollouts.confidence_logits / t), dim=-1)


def _position_data(rollouts: Rollouts, predicted_k: torch.Tensor, k: int, per_draw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted a_k and observed survival at position k, over blocks that can reach k.

    All draws of a block share its prediction (hence its ECE bin), so the ECE of the draws equals the ECE against
    the per-block survival frequency; `per_draw` expands to binary events (for AUC).
    """
    reach = rollouts.reachable()[:, k]
    events = rollouts.survived[reach][:, :, k].float()  # (M_k, R)
    if per_draw:
        return predicted_k[reach][:, None].expand_as(events).reshape(-1), events.reshape(-1)
    return predicted_k[reach], events.mean(dim=1)


def calibration_report(rollouts: Rollouts, temperatures: list[float], num_bins: int = 15) -> dict[str, list[float]]:
    """Per-position ECE, AUC, log loss, Brier and mean predicted vs observed survival."""
    survival = survival_predictions(rollouts, temperatures)
    report = {"ece": [], "auc": [], "nll": [], "brier": [], "predicted": [], "observed": []}
    for k in range(survival.shape[1]):
        predicted, observed = _position_data(rollouts, survival[:, k], k)
        empty = predicted.numel() == 0
        report["ece"].append(expected_calibration_error(predicted, observed, num_bins))
        report["auc"].append(roc_auc(*_position_data(rollouts, survival[:, k], k, per_draw=True)))
        report["nll"].append(float("nan") if empty else log_loss(predicted, observed))
        report["brier"].append(float("nan") if empty else brier_score(*_position_data(rollouts, survival[:, k], k, per_draw=True)))
        report["predicted"].append(float("nan") if empty else float(predicted.mean()))
        report["observed"].append(float("nan") if empty else float(observed.mean()))
    return report


def sequential_temperature_scaling(rollouts: Rollouts, grid: list[float] | None = None, score: str = "nll",
                                   log=None) -> list[float]:
    """T_1..T_N chosen left to right, each minimizing the proper `score` of the cumulative survival a_k with the
    earlier T fixed; a position with no surviving draft in the rollouts keeps T = 1 (said in one line to `log`)."""
    grid, loss = grid or DEFAULT_GRID, SCORES[score]
    logits = rollouts.confidence_logits
    survival = torch.ones(logits.shape[0])
    temperatures = []
    for k in range(logits.shape[1]):
        _, observed = _position_data(rollouts, survival, k)
        best_t = 1.0
        if observed.numel() and observed.sum() > 0:
            scores = [loss(*_position_data(rollouts, survival * torch.sigmoid(logits[:, k] / t), k)) for t in grid]
            best_t = float(grid[min(range(len(grid)), key=scores.__getitem__)])
        elif log is not None:
            log(f"position {k + 1}: no draft survived to it in the calibration set; left uncalibrated (T = 1)")
        temperatures.append(best_t)
        survival = survival * torch.sigmoid(logits[:, k] / best_t)
    return temperatures


def calibrate(model_dir: str, cache_dir: str, output_dir: str | None = None, eval_cache_dir: str | None = None,
              target: str | None = None, max_anchors: int = 256, draws: int = 8, seed: int = 0,
              score: str = "nll", log=print, progress: bool = True) -> dict:
    """Fit STS temperatures on `cache_dir`, write them into the checkpoint's config, report before/after.

    The report is computed on `eval_cache_dir` when given (held-out rollouts), else on the fitting rollouts.
    """
    check_drafter_dir(model_dir)
    model = DSparkForDrafting.from_pretrained(model_dir, dtype=torch.float32)
    if target is not None or model.config.bind_target_embeddings:  # else the embedding and head stay random
        model.bind_target(load_target_heads(resolve_target(target, model_dir)))
    caches = {"fit": HiddenStateCache(cache_dir)}
    if eval_cache_dir:
        caches["report"] = HiddenStateCache(eval_cache_dir)
    for cache in caches.values():
        cache.validate_against(model.config)
    fit = collect_rollouts(model, caches["fit"], max_anchors, draws, seed, progress=progress)
    report_on = (collect_rollouts(model, caches["report"], max_anchors, draws, seed + 1, progress=progress)
                 if eval_cache_dir else fit)
    temperatures = sequential_temperature_scaling(fit, score=score, log=log)
    before = calibration_report(report_on, [1.0] * len(temperatures))
    after = calibration_report(report_on, temperatures)

    output = Path(output_dir or model_dir)
    if output.resolve() != Path(model_dir).resolve():
        shutil.copytree(model_dir, output, dirs_exist_ok=True)
    config = type(model.config).from_pretrained(output)
    config.confidence_temperatures = temperatures
    config.save_pretrained(output)

    log(f"calibrated on {fit.confidence_logits.shape[0]} blocks; report on "
        f"{'held-out' if eval_cache_dir else 'the fitting'} rollouts ({report_on.confidence_logits.shape[0]} blocks)")
    log(f"position  T_k     {score} before -> after   ECE before -> after   AUC      survival predicted/observed")
    for k, t in enumerate(temperatures):
        log(f"{k + 1:>8}  {t:6.3f}  {before[score][k]:.4f} -> {after[score][k]:.4f}     {before['ece'][k]:.4f} -> "
            f"{after['ece'][k]:.4f}     {after['auc'][k]:.3f}    {after['predicted'][k]:.3f}/{after['observed'][k]:.3f}")
    return {"temperatures": temperatures, "before": before, "after": after, "output_dir": str(output)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="drafter checkpoint directory")
    parser.add_argument("--cache", required=True, help="held-out hidden-state cache to fit the temperatures on")
    parser.add_argument("--eval-cache", help="a second held-out cache to report ECE/AUC on (default: the fitting one)")
    parser.add_argument("--output-dir", help="write the calibrated checkpoint here (default: update --model in place)")
    add_target_argument(parser, from_drafter=True)  # the model whose embedding and LM head the drafter binds
    parser.add_argument("--max-anchors", type=positive_int, default=256, help="blocks per sample")
    parser.add_argument("--draws", type=positive_int, default=8, help="sampled acceptance draws per block")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--score", default="nll", choices=sorted(SCORES),
                        help="proper score STS minimizes per position (default: nll, the log loss)")
    add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    calibrate(args.model, args.cache, args.output_dir, args.eval_cache, args.target, args.max_anchors, args.draws, args.seed,
              args.score, progress=not args.no_progress)
    return 0


__all__ = [
    "Rollouts",
    "calibrate",
    "calibration_report",
    "collect_rollouts",
    "sequential_temperature_scaling",
    "survival_predictions",
]
