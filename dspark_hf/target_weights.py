"""Targets bigger than one device: where each layer goes, and the two tensors a drafter copies, without a full load.

`plan_device_map` asks transformers (Accelerate big-model loading) for the device map it would build under
`--max-memory`, before any weight is read, so a target that does not fit fails with one line instead of spilling to
disk or dying half-loaded. `read_target_heads` reads only the input embedding and the LM head from the target's
safetensors shards (the index says which shard holds which tensor), so `export --target` and `train --target` touch
two tensors of a 1T-parameter target, not all of it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PLANNED_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # the maps Accelerate computes from a budget


# ------------------------------------------------------------------------------------------------ device maps
def parse_max_memory(text: str | None) -> dict | None:
    """`0=20GiB,1=20GiB,cpu=64GiB` -> {0: "20GiB", 1: "20GiB", "cpu": "64GiB"} (Accelerate's `max_memory`)."""
    if not text:
        return None
    budget = {}
    for item in text.split(","):
        device, _, size = (part.strip() for part in item.partition("="))
        if not device or not _is_size(size):
            raise ValueError(f"--max-memory item {item.strip()!r} is not DEVICE=SIZE; write e.g. --max-memory 0=20GiB,1=20GiB,cpu=64GiB")
        budget[int(device) if device.isdigit() else device] = size
    return budget


def _is_size(text: str) -> bool:
    from accelerate.utils import convert_file_size_to_int

    try:
        return convert_file_size_to_int(text) > 0
    except (ValueError, TypeError):
        return False


def _meta_model(location: str, dtype: torch.dtype):
    """The target's module tree with no storage: sizes and names come from the config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def plan_device_map(location: str, dtype: torch.dtype, device_map: str | dict, max_memory: dict | None,
                    offload_folder: str | None = None) -> dict:
    """The device map transformers would build for `device_map` ("auto", "balanced", "sequential"; a dict is kept)
    under `max_memory` (default: the free memory of every device); refuses one that spills to disk unless
    `offload_folder` allows it."""
    if device_map not in PLANNED_MAPS:
        return device_map  # a dict or one device ("cuda:1"): transformers places it as given
    from accelerate.utils import compute_module_sizes, convert_bytes, get_max_memory
    from transformers.integrations.accelerate import _get_device_map

    missing = [d for d in (max_memory or {}) if isinstance(d, int) and d >= torch.cuda.device_count()]
    if missing:
        raise ValueError(f"--max-memory names GPU {missing[0]} but this machine has {torch.cuda.device_count()} GPU(s); name only devices it has (e.g. cpu=64GiB)")
    model = _meta_model(location, dtype)
    plan = _get_device_map(model, device_map, dict(max_memory) if max_memory else None, None)  # (it rewrites a budget)
    if "disk" in plan.values() and offload_folder is None:
        needed = compute_module_sizes(model)[""]
        given = sum(get_max_memory(dict(max_memory) if max_memory else None).values())
        budget = ("--max-memory " + ",".join(f"{d}={size}" for d, size in max_memory.items())) if max_memory else "the free memory of the devices"
        raise ValueError(
            f"target {location} needs about {convert_bytes(needed)} in {str(dtype).removeprefix('torch.')} but "
            f"{budget} allows {convert_bytes(given)} (and each device must hold whole layers); raise --max-memory, "
            "add a device (e.g. cpu=64GiB), or pass --offload-folder DIR to offload the rest to disk (slow)"
        )
    return plan


def input_device(model) -> torch.device:
    """Where a target's inputs go: the first accelerator of its device map (Accelerate's hooks move activations on
    from there), else the device of its weights."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        accelerators = [d for d in device_map.values() if d not in ("cpu", "disk", "meta")]
        return torch.device(accelerators[0]) if accelerators else torch.device("cpu")
    return next(model.parameters()).device


# ------------------------------------------------------------------------------------ embedding and LM head
def _weight_map(location: str) -> dict[str, str] | None:
    """Tensor name -> safetensors file (a path, downloaded from the Hub only when a tensor needs it); None when the
    target has no safetensors weights."""
    from transformers.utils import cached_file

    kwargs = {"_raise_exceptions_for_missing_entries": False, "_raise_exceptions_for_connection_errors": False}
    index = cached_file(location, SAFETENSORS_INDEX, **kwargs)
    if index:
        with open(index) as handle:
            return dict(json.load(handle)["weight_map"])
    single = cached_file(location, SAFETENSORS_SINGLE, **kwargs)
    if single:
        from safetensors import safe_open

        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SAFETENSORS_SINGLE)
    return None


def _checkpoint_key(module_name: str, weight_map: dict[str, str], what: str, location: str) -> str:
    """The checkpoint's name for a parameter: the same as the module's, or the one key ending like it (checkpoints
    of some architectures keep an older prefix, e.g. `language_model.model.` for `model.language_model.`)."""
    if module_name in weight_map:
        return module_name
    tail = ".".join(module_name.split(".")[-2:])
    matches = [k for k in weight_map if k == tail or k.endswith("." + tail)]
    if len(matches) != 1:
        raise ValueError(
            f"cannot find the {what} ({module_name}) among the safetensors tensors of target {location} "
            f"({len(matches)} candidates); pass a target saved with save_pretrained"
        )
    return matches[0]


def _read_tensor(location: str, filename: str, key: str) -> torch.Tensor:
    from safetensors import safe_open
    from transformers.utils import cached_file

    with safe_open(cached_file(location, filename), framework="pt") as handle:
        return handle.get_tensor(key)


def read_target_heads(location: str, name_or_path: str | None = None, dtype: torch.dtype = torch.float32):
    """The target's config, input embedding and LM head, read from its safetensors shards; None when it has none.

    The result quacks like the loaded model for what a drafter copies (`config`, `name_or_path`,
    `get_input_embeddings().weight`, `get_output_embeddings().weight`): `DSparkForDrafting.bind_target`, export's
    `bind_from_target`, `drafter_config_from_target`. Tied embeddings (the config's tie_word_embeddings, as the
    module tree built from it ties them) use the one table for both.
    """
    weight_map = _weight_map(location)
    if weight_map is None:
        return None
    model = _meta_model(location, dtype)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied table under its first (stored) name
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embed_key = _checkpoint_key(names[id(embedding)], weight_map, "input embedding", location)
    embed = _read_tensor(location, weight_map[embed_key], embed_key).to(dtype)
    if head is embedding:
        lm_head = embed
    else:
        head_key = _checkpoint_key(names[id(head)], weight_map, "LM head", location)
        lm_head = _read_tensor(location, weight_map[head_key], head_key).to(dtype)
    for tensor, meta, what in ((embed, embedding, "input embedding"), (lm_head, head, "LM head")):
        if tuple(tensor.shape) != tuple(meta.shape):
            raise ValueError(f"target {location}: the {what} in its safetensors has shape {tuple(tensor.shape)} but its config implies {tuple(meta.shape)}; pass a consistent checkpoint")
    name = name_or_path or model.config.name_or_path
    return SimpleNamespace(
        config=model.config, name_or_path=name,
        get_input_embeddings=lambda: SimpleNamespace(weight=embed),
        get_output_embeddings=lambda: SimpleNamespace(weight=lm_head),
    )


__all__ = ["input_device", "parse_max_memory", "plan_device_map", "read_target_heads"]
