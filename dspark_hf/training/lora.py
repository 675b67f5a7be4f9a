"""PEFT LoRA on a DSpark drafter: adapt an existing drafter to a new target revision or domain cheaply.

LoRA goes on the draft layers' attention and MLP projections (and optionally on `fc`, the context fusion, which is
what changes most when the target's hidden states move). Everything else — embeddings, LM head, norms, Markov and
confidence heads — stays frozen, so an adapter is a few MB and the base drafter is shared.

Round trip: `apply_lora` → train → `save_adapter(dir)` (PEFT's adapter_config.json + adapter_model.safetensors) →
`load_adapter(base, dir)` → `merge_adapter(...)` gives a plain `DSparkForDrafting` that saves and loads like any
other drafter checkpoint.
"""

from __future__ import annotations

import os

from peft import LoraConfig, PeftModel, get_peft_model

from .. import DSparkForDrafting

LAYER_PROJECTIONS = r"layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def lora_target_modules(include_fc: bool = False) -> str:
    """PEFT `target_modules` regex (full match on module names) for the draft layers, optionally `fc`."""
    return f"^({LAYER_PROJECTIONS}{'|fc' if include_fc else ''})$"


def lora_config(rank: int = 16, alpha: float = 32.0, dropout: float = 0.0, include_fc: bool = False) -> LoraConfig:
    if rank < 1:
        raise ValueError(f"--lora-rank={rank} must be >= 1.")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=lora_target_modules(include_fc), bias="none")


def apply_lora(model: DSparkForDrafting, rank: int = 16, alpha: float = 32.0, dropout: float = 0.0,
               include_fc: bool = False) -> PeftModel:
    """Wrap the drafter with fresh LoRA adapters; only the adapter parameters require grad afterwards."""
    return get_peft_model(model, lora_config(rank, alpha, dropout, include_fc))


def save_adapter(model: PeftModel, directory: str | os.PathLike) -> None:
    model.save_pretrained(directory)


def load_adapter(base: DSparkForDrafting, directory: str | os.PathLike, trainable: bool = False) -> PeftModel:
    """The base drafter with a saved adapter on top (inference by default)."""
    return PeftModel.from_pretrained(base, str(directory), is_trainable=trainable)


def merge_adapter(model: PeftModel) -> DSparkForDrafting:
    """Fold the adapter into the base weights and return the plain drafter (modifies `model`'s base in place)."""
    return model.merge_and_unload()


def merge_adapter_checkpoint(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                             output_dir: str | os.PathLike) -> DSparkForDrafting:
    """base drafter directory + adapter directory -> a plain drafter checkpoint in `output_dir`."""
    base = DSparkForDrafting.from_pretrained(str(base_dir))
    merged = merge_adapter(load_adapter(base, adapter_dir))
    merged.save_pretrained(str(output_dir))
    return merged


__all__ = [
    "apply_lora",
    "load_adapter",
    "lora_config",
    "lora_target_modules",
    "merge_adapter",
    "merge_adapter_checkpoint",
    "save_adapter",
]
