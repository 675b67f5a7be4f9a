"""On an accelerator (skipped without one): the generation paths stay lossless on CUDA, and the profiles time it.

`benchmarks/gpu_check.py` runs these with `-m cuda` and then a verify-cost profile on whatever accelerator is there;
the targets are built from configs (random weights serve for exactness and for verify costs).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_tiny_target
from test_batching import PROMPTS, left_padded

from dspark_hf import measuring
from dspark_hf.remote_code import profiling_dspark

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]
DEVICE = "cuda"


@pytest.fixture(scope="module")
def pair():
    target = make_tiny_target("llama").to(DEVICE)
    drafter = make_drafter(target).to(DEVICE)
    drafter.generation_config.dspark_schedule = "hardware"
    return target, drafter


def test_one_prompt_on_cuda_is_what_plain_generate_writes(pair):
    target, drafter = pair
    for prompt in PROMPTS[:4]:
        ids = torch.tensor([prompt], device=DEVICE)
        settings = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(target.generate(ids, assistant_model=drafter, **settings), target.generate(ids, **settings))


def test_a_padded_batch_on_cuda_is_what_plain_batched_generate_writes(pair):
    target, drafter = pair
    batch = {name: value.to(DEVICE) for name, value in left_padded(PROMPTS[:6]).items()}
    settings = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(target.generate(**batch, assistant_model=drafter, **settings), target.generate(**batch, **settings))


def test_profiles_time_the_gpu_and_are_keyed_by_it(pair):
    target, drafter = pair
    key = profiling_dspark.verify_profile_key(target)
    assert key["device"] == "cuda" and key["device_name"] == torch.cuda.get_device_name(target.device)
    measured = measuring.measure_verify_profile(target, 3, context_lengths=(32,), repeats=2)
    assert all(t > 0 for row in measured.verify_time_s for t in row)
    batch = measuring.measure_batch_verify_profile(target, 3, batch_sizes=(1, 8), repeats=2)
    assert all(t > 0 for row in batch.verify_time_s for t in row)
    target.generate(torch.tensor([PROMPTS[0]], device=DEVICE), max_new_tokens=16, do_sample=False, pad_token_id=0,
                    assistant_model=drafter)
    live = drafter.drafting_state.live_verify_profiles[False]
    assert live.key == key and sum(live.counts[1]) > 0 and all(r is None or r > 0 for r in live.ratios[1])
