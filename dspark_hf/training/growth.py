"""Function-preserving growth for a warm start: a checkpoint starts a larger drafter that drafts what it drafted.

A capacity change then adds steps instead of starting over (issue 57: a study row that wins from scratch would
otherwise lose to the shipped drafter's thousands of steps). Two kinds of growth:
- more draft layers: each new layer joins after the old ones with its two output projections (`o_proj`,
  `down_proj`) at zero, so it adds nothing to the residual stream until training moves them;
- a higher Markov rank (vanilla head): the new dimensions get freshly initialised input rows and zero output columns
  in `markov_w2` and in the confidence head, so the bias and the confidence logit are unchanged.
The zero halves receive gradient at the first step (their inputs are not zero), so the new capacity trains from there.
"""

from __future__ import annotations

import re

import torch

MARKOV_INPUT = "markov_head.markov_w1.weight"
MARKOV_OUTPUT = "markov_head.markov_w2.weight"
CONFIDENCE = "confidence_head.proj.weight"
LAYER_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow_state(state: dict[str, torch.Tensor], drafter, source) -> list[str]:
    """Widen `state` (a checkpoint's tensors) in place to `drafter`'s larger shapes; what grew, for the log."""
    return _grow_markov_rank(state, drafter, source) + _grow_layers(state, drafter, source)


def _grow_markov_rank(state, drafter, source) -> list[str]:
    new = drafter.config.markov_rank
    old = next((state[name].shape[1] for name in (MARKOV_INPUT, MARKOV_OUTPUT) if name in state), new)
    if old >= new:
        return []  # a smaller rank is a shape mismatch, which the caller reports
    if drafter.config.markov_head_type != "vanilla":
        raise ValueError(
            f"--init-from {source}: growing the Markov rank ({old} -> {new}) is defined for the vanilla head only; "
            f"keep markov_rank={old} or train the {drafter.config.markov_head_type} head from scratch."
        )
    fresh = drafter.state_dict()
    if MARKOV_INPUT in state:
        rows = state[MARKOV_INPUT].shape[0]
        state[MARKOV_INPUT] = _append_columns(state[MARKOV_INPUT], fresh[MARKOV_INPUT][:rows, old:])
    if MARKOV_OUTPUT in state:
        state[MARKOV_OUTPUT] = _append_columns(state[MARKOV_OUTPUT], torch.zeros_like(fresh[MARKOV_OUTPUT][:, old:]))
    if CONFIDENCE in state and CONFIDENCE in fresh and state[CONFIDENCE].shape[1] + new - old == fresh[CONFIDENCE].shape[1]:
        state[CONFIDENCE] = _append_columns(state[CONFIDENCE], torch.zeros_like(fresh[CONFIDENCE][:, -(new - old):]))
    return [f"Markov rank {old} -> {new}"]


def _grow_layers(state, drafter, source) -> list[str]:
    old = len({int(match.group(1)) for name in state if (match := re.match(r"layers\.(\d+)\.", name))})
    new = drafter.config.num_hidden_layers
    if old > new:
        raise ValueError(
            f"--init-from {source} has {old} draft layers and the config asks for {new}; a warm start adds layers, "
            f"it does not drop them (drop num_hidden_layers from --drafter-config or set it to {old} or more)."
        )
    if old == new or old == 0:
        return []
    fresh = drafter.state_dict()
    for index in range(old, new):
        prefix = f"layers.{index}."
        for name, value in fresh.items():
            if name.startswith(prefix):
                zero = name.endswith(LAYER_OUTPUTS)
                state[name] = torch.zeros_like(value) if zero else value.clone()
    return [f"draft layers {old} -> {new}"]


def _append_columns(weight: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    return torch.cat([weight, extra.to(weight.dtype)], dim=1)


__all__ = ["grow_state"]
