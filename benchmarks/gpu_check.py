"""The accelerator check: the CUDA-marked tests, then the verify-cost profiles t(k) and t(B, w), on whatever
accelerator is here, in a few minutes.

    python benchmarks/gpu_check.py [--dtype bfloat16] [--json gpu.json]

The target is SmolLM2-135M-Instruct where its package is installed, else a Llama of the same shape built from a
config with random weights (verify costs depend on the shapes, not the weights). Prints one JSON object; exits 0
with a note where there is no accelerator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def target_on(device: str, dtype: str):
    """The real target where it is installed, else its shape with random weights; (model, where it came from)."""
    try:
        from dspark_hf.targets import load_target_model

        return load_target_model("smollm2", dtype=dtype, device=device), "SmolLM2-135M-Instruct"
    except (FileNotFoundError, ImportError, OSError):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(device=device, dtype=getattr(torch, dtype)).eval()
        return model, "SmolLM2 shape, random weights (from a config)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"accelerator": None, "note": "no CUDA device here; nothing to check"}))
        return 0
    from dspark_hf.measuring import measure_batch_verify_profile, measure_verify_profile

    began = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(ROOT / "tests" / "test_cuda.py")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    target, source = target_on("cuda", args.dtype)
    single = measure_verify_profile(target, 7, context_lengths=(128, 512, 2048), repeats=8)
    batch = measure_batch_verify_profile(target, 7, batch_sizes=(1, 4, 16, 64), repeats=4)
    result = {
        "accelerator": torch.cuda.get_device_name(0), "torch": torch.__version__, "target": source, "dtype": args.dtype,
        "tests": {"returncode": tests.returncode, "summary": (tests.stdout.strip().splitlines() or [""])[-1]},
        "t_k_ms": {n: [round(1e3 * t, 3) for t in row] for n, row in zip(single.context_lengths, single.verify_time_s)},
        "t_k_noisy": single.noisy,
        "t_Bw_ms": {b: dict(zip(batch.widths, [round(1e3 * t, 3) for t in row]))
                    for b, row in zip(batch.batch_sizes, batch.verify_time_s)},
        "seconds": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if tests.returncode in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
