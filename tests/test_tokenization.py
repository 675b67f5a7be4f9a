"""The corpus tokenizer: the one-render walk gives the definition's tokens and masks bit for bit (every shipped
corpus, SmolLM2's and Qwen2.5's templates, a template the walk cannot read), refuses what the definition refuses, and
reads a second run from its on-disk cache."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from dspark_hf import corpora
from dspark_hf.data import load_conversations
from dspark_hf.tokenization import RE_RENDER_ERROR, TemplateLayout, tokenize_conversation, tokenize_conversations

QWEN25_TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5-chat-template.jinja").read_text()
# Llama-3 style: trims every content, so replies with outer whitespace are not found verbatim (the walk gives up).
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3 style: drops the reasoning of assistant turns before the last user turn, so earlier turns re-render.
DROPS_REASONING_TEMPLATE = (
    "{% set last = namespace(i=0) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set last.i = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and "
    "loop.index0 < last.i and '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def _answered(prompts: list[dict]) -> list[dict]:
    """Prompt-only corpora given a reply per prompt, as `regenerate` would, with code, newlines and backticks."""
    return [{"id": c["id"], "messages": [*c["messages"], {"role": "assistant", "content": "Sure.\n" + c["messages"][0]["content"][::-1][:300]}]}
            for c in prompts]


def _assert_definition(tokenizer, conversations, tmp_path, **kwargs):
    samples = tokenize_conversations(tokenizer, conversations, cache_dir=tmp_path, **kwargs)
    assert len(samples) == len(conversations)
    for conv, sample in zip(conversations, samples):
        expected = tokenize_conversation(tokenizer, conv["messages"], kwargs.get("max_length"))
        assert sample["input_ids"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.uint8
        assert torch.equal(sample["input_ids"], expected["input_ids"]), conv["id"]
        assert torch.equal(sample["loss_mask"], expected["loss_mask"]), conv["id"]


def _corpus_sample(name: str, count: int) -> list[dict]:
    try:
        conversations = load_conversations(name)
    except (FileNotFoundError, ValueError) as missing:  # WordNet is a Debian package; its corpus may be absent
        pytest.skip(f"{name}: {missing}")
    step = max(1, len(conversations) // count)
    chosen = conversations[::step][:count]
    return chosen if any(m["role"] == "assistant" for c in chosen for m in c["messages"]) else _answered(chosen)


@pytest.mark.parametrize("name", list(corpora.CORPORA))
def test_walk_equals_the_definition_on_every_shipped_corpus(smollm2_tokenizer, tmp_path, name):
    _assert_definition(smollm2_tokenizer, _corpus_sample(name, 40), tmp_path)


def test_walk_equals_the_definition_under_qwen25_with_hard_cases(smollm2_tokenizer, tmp_path):
    qwen = _with_template(smollm2_tokenizer, QWEN25_TEMPLATE)
    hard = [
        {"id": "system", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello."}]},
        {"id": "empty", "messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""},
                                     {"role": "user", "content": "Now?"}, {"role": "assistant", "content": "Ok."}]},
        {"id": "header-in-user", "messages": [{"role": "user", "content": "Type <|im_start|>assistant\n please"},
                                              {"role": "assistant", "content": "<|im_start|>assistant\n"}]},
        {"id": "repeats", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"},
                                       {"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}]},
    ]
    _assert_definition(qwen, hard + corpora.chitchat_conversations()[:60], tmp_path, num_proc=2)
    _assert_definition(qwen, corpora.chatterbot_conversations()[:60], tmp_path, max_length=40)
    assert TemplateLayout.of(qwen).generation_prompt == "<|im_start|>assistant\n"


def test_a_template_the_walk_cannot_read_falls_back_to_the_definition(smollm2_tokenizer, tmp_path):
    trimming = _with_template(smollm2_tokenizer, TRIMMING_TEMPLATE)
    padded = [{"id": "pad", "messages": [{"role": "user", "content": " hi "}, {"role": "assistant", "content": " hello \n"}]}]
    _assert_definition(trimming, padded + corpora.chatterbot_conversations()[:50], tmp_path)


def test_a_template_that_re_renders_earlier_turns_is_refused_alike(smollm2_tokenizer, tmp_path):
    dropping = _with_template(smollm2_tokenizer, DROPS_REASONING_TEMPLATE)
    conv = {"id": "r", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>x</think>a1"},
                                    {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}
    with pytest.raises(ValueError, match="re-renders earlier turns"):
        tokenize_conversation(dropping, conv["messages"])
    with pytest.raises(ValueError) as refused:
        tokenize_conversations(dropping, [conv], cache_dir=tmp_path)
    assert str(refused.value) == RE_RENDER_ERROR
    plain = {"id": "p", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]}
    _assert_definition(dropping, [plain], tmp_path)  # without reasoning, the same template is fine


def test_a_second_run_reads_the_cache_and_any_change_misses_it(smollm2_tokenizer, tmp_path):
    conversations = corpora.chatterbot_conversations()[:60]
    lines = []
    first = tokenize_conversations(smollm2_tokenizer, conversations, cache_dir=tmp_path, log=lines.append)
    again = tokenize_conversations(smollm2_tokenizer, conversations, cache_dir=tmp_path, log=lines.append)
    assert "tokenized in" in lines[-2] and "read from the tokenization cache" in lines[-1]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
               for a, b in zip(first, again))
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1 and not list(tmp_path.glob(".*"))
    edited = copy.deepcopy(conversations)
    edited[7]["messages"][-1]["content"] += "!"
    tokenize_conversations(smollm2_tokenizer, edited, cache_dir=tmp_path, log=lines.append)
    tokenize_conversations(_with_template(smollm2_tokenizer, QWEN25_TEMPLATE), conversations, cache_dir=tmp_path,
                           log=lines.append)
    tokenize_conversations(smollm2_tokenizer, conversations, max_length=16, cache_dir=tmp_path, log=lines.append)
    assert sum("tokenized in" in line for line in lines) == 4
    assert len(list(tmp_path.iterdir())) == 4
