"""Shared fixtures: tiny random targets of several architectures, the real SmolLM2 target, drafters that fit them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Verify-cost profiles (the hardware-aware schedule measures one on first use) go to a fresh Hugging Face home per
# test process, so tests never read or leave one in the user's cache.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="dspark-hf-test-home-")
# A suite started in the background (`make test &`) inherits SIGINT ignored, and so would every command it starts:
# the tests that press Ctrl-C need commands that can hear it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import psutil
import pytest
import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronConfig,
    NemotronForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)

from dspark_hf import DSparkConfig, DSparkForDrafting

TINY_VOCAB = 96
TINY_ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    # layers that do not hand the forward's kwargs to the attention function (the batch loop cannot pack them):
    "stablelm": (StableLmConfig, StableLmForCausalLM),  # partial rotary (a quarter of each head)
    "falcon": (FalconConfig, FalconForCausalLM),  # parallel attention and MLP, one key/value head, its own SDPA call
    "nemotron": (NemotronConfig, NemotronForCausalLM),  # partial rotary, layer norm + 1
}

# Under pytest-xdist (`make test` runs two workers) each worker gets one core; tiny models gain nothing from more.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


def make_tiny_target(architecture: str = "llama", vocab_size: int = TINY_VOCAB, seed: int = 0, layers: int = 4,
                     **config_overrides):
    """A small random causal LM (fp32, eval mode) with the given architecture (and config fields, e.g. a sliding
    window)."""
    config_class, model_class = TINY_ARCHITECTURES[architecture]
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, max_position_embeddings=512,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if isinstance(getattr(config_class, "head_dim", None), property):  # Falcon derives it from the hidden size
        del settings["head_dim"]
    config = config_class(**settings | config_overrides)
    torch.manual_seed(seed)
    return model_class(config).eval()


def make_drafter(target, seed: int = 0, schedule: str = "fixed", **overrides) -> DSparkForDrafting:
    """A random DSpark drafter fitted to `target` (embed/head bound from it), fp32. It drafts with the fixed schedule
    and no prompt lookup (what the tests of drafting mechanics count on) unless `schedule="hardware"`: a drafter's own
    default, the hardware schedule with prompt lookup, prices its random confidences."""
    text = target.config.get_text_config()
    settings = dict(
        hidden_size=text.hidden_size,
        intermediate_size=2 * text.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=text.vocab_size,
        draft_vocab_size=text.vocab_size,
        block_size=4,
        aux_hidden_state_layer_ids=[1, text.num_hidden_layers // 2, text.num_hidden_layers - 1],
        target_hidden_size=text.hidden_size,
        target_num_hidden_layers=text.num_hidden_layers,
        mask_token_id=text.vocab_size - 1,
        markov_rank=8,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    drafter = DSparkForDrafting(DSparkConfig(**settings)).eval()
    vocab = drafter.config.draft_vocab_size
    if vocab < text.vocab_size:  # a deterministic sub-vocabulary: every other id from 0, padded with the rest
        ids = sorted((list(range(0, text.vocab_size, 2)) + list(range(1, text.vocab_size, 2)))[:vocab])
        ids_t = torch.tensor(ids)
        t2d = torch.zeros(text.vocab_size, dtype=torch.bool)
        t2d[ids_t] = True
        drafter.set_draft_vocab(ids_t - torch.arange(vocab), t2d)
    drafter.bind_target(target)
    if schedule == "fixed":
        drafter.generation_config.dspark_schedule = "fixed"
        drafter.generation_config.dspark_lookup_ngram_size = 0
    return drafter


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer and ChatML template (tiny random chat targets share it)."""
    from transformers import AutoTokenizer

    from dspark_hf.assets import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random chat target saved as a normal model directory (SmolLM2's tokenizer and template)."""
    path = tmp_path_factory.mktemp("tiny-target")
    make_tiny_target("llama", vocab_size=len(smollm2_tokenizer), layers=2).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target in fp32 (exactness) and its tokenizer."""
    from dspark_hf.assets import load_smollm2

    return load_smollm2(dtype="float32")


# ------------------------------------------------------------------------------------------------ accelerate launch
def free_port() -> int:
    """A loopback port nobody listens on now: each launch gets its own rendezvous, never one a previous run left."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_process_launch(*args: str, **env: str) -> tuple[list[str], dict]:
    """(command, env) to `accelerate launch` `args` on 2 CPU processes (gloo), one thread each, with this checkout
    importable; `env` adds variables."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]), **env}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), *args]
    return command, env


def kill_process_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it: torch's launcher starts each rank in its own session, so a
    process-group kill would leave the ranks running."""
    with contextlib.suppress(psutil.NoSuchProcess):
        launcher = psutil.Process(pid)
        victims = [*launcher.children(recursive=True), launcher]
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=60)


def run_launch(command: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run an `accelerate launch` command to completion; past `timeout` every rank is killed and the test fails with
    the output so far, instead of a hung rank outliving the test."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(process.pid)
        stdout, stderr = process.communicate()
        pytest.fail(f"`accelerate launch` did not finish in {timeout:.0f} s; every rank was killed. stdout tail:\n"
                    f"{stdout[-2000:]}\nstderr tail:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
