"""`dspark-hf calibrate`: Sequential Temperature Scaling (STS) of the confidence head (DESIGN §2).

The confidence head predicts c_k = P(draft k accepted | drafts 1..k-1 accepted); scheduling uses the prefix survival
a_k = Π_{i≤k} c_i, so errors compound along the block. STS fixes that in order: for k = 1..N, with T_1..T_{k-1}
already chosen, grid-search the T_k that minimizes the ECE of a_k = a_{k-1} · σ(logit_k / T_k) against observed
survival. The temperatures go into the checkpoint's `confidence_temperatures`, which `draft_block` applies.

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
from .data import load_target_model
from .metrics import expected_calibration_error, roc_auc
from .rollouts import Rollouts, collect_rollouts

DEFAULT_GRID = torch.logspace(-1.5, 1.5, 121).tolist()  # 0.03 .. 31.6


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
    """Per-position ECE, AUC and mean predicted vs observed survival."""
    survival = survival_predictions(rollouts, temperatures)
    report = {"ece": [], "auc": [], "predicted": [], "observed": []}
    for k in range(survival.shape[1]):
        predicted, observed = _position_data(rollouts, survival[:, k], k)
        report["ece"].append(expected_calibration_error(predicted, observed, num_bins))
        report["auc"].append(roc_auc(*_position_data(rollouts, survival[:, k], k, per_draw=True)))
        report["predicted"].append(float(predicted.mean()) if predicted.numel() else float("nan"))
        report["observed"].append(float(observed.mean()) if observed.numel() else float("nan"))
    return report


def sequential_temperature_scaling(rollouts: Rollouts, grid: list[float] | None = None, num_bins: int = 15) -> list[float]:
    """T_1..T_N chosen left to right, each minimizing the ECE of the cumulative survival a_k with earlier T fixed."""
    grid = grid or DEFAULT_GRID
    N = rollouts.confidence_logits.shape[1]
    survival = torch.ones(rollouts.confidence_logits.shape[0])
    temperatures = []
    for k in range(N):
        best_t, best_ece = 1.0, float("inf")
        for t in grid:
            candidate = survival * torch.sigmoid(rollouts.confidence_logits[:, k] / t)
            predicted, observed = _position_data(rollouts, candidate, k)
            if predicted.numel() == 0:
                break
            ece = expected_calibration_error(predicted, observed, num_bins)
            if ece < best_ece - 1e-12:
                best_t, best_ece = float(t), ece
        temperatures.append(best_t)
        survival = survival * torch.sigmoid(rollouts.confidence_logits[:, k] / best_t)
    return temperatures


def calibrate(model_dir: str, cache_dir: str, output_dir: str | None = None, eval_cache_dir: str | None = None,
              target: str | None = None, max_anchors: int = 256, draws: int = 8, seed: int = 0,
              log=print) -> dict:
    """Fit STS temperatures on `cache_dir`, write them into the checkpoint's config, report before/after.

    The report is computed on `eval_cache_dir` when given (held-out rollouts), else on the fitting rollouts.
    """
    model = DSparkForDrafting.from_pretrained(model_dir, dtype=torch.float32)
    if target is not None:
        model.bind_target(load_target_model(target, dtype="float32"))
    caches = {"fit": HiddenStateCache(cache_dir)}
    if eval_cache_dir:
        caches["report"] = HiddenStateCache(eval_cache_dir)
    for cache in caches.values():
        cache.validate_against(model.config)
    fit = collect_rollouts(model, caches["fit"], max_anchors, draws, seed)
    report_on = collect_rollouts(model, caches["report"], max_anchors, draws, seed + 1) if eval_cache_dir else fit
    temperatures = sequential_temperature_scaling(fit)
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
    log("position  T_k     ECE before -> after   AUC before -> after   survival predicted/observed")
    for k, t in enumerate(temperatures):
        log(f"{k + 1:>8}  {t:6.3f}  {before['ece'][k]:.4f} -> {after['ece'][k]:.4f}     "
            f"{before['auc'][k]:.3f} -> {after['auc'][k]:.3f}       {after['predicted'][k]:.3f}/{after['observed'][k]:.3f}")
    return {"temperatures": temperatures, "before": before, "after": after, "output_dir": str(output)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="drafter checkpoint directory")
    parser.add_argument("--cache", required=True, help="held-out hidden-state cache to fit the temperatures on")
    parser.add_argument("--eval-cache", help="a second held-out cache to report ECE/AUC on (default: the fitting one)")
    parser.add_argument("--output-dir", help="write the calibrated checkpoint here (default: update --model in place)")
    parser.add_argument("--target", help="target model directory, for checkpoints saved without embeddings/head")
    parser.add_argument("--max-anchors", type=int, default=256, help="blocks per sample")
    parser.add_argument("--draws", type=int, default=8, help="sampled acceptance draws per block")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    calibrate(args.model, args.cache, args.output_dir, args.eval_cache, args.target, args.max_anchors, args.draws, args.seed)
    return 0


__all__ = [
    "Rollouts",
    "calibrate",
    "calibration_report",
    "collect_rollouts",
    "sequential_temperature_scaling",
    "survival_predictions",
]
