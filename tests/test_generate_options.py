"""generate() options that change where generation stops or which positions count: identical to plain generate (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_tiny_target
from test_generation import PROMPTS, chi_square_p_value, greedy, make_oracle, sampling_setup
from transformers import StoppingCriteria, StoppingCriteriaList

from dspark_hf import DSparkDraftOutput, DSparkForDrafting

LENGTH = 24


class StopAfterToken(StoppingCriteria):
    """A user's own criterion: stop once `token` has been generated."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def drafters(target):
    """A random drafter (short accepted runs) and a perfect one (whole blocks accepted, stops mid-block)."""
    return [make_drafter(target, block_size=5), make_oracle(make_drafter(target, block_size=5), target)]


def test_custom_stopping_criterion_is_not_overshot():
    target = make_tiny_target("llama")
    for prompt in PROMPTS:
        plain = greedy(target, prompt, max_new_tokens=LENGTH, eos_token_id=None)
        for at in (3, 7, 12):  # stop tokens the target emits mid-way, so they fall inside drafted blocks
            criteria = StoppingCriteriaList([StopAfterToken(int(plain[0, len(prompt) + at]))])
            expected = greedy(target, prompt, max_new_tokens=LENGTH, eos_token_id=None, stopping_criteria=criteria)
            assert expected.shape[1] < plain.shape[1]
            for drafter in drafters(target):
                out = greedy(target, prompt, max_new_tokens=LENGTH, eos_token_id=None, stopping_criteria=criteria,
                             assistant_model=drafter)
                assert torch.equal(out, expected), (prompt, at)


def test_stop_strings_are_not_overshot(smollm2_tokenizer):
    """A stop string spanning two tokens (tiny targets' ids 17..95 are single characters of SmolLM2's tokenizer)."""
    target = make_tiny_target("qwen2")  # its greedy answers here avoid the special ids 0..16
    for prompt, at in zip(PROMPTS, (4, 9, 12)):
        plain = greedy(target, prompt, max_new_tokens=LENGTH, eos_token_id=None)
        stop = smollm2_tokenizer.decode(plain[0, len(prompt) + at : len(prompt) + at + 2])
        options = dict(max_new_tokens=LENGTH, eos_token_id=None, stop_strings=[stop], tokenizer=smollm2_tokenizer)
        expected = greedy(target, prompt, **options)
        assert expected.shape[1] < plain.shape[1]
        for drafter in drafters(target):
            assert torch.equal(greedy(target, prompt, assistant_model=drafter, **options), expected), (prompt, stop)


def test_stop_string_on_real_smollm2_with_the_shipped_drafter(smollm2):
    """The issue's repro: plain generate stops at "I'm so glad"; the drafter must stop there too."""
    from pathlib import Path

    target, tokenizer = smollm2
    drafter = DSparkForDrafting.from_pretrained(Path(__file__).resolve().parents[1] / "examples" / "smollm2-dspark").eval()
    messages = [{"role": "user", "content": "I just got back from a great trip to the mountains!"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    options = dict(max_new_tokens=32, do_sample=False, stop_strings=["glad"], tokenizer=tokenizer)
    expected = target.generate(**inputs, **options)
    assert tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :]).endswith("glad")
    assert torch.equal(target.generate(**inputs, assistant_model=drafter, **options), expected)


def truncated_outcomes(target, prompt: list[int], stop: int, length: int = 3) -> dict[tuple[int, ...], float]:
    """Exact P(continuation) of plain sampling with `length` new tokens, cut after the first `stop` token."""
    import itertools

    V = target.config.vocab_size
    continuations = torch.tensor(list(itertools.product(range(V), repeat=length)))
    sequences = torch.cat([torch.tensor(prompt).expand(len(continuations), -1), continuations], dim=1)
    with torch.no_grad():
        logprobs = torch.log_softmax(target(sequences).logits.double(), dim=-1)
    L, rows = len(prompt), torch.arange(len(continuations))
    joint = sum(logprobs[rows, L - 1 + i, continuations[:, i]] for i in range(length)).exp()
    outcomes: dict[tuple[int, ...], float] = {}
    for tokens, p in zip(continuations.tolist(), joint.tolist()):
        key = tuple(tokens[: tokens.index(stop) + 1] if stop in tokens else tokens)
        outcomes[key] = outcomes.get(key, 0.0) + p
    return outcomes


def make_sampling_oracle(drafter, target, flatten: float = 0.7):
    """Patch `draft_block` to sample drafts from q = softmax(0.7 · target logits): close to p, so drafts are often
    accepted, sometimes rejected, and a stop token is often drafted (where a biased cut shows most)."""

    def draft_block(cache, anchor_id, num_drafts=None, input_ids=None, generator=None, **kwargs):
        sequence, tokens, logits = input_ids, [], []
        for _ in range(min(num_drafts or drafter.num_draft_tokens, drafter.num_draft_tokens)):
            with torch.no_grad():
                q_logits = target(sequence).logits[:, -1].float() * flatten
            token = torch.multinomial(torch.softmax(q_logits, dim=-1), 1, generator=generator)
            sequence = torch.cat([sequence, token], dim=-1)
            tokens.append(token)
            logits.append(q_logits)
        return DSparkDraftOutput(token_ids=torch.cat(tokens, dim=1), target_logits=torch.stack(logits, dim=1))

    drafter.draft_block = draft_block
    return drafter


def test_sampling_with_a_stop_criterion_matches_plain_sampling():
    """Cutting a block at a stop must not bias sampling (a cut decided by a draft's own value would)."""
    from test_generation import SAMPLES, SAMPLING_PROMPT

    target, drafter = sampling_setup("vanilla")
    drafter = make_sampling_oracle(drafter, target)
    stop = 3
    reference = truncated_outcomes(target, SAMPLING_PROMPT, stop)
    keys = sorted(reference)
    counts = torch.zeros(len(keys))
    torch.manual_seed(2)
    prompt, drafted, accepted = torch.tensor([SAMPLING_PROMPT]), 0, 0
    for _ in range(SAMPLES):
        out = target.generate(prompt, max_new_tokens=3, do_sample=True, top_k=0, eos_token_id=None, pad_token_id=0,
                              stopping_criteria=StoppingCriteriaList([StopAfterToken(stop)]), assistant_model=drafter)
        counts[keys.index(tuple(out[0, len(SAMPLING_PROMPT) :].tolist()))] += 1
        stats = drafter.last_generation_stats
        drafted, accepted = drafted + sum(stats.drafted), accepted + sum(stats.accepted)
    assert 0 < accepted < drafted  # both verdicts happened
    p_value = chi_square_p_value(counts, torch.tensor([reference[k] for k in keys]))
    assert p_value > 1e-3, f"sampling with a stop criterion drifted from plain sampling (χ² p = {p_value:.2e})"


def test_pad_token_inside_the_prompt_runs_like_plain_generate():
    """input_ids only, pad id inside the prompt: transformers masks those positions; so must the verify passes."""
    target = make_tiny_target("llama")
    for prompt in ([1, 17, 0, 42, 9], [1, 0, 5, 60, 0, 61, 62, 30]):  # pad_token_id=0, eos 2: the mask has zeros
        expected = greedy(target, prompt, max_new_tokens=LENGTH, eos_token_id=None)
        for drafter in drafters(target):
            assert torch.equal(greedy(target, prompt, max_new_tokens=LENGTH, eos_token_id=None, assistant_model=drafter), expected)


def test_left_padded_prompt_with_its_mask_runs_like_plain_generate():
    target = make_tiny_target("qwen3")
    ids = torch.tensor([[0, 0, 1, 88, 3, 77, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    options = dict(attention_mask=mask, max_new_tokens=LENGTH, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **options)
    for drafter in drafters(target):
        assert torch.equal(target.generate(ids, assistant_model=drafter, **options), expected)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_target_of_another_depth_is_refused_in_one_line(architecture):
    """Same hidden size, aux layers in range, but the drafter was trained for a 4-layer target."""
    drafter = make_drafter(make_tiny_target(architecture))
    deeper = make_tiny_target(architecture, layers=6)
    for call in (lambda: deeper.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, assistant_model=drafter, pad_token_id=0),
                 lambda: drafter.bind_target(deeper)):
        with pytest.raises(ValueError, match="trained for a target of 4 layers but this target has 6") as error:
            call()
        assert "\n" not in str(error.value)
