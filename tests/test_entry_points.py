"""The entry points transformers users start from: `pipeline(..., assistant_model=drafter)`, `AutoModelForCausalLM`,
a transformers release newer than the tested range, and several conversations on one drafter in worker threads.

Each is checked against the same entry point without the drafter (fp32 greedy: the same text), on the real SmolLM2
target with the shipped drafter.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, TextIteratorStreamer, pipeline

from dspark_hf.remote_code.configuration_dspark import TRANSFORMERS_RANGE, check_transformers_version

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER = REPO_ROOT / "examples" / "smollm2-dspark"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
GREEDY = dict(max_new_tokens=24, do_sample=False)


@pytest.fixture(scope="module")
def shipped_drafter():
    return AutoModel.from_pretrained(SHIPPED_DRAFTER, trust_remote_code=True, dtype=torch.float32).eval()


def text_pipeline(target, tokenizer, **kwargs):
    return pipeline("text-generation", model=target, tokenizer=tokenizer, **kwargs)


@pytest.mark.slow
def test_pipeline_with_the_drafter_writes_the_same_text_as_without(smollm2, shipped_drafter):
    """Chat messages, plain text, and the pipeline's own batches (left padding, as a decoder-only batch needs)."""
    target, tokenizer = smollm2
    tokenizer.padding_side = "left"
    plain, drafted = text_pipeline(target, tokenizer), text_pipeline(target, tokenizer, assistant_model=shipped_drafter)
    for inputs, options in [(CHATS[0], {}), ("The capital of France is", {}), (CHATS, {"batch_size": 3})]:
        expected = plain(inputs, **GREEDY, **options)
        assert drafted(inputs, **GREEDY, **options) == expected, inputs
    assert shipped_drafter.last_generation_stats.rounds > 0  # the batch went through the drafter
    sampled = drafted(CHATS[1], max_new_tokens=12, do_sample=True, temperature=0.7)
    assert sampled[0]["generated_text"][-1]["role"] == "assistant"


@pytest.mark.slow
def test_an_older_checkpoint_without_special_tokens_serves_a_pipeline_after_attach_to(smollm2, tmp_path):
    """Checkpoints saved before the drafter config carried the target's bos/eos/pad ids still load and generate;
    `attach_to(target)` (which generate calls anyway) fills them, and the pipeline then shares the tokenizer."""
    target, tokenizer = smollm2
    older = AutoModel.from_pretrained(SHIPPED_DRAFTER, trust_remote_code=True, dtype=torch.float32).eval()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(older.config, name, None)
    inputs = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(target.generate(**inputs, **GREEDY, assistant_model=older), target.generate(**inputs, **GREEDY))
    assert older.config.eos_token_id == target.config.eos_token_id  # filled by the call
    text = text_pipeline(target, tokenizer, assistant_model=older)(CHATS[0], **GREEDY)
    assert text == text_pipeline(target, tokenizer)(CHATS[0], **GREEDY)


@pytest.mark.slow
def test_automodelforcausallm_loads_the_drafter_as_an_assistant(smollm2):
    target, tokenizer = smollm2
    drafter = AutoModelForCausalLM.from_pretrained(SHIPPED_DRAFTER, trust_remote_code=True, dtype=torch.float32)
    assert type(drafter).__name__ == "DSparkForDrafting"
    inputs = tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(target.generate(**inputs, **GREEDY, assistant_model=drafter), target.generate(**inputs, **GREEDY))


@pytest.mark.slow
def test_concurrent_conversations_in_worker_threads_stream_their_own_plain_text(smollm2, shipped_drafter):
    """A chat UI's pattern: each conversation generates in a worker thread into its own TextIteratorStreamer, all on
    one drafter at once (one with a stop string); each stream is the plain text, and each thread's
    `last_generation_stats` is its own call's, also after another thread's call."""
    target, tokenizer = smollm2
    options = [dict(GREEDY), dict(GREEDY, stop_strings=["."], tokenizer=tokenizer), dict(GREEDY, max_new_tokens=40)]
    inputs = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
              for chat in CHATS]
    expected = [tokenizer.decode(target.generate(**x, **o)[0, x["input_ids"].shape[1]:], skip_special_tokens=True)
                for x, o in zip(inputs, options)]
    streamed, own_stats, stats_later, errors = [""] * 3, [None] * 3, [None] * 3, []
    all_done = threading.Barrier(3)

    def conversation(i):
        try:
            streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            worker = threading.Thread(target=target.generate,
                                      kwargs=dict(**inputs[i], **options[i], assistant_model=shipped_drafter,
                                                  streamer=streamer))
            worker.start()
            streamed[i] = "".join(streamer)
            worker.join()
            target.generate(**inputs[i], **options[i], assistant_model=shipped_drafter)  # this thread's own call
            own_stats[i] = shipped_drafter.last_generation_stats
            all_done.wait(timeout=300)  # every other thread's calls have finished too
            stats_later[i] = shipped_drafter.last_generation_stats
        except Exception as error:  # noqa: BLE001 (reported below, with the thread's index)
            errors.append((i, repr(error)))
            all_done.abort()

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert streamed == expected
    assert all(later is own for later, own in zip(stats_later, own_stats))
    assert len({id(stats) for stats in own_stats}) == 3


NEWER = ".".join([TRANSFORMERS_RANGE[1], "0"])

LOAD_WITH_A_NEWER_RELEASE = r"""
import sys
import transformers
transformers.__version__ = sys.argv[2]  # as if a newer release were installed
import dspark_hf  # the library's copy of the remote code
from transformers import AutoModel
AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)  # the checkpoint's copy: no second warning
print("loaded")
"""


@pytest.mark.slow
def test_a_newer_transformers_loads_with_one_warning_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", LOAD_WITH_A_NEWER_RELEASE, str(SHIPPED_DRAFTER), NEWER],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("loaded"), done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "tested with transformers" in line]
    low, high = TRANSFORMERS_RANGE
    assert warnings == [f"dspark drafter remote code was tested with transformers >={low},<{high} (found {NEWER}); "
                        f"it runs, but pin 'transformers<{high}' if something breaks."], done.stderr[-2000:]


@pytest.mark.parametrize("version", [NEWER, NEWER + ".dev0", "6.0.0"])
def test_a_newer_transformers_is_not_refused(version):
    check_transformers_version(version)
