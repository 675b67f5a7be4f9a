"""Hidden-state cache: one teacher-forced target pass per sample, stored once, read many times by training.

Training a drafter offline needs, per token, the target's aux hidden states (fused into the drafter's context) and
its final post-norm hidden state (target logits are recomputed through the frozen LM head at train time — logits
are never stored: V_t floats per token would dwarf everything else). Capture asks the target only for the layers
it needs (`output_hidden_states=[ids..., last]`), so nothing else is materialized.

Layout of `<dir>` (other modules read it; keep it stable):
  manifest.json            format_version, target, target_revision, aux_hidden_state_layer_ids (speculators
                           convention: index into HF hidden_states, 0 = embeddings, k = output of decoder layer k-1),
                           hidden_size, vocab_size, num_hidden_layers, dtype, [scales], num_samples, num_tokens,
                           num_shards, shards [{file, num_samples, num_tokens, sha256, bytes}], complete
  shard-00000.safetensors  packed samples: input_ids int64 [ΣT], loss_mask uint8 [ΣT],
                           aux_hidden_states [ΣT, m·d], final_hidden_state [ΣT, d], offsets int64 [n+1]

dtype bfloat16 / float32 stores the states as they are. dtype float8_e4m3fn (manifest `"scales": "per-row"`) stores
them as fp8 with one float32 scale per row — per token and aux layer: aux_hidden_states_scale [ΣT, m],
final_hidden_state_scale [ΣT, 1], scale = max|row| / 448 — about half the bf16 bytes; the reader dequantises on load
(to bfloat16 by default), so training and evaluation read every cache alike.

`target_revision` is the Hub commit hash when transformers knows it, else ``sha256:<hex>`` of the target's input
embedding and LM head rounded to bfloat16 (cheap, changes whenever the weights do, and stays the same whatever path or
dtype the same weights are loaded from). `train` refuses a cache whose target name and revision both differ from
its `--target`.

Resumable after kill -9: sample i always lands in shard i // shard_size, a shard is written to a temp name and
renamed, finished shards are never rewritten, and the manifest is rewritten atomically after each shard, so a
restart recomputes only the missing shards and produces the same bytes.

Several processes (`accelerate launch dspark-hf cache ...`): shard k is captured by process k % num_processes, so
the shards are the same bytes whatever the number of processes. Every process checks that all run with the same
settings; the main process resumes and publishes the manifest before capture, each process writes only its own
shards, and the main process publishes the final manifest once all have finished. A killed run's finished shards
are on disk under their final names and are adopted by the rerun, so it recomputes only the missing ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from bisect import bisect_right
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object, parse_flag_from_env
from safetensors import safe_open
from safetensors.torch import save_file

from .data import add_dataset_arguments, load_selected_conversations
from .files import write_json_atomic
from .flags import layer_ids, positive_int
from .progress import add_progress_argument, progress as progress_bar
from .tokenization import tokenize_conversations
from .targets import (add_placement_arguments, add_target_argument, input_device, load_target, load_target_heads,
                      placement_from_args)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # dtypes a target runs in
FP8 = "float8_e4m3fn"
CACHE_DTYPES = {**DTYPES, FP8: torch.float8_e4m3fn}  # dtypes the cache stores hidden states in
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
PER_ROW = "per-row"  # the manifest's `scales` of an fp8 cache: one float32 scale per token and layer
SHARD_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state", "offsets")
HIDDEN_TENSORS = ("aux_hidden_states", "final_hidden_state")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """Low, middle and high layers with the Kimi-K2.6 DSpark spacing ([1, 29, 57] of 61 layers)."""
    n = num_hidden_layers
    return sorted({1, max(1, (n - 3) // 2), max(1, n - 4)})


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def target_revision(model) -> str:
    """Hub commit hash if known, else sha256 of the input embedding and LM head (see module docstring): the two tables
    every target has, which `targets.load_target_heads` reads without loading the model."""
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return str(commit)
    digest = hashlib.sha256()
    tables = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    if any(table.is_meta for table in tables):  # offloaded to disk by --device-map: read them from the checkpoint
        heads = load_target_heads(model.name_or_path)
        tables = (heads.get_input_embeddings().weight, heads.get_output_embeddings().weight)
    for table in tables:
        # bf16 rounding: the same weights loaded in float32 or bfloat16 give the same revision
        digest.update(table.detach().to("cpu", torch.bfloat16).view(torch.int16).contiguous().numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def _target_geometry(model) -> tuple[int, int, int]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.hidden_size, config.vocab_size, config.num_hidden_layers


def _inputs_digest(samples: list[dict[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample["input_ids"].numpy().tobytes())
        digest.update(sample["loss_mask"].to(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def estimate_bytes(num_tokens: int, num_aux_layers: int, hidden_size: int, dtype: str) -> int:
    """tokens × (m+1) × d × bytes, plus 9 bytes/token of ids and mask (and (m+1) float32 scales for fp8)."""
    scales = (num_aux_layers + 1) * 4 if dtype == FP8 else 0
    return num_tokens * ((num_aux_layers + 1) * hidden_size * CACHE_DTYPES[dtype].itemsize + scales + 9)


def quantize_rows(states: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, g·d] -> fp8 e4m3 [T, g·d] and float32 scales [T, g]: each token's d-wide row of each group scaled by its
    own max|x| / 448, so every row uses fp8's full range and keeps its ~2⁻⁴ relative precision."""
    rows = states.float().reshape(len(states), groups, -1)  # [T, g, d]
    scale = rows.abs().amax(-1) / FP8_MAX  # [T, g]
    scaled = rows / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # an all-zero row stays zero
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(states.shape), scale


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows`: fp8 [T, g·d] × scales [T, g] -> `dtype` [T, g·d]."""
    rows = quantized.float().reshape(len(quantized), scale.shape[-1], -1) * scale[..., None]  # [T, g, d]
    return rows.reshape(quantized.shape).to(dtype)


@torch.inference_mode()
def capture_hidden_states(
    model, samples: list[dict[str, torch.Tensor]], aux_layer_ids: list[int], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One right-padded teacher-forced pass over `samples`; per sample (aux [T, m·d], final [T, d]).

    Right padding keeps every real token at its own position and, with a causal mask, unaffected by the pads; each
    sample is then sliced back to its length.
    """
    _, _, num_layers = _target_geometry(model)
    lengths = [len(s["input_ids"]) for s in samples]
    batch, longest = len(samples), max(lengths)
    device = input_device(model)  # not a parameter's: under a device map that may be on disk (meta)
    input_ids = torch.zeros(batch, longest, dtype=torch.int64)  # [b, T_max]
    attention_mask = torch.zeros(batch, longest, dtype=torch.int64)  # [b, T_max]
    for row, sample in enumerate(samples):
        input_ids[row, : lengths[row]] = sample["input_ids"]
        attention_mask[row, : lengths[row]] = 1
    wanted = sorted(set(aux_layer_ids) | {num_layers})
    outputs = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        output_hidden_states=wanted,
        use_cache=False,
        logits_to_keep=1,  # the LM head is recomputed at train time; skip it here
    )
    hidden = outputs.hidden_states  # tuple over L+1, None where not requested; each [b, T_max, d]
    aux = torch.cat([hidden[i] for i in aux_layer_ids], dim=-1).to(dtype)  # [b, T_max, m·d]
    final = hidden[num_layers].to(dtype)  # [b, T_max, d]
    return [(aux[row, :n].cpu(), final[row, :n].cpu()) for row, n in enumerate(lengths)]


def _write_shard(path: Path, samples: list[dict], captured: list[tuple[torch.Tensor, torch.Tensor]], dtype: str) -> None:
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)  # [n+1]
    offsets[1:] = torch.cumsum(lengths, 0)
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int64),  # [ΣT]
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),  # [ΣT]
        "aux_hidden_states": torch.cat([a for a, _ in captured]).contiguous(),  # [ΣT, m·d]
        "final_hidden_state": torch.cat([f for _, f in captured]).contiguous(),  # [ΣT, d]
        "offsets": offsets,
    }
    if dtype == FP8:
        groups = {"aux_hidden_states": tensors["aux_hidden_states"].shape[-1] // tensors["final_hidden_state"].shape[-1],
                  "final_hidden_state": 1}
        for name, count in groups.items():
            tensors[name], tensors[f"{name}_scale"] = quantize_rows(tensors[name], count)  # [ΣT, g·d], [ΣT, g]
    # safetensors writes through a temporary file of its own beside the target (`.tmpXXXXXX`), which a kill mid-write
    # leaves behind: it writes inside a staging directory of ours instead, which a resumed run recognizes and removes.
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    tmp = staging / path.name
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    staging.rmdir()


def _shard_entry(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        offsets = handle.get_tensor("offsets")
    return {
        "file": path.name,
        "num_samples": len(offsets) - 1,
        "num_tokens": int(offsets[-1]),
        "sha256": _sha256_file(path),
        "bytes": path.stat().st_size,
    }


def build_cache(
    model,
    tokenizer,
    conversations: list[dict],
    output_dir: str | os.PathLike,
    aux_layer_ids: list[int] | None = None,
    dtype: str = "bfloat16",
    shard_size: int = 256,
    batch_size: int = 8,
    max_length: int | None = 2048,
    progress: bool = True,
    log=print,
    state: PartialState | None = None,
) -> dict:
    """Capture the target's hidden states for `conversations` into `output_dir`; resumes a partial cache.

    `conversations` are normalized conversations (see `dspark_hf.data`); `aux_layer_ids` use the speculators
    convention. `state` (Accelerate's, under `accelerate launch`) shares the shards out across its processes: each
    calls build_cache with the same arguments and captures shards rank, rank + n, ... Returns the final manifest.
    """
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {dtype!r} is not supported; use one of {', '.join(CACHE_DTYPES)}")
    if shard_size < 1 or batch_size < 1:
        raise ValueError(f"shard_size={shard_size} and batch_size={batch_size} must be >= 1")
    aux_layer_ids = _checked_aux_layers(aux_layer_ids, _target_geometry(model)[2])
    samples = tokenize_conversations(tokenizer, conversations, max_length=max_length, progress=progress)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = new_manifest(model, samples, aux_layer_ids, dtype, shard_size, max_length)
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    if world > 1:
        check_same_settings(gather_object([{key: manifest[key] for key in SETTINGS_KEYS}]))
    done, error = {}, None
    if rank == 0:  # only the main process touches the manifest and the leftovers of a killed run
        try:
            done = resume_shards(output_dir, manifest)
            todo = [k for k in range(manifest["num_shards"]) if shard_name(k) not in done]
            check_disk_space(output_dir, manifest, samples, todo, log)
            _publish(output_dir, manifest, done)
        except ValueError as problem:
            if world == 1:
                raise
            error = str(problem)
    if world > 1:  # every process stops on the main one's refusal instead of waiting for it forever
        done, error = broadcast_object_list([done, error])
        if error:
            raise ValueError(error)
    mine = [k for k in range(rank, manifest["num_shards"], world) if shard_name(k) not in done]
    if world > 1:
        log(f"cache: process {rank} of {world} captures {len(mine)} shards")
    capture_shards(model, samples, mine, output_dir, manifest, done, batch_size, progress, publish=world == 1,
                   silent=rank != 0)
    if world > 1:
        for finished in gather_object([done]):
            done.update(finished)
        if rank == 0:
            _publish(output_dir, manifest, done)
        state.wait_for_everyone()  # no process returns before the manifest lists every shard
        manifest = json.loads((output_dir / MANIFEST).read_text())
    return manifest


def _checked_aux_layers(aux_layer_ids: list[int] | None, num_layers: int) -> list[int]:
    aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers)
    bad = [i for i in aux_layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} are outside the target's hidden states [0, {num_layers}] "
            f"({num_layers} decoder layers; speculators convention, 0 = embeddings); pick ids in that range"
        )
    return aux_layer_ids


def _shard_samples(samples: list, k: int, shard_size: int) -> list:
    return samples[k * shard_size : (k + 1) * shard_size]


def new_manifest(model, samples, aux_layer_ids: list[int], dtype: str, shard_size: int, max_length: int | None) -> dict:
    """The manifest of a cache not yet captured (the settings a resumed cache must match, no shards)."""
    hidden_size, vocab_size, num_layers = _target_geometry(model)
    scales = {"scales": PER_ROW} if dtype == FP8 else {}
    return {
        **scales,
        "format_version": FORMAT_VERSION,
        "target": getattr(model, "name_or_path", None) or model.config.name_or_path,
        "target_revision": target_revision(model),
        "aux_hidden_state_layer_ids": aux_layer_ids,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "num_hidden_layers": num_layers,
        "dtype": dtype,
        "shard_size": shard_size,
        "max_length": max_length,
        "inputs_sha256": _inputs_digest(samples),
        "num_shards": (len(samples) + shard_size - 1) // shard_size,
        "num_samples": 0,
        "num_tokens": 0,
        "shards": [],
        "complete": False,
    }


RESUME_KEYS = ("target", "target_revision", "aux_hidden_state_layer_ids", "dtype", "shard_size", "max_length", "inputs_sha256")
SETTINGS_KEYS = (*RESUME_KEYS, "hidden_size", "vocab_size", "num_hidden_layers")


def check_same_settings(settings: list[dict]) -> None:
    """Refuse a multi-process run whose processes disagree on what the cache holds (`settings[r]` from process r)."""
    for rank, theirs in enumerate(settings[1:], start=1):
        for key in SETTINGS_KEYS:
            if theirs[key] != settings[0][key]:
                raise ValueError(
                    f"the cache processes disagree on {key}: process {rank} has {theirs[key]!r}, process 0 has "
                    f"{settings[0][key]!r}; launch every process with the same arguments, target and dataset"
                )


def resume_shards(output_dir: Path, manifest: dict) -> dict[str, dict]:
    """Shard entries already on disk for the same settings: from the previous manifest, plus shards renamed into
    place after a kill but before the manifest caught up (adopted, never rewritten). Half-written temp files go."""
    done: dict[str, dict] = {}
    manifest_path = output_dir / MANIFEST
    if manifest_path.is_file():
        previous = json.loads(manifest_path.read_text())
        for key in RESUME_KEYS:
            if previous.get(key) != manifest[key]:
                raise ValueError(
                    f"{output_dir} already holds a cache with a different {key} ({previous.get(key)!r} vs "
                    f"{manifest[key]!r}); use a new output directory or delete it to start over"
                )
        done = {s["file"]: s for s in previous.get("shards", []) if (output_dir / s["file"]).is_file()}
    # killed mid-write: our temporary files and staging directories, and safetensors' own temporary files that runs
    # before the staging directories left beside the shards
    leftovers = [".shard-*.tmp", f".{MANIFEST}.*.tmp", ".tmp??????"]
    for stale in [path for pattern in leftovers for path in output_dir.glob(pattern)]:
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    for k in range(manifest["num_shards"]):
        path = output_dir / shard_name(k)
        if path.name not in done and path.is_file():
            try:
                layout = _shard_layout(path)
                entry = _shard_entry(path)
            except Exception:
                path.unlink()
                continue
            _check_layout(output_dir, path.name, layout, manifest)
            done[path.name] = entry
    return done


def _shard_layout(path: Path) -> dict[str, tuple[str, int]]:
    """(dtype, width) of each hidden-state tensor of a shard on disk, from its header."""
    with safe_open(str(path), framework="pt") as handle:
        return {name: (str(handle.get_slice(name).get_dtype()), handle.get_slice(name).get_shape()[-1])
                for name in HIDDEN_TENSORS}


def _check_layout(output_dir: Path, name: str, layout: dict, manifest: dict) -> None:
    """Refuse a finished shard that a process with other --dtype or --aux-layers left in the directory."""
    d, m = manifest["hidden_size"], len(manifest["aux_hidden_state_layer_ids"])
    expected_dtype = {"bfloat16": "BF16", "float32": "F32", FP8: "F8_E4M3"}[manifest["dtype"]]
    expected = {"aux_hidden_states": (expected_dtype, m * d), "final_hidden_state": (expected_dtype, d)}
    if layout != expected:
        (dtype, width), (want_dtype, want_width) = layout["aux_hidden_states"], expected["aux_hidden_states"]
        raise ValueError(
            f"{output_dir}/{name} was written with other settings ({dtype} aux states of width {width}, this run "
            f"stores {want_dtype} of width {want_width} = {m} layers × {d}); a process with another --dtype or "
            f"--aux-layers wrote into this directory: use a new output directory or delete the shard to start over"
        )


def check_disk_space(output_dir: Path, manifest: dict, samples: list, todo: list[int], log=print) -> None:
    """Log what the cache holds and costs; refuse before capturing when the disk cannot hold the shards still to do."""
    aux, d, dtype = len(manifest["aux_hidden_state_layer_ids"]), manifest["hidden_size"], manifest["dtype"]
    total_tokens = sum(len(s["input_ids"]) for s in samples)
    todo_tokens = sum(len(s["input_ids"]) for k in todo for s in _shard_samples(samples, k, manifest["shard_size"]))
    need = estimate_bytes(todo_tokens, aux, d, dtype)
    free = shutil.disk_usage(output_dir).free
    log(
        f"cache: {len(samples)} samples, {total_tokens} tokens, {manifest['num_shards']} shards ({len(todo)} to compute); "
        f"aux layers {manifest['aux_hidden_state_layer_ids']}, d={d}, {dtype}: "
        f"~{estimate_bytes(total_tokens, aux, d, dtype) / 2**30:.3f} GiB "
        f"(tokens × (m+1) × d × bytes), {need / 2**30:.3f} GiB still to write, {free / 2**30:.1f} GiB free"
    )
    if need > free:
        raise ValueError(
            f"not enough disk space in {output_dir}: the cache needs ~{need / 2**30:.2f} GiB more but only "
            f"{free / 2**30:.2f} GiB is free; free space, pick another --output, or cache fewer samples"
        )


def _publish(output_dir: Path, manifest: dict, done: dict[str, dict]) -> None:
    """Rewrite the manifest atomically with the shards finished so far."""
    names = [shard_name(k) for k in range(manifest["num_shards"])]
    manifest["shards"] = [done[name] for name in names if name in done]
    manifest["num_samples"] = sum(s["num_samples"] for s in manifest["shards"])
    manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
    manifest["complete"] = len(manifest["shards"]) == manifest["num_shards"]
    write_json_atomic(output_dir / MANIFEST, manifest, sort_keys=True)


def capture_shards(model, samples, todo: list[int], output_dir: Path, manifest: dict, done: dict[str, dict],
                   batch_size: int, progress: bool = True, publish: bool = True, silent: bool = False) -> None:
    """Capture and write each shard in `todo`, adding it to `done` and (`publish`: one process) publishing the
    manifest after each one (resumable after kill -9). `progress`: a bar, else log lines; `silent`: neither."""
    shard_size, dtype = manifest["shard_size"], manifest["dtype"]
    store_dtype = torch.float32 if dtype == FP8 else DTYPES[dtype]  # fp8 is quantized row by row when written
    aux_layer_ids = manifest["aux_hidden_state_layer_ids"]
    model.eval()
    todo_tokens = sum(len(s["input_ids"]) for k in todo for s in _shard_samples(samples, k, shard_size))
    with progress_bar(total=todo_tokens, unit="tok", desc="cache", enabled=progress, silent=silent) as bar:
        for k in todo:
            shard_samples = _shard_samples(samples, k, shard_size)
            # Batch by length inside the shard (less padding); the order is fixed, so a rerun computes the same bytes.
            order = sorted(range(len(shard_samples)), key=lambda i: (len(shard_samples[i]["input_ids"]), i))
            captured: list = [None] * len(shard_samples)
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                for row, result in zip(rows, capture_hidden_states(model, [shard_samples[i] for i in rows], aux_layer_ids, store_dtype)):
                    captured[row] = result
                bar.update(sum(len(shard_samples[i]["input_ids"]) for i in rows))
            path = output_dir / shard_name(k)
            _write_shard(path, shard_samples, captured, dtype)
            done[path.name] = _shard_entry(path)
            if publish:
                _publish(output_dir, manifest, done)


# ------------------------------------------------------------------------------------------------------- reader
class HiddenStateCache(torch.utils.data.Dataset):
    """Memory-mapped reader of a finished cache: `cache[i]` -> {input_ids [T], loss_mask bool [T],
    aux_hidden_states [T, m·d], final_hidden_state [T, d]}. Only the rows of sample i are read from disk. States
    come in their stored dtype; an fp8 cache's are dequantised to `dequantize_to` (bfloat16 by default)."""

    def __init__(self, path: str | os.PathLike, verify: bool = False, dequantize_to: torch.dtype = torch.bfloat16):
        self.path = Path(path)
        self.dequantize_to = dequantize_to
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{self.path} is not a hidden-state cache (no {MANIFEST}); build one with `dspark-hf cache`")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"cache {self.path} has format_version {self.manifest.get('format_version')}, this reader reads "
                f"{FORMAT_VERSION}; rebuild it with this version of `dspark-hf cache`"
            )
        if not self.manifest.get("complete"):
            raise ValueError(
                f"cache {self.path} is incomplete ({len(self.manifest.get('shards', []))} of "
                f"{self.manifest.get('num_shards', '?')} shards); rerun the same `dspark-hf cache` command to finish it"
            )
        self.quantized = self.manifest["dtype"] == FP8
        if self.quantized and self.manifest.get("scales") != PER_ROW:
            raise ValueError(
                f"cache {self.path} stores fp8 with {self.manifest.get('scales')!r} scales, this reader reads "
                f"{PER_ROW!r} scales; rebuild it with this version of `dspark-hf cache`"
            )
        self._check_every_shard_listed()
        for shard in self.manifest["shards"]:
            file = self.path / shard["file"]
            if not file.is_file():
                raise ValueError(f"cache {self.path}: shard {shard['file']} is missing; rerun `dspark-hf cache` to rebuild it")
            if "bytes" in shard and file.stat().st_size != shard["bytes"]:
                raise ValueError(
                    f"cache {self.path}: shard {shard['file']} is truncated or corrupt ({file.stat().st_size} bytes, "
                    f"manifest says {shard['bytes']}); delete it and rerun `dspark-hf cache` to rebuild it"
                )
        self._starts = [0]  # first global sample index of each shard
        for shard in self.manifest["shards"]:
            self._starts.append(self._starts[-1] + shard["num_samples"])
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        if verify:
            self.verify()

    def _check_every_shard_listed(self) -> None:
        """A complete manifest lists shard 0 .. num_shards-1 in order (each process writes every n-th shard, so a
        manifest assembled without one process's shards has gaps)."""
        listed = [shard["file"] for shard in self.manifest["shards"]]
        expected = [shard_name(k) for k in range(self.manifest.get("num_shards", len(listed)))]
        if listed != expected:
            missing = next((name for name in expected if name not in listed), None)
            problem = f"does not list {missing}" if missing else f"lists {listed} instead of {expected}"
            raise ValueError(
                f"cache {self.path}: the manifest {problem} (of {len(expected)} shards; a process's shards are missing "
                f"from it); rerun the same `dspark-hf cache` command to finish the cache"
            )

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def aux_hidden_state_layer_ids(self) -> list[int]:
        return list(self.manifest["aux_hidden_state_layer_ids"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    def _open(self, shard: int):
        if shard not in self._handles:
            file = self.path / self.manifest["shards"][shard]["file"]
            try:
                handle = safe_open(str(file), framework="pt")
                offsets = handle.get_tensor("offsets")
            except Exception as error:
                raise ValueError(
                    f"cache {self.path}: shard {file.name} cannot be read ({error}); delete it and rerun `dspark-hf cache`"
                ) from None
            self._handles[shard], self._offsets[shard] = handle, offsets
        return self._handles[shard], self._offsets[shard]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a cache of {len(self)} samples")
        shard = bisect_right(self._starts, index) - 1
        handle, offsets = self._open(shard)
        local = index - self._starts[shard]
        start, end = int(offsets[local]), int(offsets[local + 1])
        return {
            "input_ids": handle.get_slice("input_ids")[start:end],  # int64 [T]
            "loss_mask": handle.get_slice("loss_mask")[start:end].bool(),  # bool [T]
            "aux_hidden_states": self._states(handle, "aux_hidden_states", start, end),  # [T, m·d]
            "final_hidden_state": self._states(handle, "final_hidden_state", start, end),  # [T, d]
        }

    def _states(self, handle, name: str, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) of a hidden-state tensor, dequantised when the cache stores fp8."""
        states = handle.get_slice(name)[start:end]
        if not self.quantized:
            return states
        return dequantize_rows(states, handle.get_slice(f"{name}_scale")[start:end], self.dequantize_to)

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]

    def iter_shards(self):
        """Whole shards as packed tensors (input_ids, loss_mask, aux_hidden_states, final_hidden_state, offsets)."""
        for shard in range(len(self.manifest["shards"])):
            handle, _ = self._open(shard)
            yield {name: self._states(handle, name) if name in HIDDEN_TENSORS else handle.get_tensor(name)
                   for name in SHARD_TENSORS}

    def token_ids(self) -> set[int]:
        """Every token id that occurs in the cache (reads input_ids only, shard by shard)."""
        seen: set[int] = set()
        for shard in range(len(self.manifest["shards"])):
            handle, _ = self._open(shard)
            seen.update(torch.unique(handle.get_tensor("input_ids")).tolist())
        return seen

    def __getstate__(self):  # DataLoader workers reopen their own memory maps
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"] = {}, {}
        return state

    def verify(self) -> None:
        """Recompute every shard's sha256; raise naming the first corrupt shard."""
        for shard in self.manifest["shards"]:
            actual = _sha256_file(self.path / shard["file"])
            if actual != shard["sha256"]:
                raise ValueError(
                    f"cache {self.path}: shard {shard['file']} is corrupt (sha256 {actual[:12]}… != manifest "
                    f"{shard['sha256'][:12]}…); delete it and rerun `dspark-hf cache` to rebuild it"
                )

    def validate_against(self, config) -> None:
        """Refuse a cache captured from another target or other layers than the drafter `config` expects."""
        m = self.manifest
        for field, key, problem, fix in VALIDATION_CHECKS:
            expected = getattr(config, field, None)
            if expected is None or _listed(expected) == _listed(m[key]):
                continue
            values = dict(path=self.path, cached=m[key], expected=_listed(expected), field=field, target=m["target"],
                          ids=",".join(map(str, _listed(expected))) if isinstance(expected, (list, tuple)) else "")
            raise ValueError(("cache {path} " + problem + " but the drafter expects " + fix).format(**values))

    def check_target(self, model) -> None:
        """Refuse a cache captured from another model: both its name and its revision differ from `model`'s."""
        m = self.manifest
        name = getattr(model, "name_or_path", None) or model.config.name_or_path
        if m["target"] == name:
            return
        revision = target_revision(model)
        if m["target_revision"] == revision:
            return
        raise ValueError(
            f"cache {self.path} was captured from another model ({m['target']}, revision {m['target_revision'][:19]}) "
            f"than --target {name} (revision {revision[:19]}); cache the target you train for with `dspark-hf cache "
            f"--target {name}`, or pass the cache's own target"
        )


def _listed(value):
    return list(value) if isinstance(value, (list, tuple)) else value


_OWN_TARGET = "{field}={expected}; build the drafter for {target} or cache the drafter's own target"
# (drafter config field, manifest key, what the cache holds, what the drafter expects and the fix), checked in order.
VALIDATION_CHECKS = (
    ("aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids", "holds aux layers {cached}",
     "{expected}; rebuild the cache with --aux-layers {ids} or set aux_hidden_state_layer_ids={cached} in the drafter config"),
    ("target_hidden_size", "hidden_size", "was captured from a target with hidden size {cached} ({target})", _OWN_TARGET),
    ("target_num_hidden_layers", "num_hidden_layers", "was captured from a target with {cached} layers ({target})", _OWN_TARGET),
    ("vocab_size", "vocab_size", "was captured from a target with vocab size {cached} ({target})", _OWN_TARGET),
)


class IndexedCache(torch.utils.data.Dataset):
    """The cache with each sample's index attached (anchors are seeded by it)."""

    def __init__(self, cache: HiddenStateCache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self.cache[index], "index": torch.tensor(index)}


def collate_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of cached samples into one batch; padding is masked everywhere downstream."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])  # (b,)
    b, T = len(samples), int(lengths.max())
    aux_width, d = samples[0]["aux_hidden_states"].shape[-1], samples[0]["final_hidden_state"].shape[-1]
    batch = {
        "input_ids": torch.zeros(b, T, dtype=torch.long),
        "loss_mask": torch.zeros(b, T, dtype=torch.bool),
        "attention_mask": torch.zeros(b, T, dtype=torch.long),
        "aux_hidden_states": torch.zeros(b, T, aux_width, dtype=samples[0]["aux_hidden_states"].dtype),
        "final_hidden_state": torch.zeros(b, T, d, dtype=samples[0]["final_hidden_state"].dtype),
        "lengths": lengths,
        "index": torch.stack([s["index"] for s in samples]),
    }
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][row, :n] = s["input_ids"]
        batch["loss_mask"][row, :n] = s["loss_mask"]
        batch["attention_mask"][row, :n] = 1
        batch["aux_hidden_states"][row, :n] = s["aux_hidden_states"]
        batch["final_hidden_state"][row, :n] = s["final_hidden_state"]
    return batch


# ---------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the target once per sample (teacher-forced) and store input_ids, the assistant loss mask, the "
        "concatenated aux hidden states and the final post-norm hidden state as sharded safetensors plus a "
        "manifest. Rerunning the same command resumes an interrupted cache."
    )
    add_target_argument(parser, required=True)
    add_dataset_arguments(parser, "cache")
    parser.add_argument("--output", required=True, help="cache directory (created; an existing partial cache is resumed)")
    parser.add_argument(
        "--aux-layers",
        type=layer_ids,
        default=None,
        help="comma-separated aux layer ids, speculators convention (0 = embeddings, k = output of decoder layer "
        "k-1); default: 1, (L-3)//2 and L-4 of an L-layer target (low, middle and high, the Kimi-K2.6 DSpark "
        "spacing: [1, 29, 57] of 61 layers, [1, 10, 20] of 24). Change them to match a drafter you warm-start from "
        "(its aux_hidden_state_layer_ids) or to try other depths; each extra layer adds tokens × d to the cache",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=list(CACHE_DTYPES),
                        help="storage dtype of hidden states (default: bfloat16); float8_e4m3fn stores fp8 with one "
                        "float32 scale per token and layer, about half the bytes, dequantised when read")
    parser.add_argument("--target-dtype", default="float32", choices=list(DTYPES), help="dtype the target runs in (default: float32)")
    parser.add_argument("--max-length", type=positive_int, default=2048, help="truncate samples to this many tokens (default: 2048)")
    parser.add_argument("--shard-size", type=positive_int, default=256, help="samples per shard (default: 256)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per target forward (default: 8)")
    parser.add_argument("--device", default=None,
                        help="device of the target (default: cpu; under `accelerate launch` with several processes, "
                        "each process's own device)")
    add_placement_arguments(parser)
    add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    conversations = load_selected_conversations(args.dataset, args.split, args.limit, messages_column=args.messages_column,
                                                log=lambda line: print(f"cache: {line}"))
    # `accelerate launch` with n processes: shard k is captured by process k % n; a plain run is one process
    state = PartialState(cpu=args.device == "cpu" or parse_flag_from_env("ACCELERATE_USE_CPU"))
    device = args.device or ("cpu" if state.num_processes == 1 else state.device)
    model, tokenizer = load_target(args.target, dtype=args.target_dtype, device=device, **placement_from_args(args))
    manifest = build_cache(
        model,
        tokenizer,
        conversations,
        args.output,
        aux_layer_ids=args.aux_layers,
        dtype=args.dtype,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        max_length=args.max_length,
        progress=not args.no_progress,
        state=state,
    )
    if state.is_main_process:
        print(f"cache: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens in {len(manifest['shards'])} shards -> {args.output}")
    return 0
