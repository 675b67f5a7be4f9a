"""Speculative generation inside `target.generate(assistant_model=drafter)`: lossless greedy and sampling (fp32)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TINY_ARCHITECTURES, make_drafter, make_tiny_target
from transformers import AutoModelForCausalLM
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.logits_process import TopPLogitsWarper

from dspark_hf import DSparkDraftOutput
from dspark_hf.remote_code import drafting_dspark, routing_dspark, token_choice_dspark

PROMPTS = [[1, 17, 42, 9], [1, 5, 5, 5, 60, 61, 62, 30, 11], [1, 88, 3, 77, 14, 50]]


def greedy(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)


def target_greedy_continuation(target, sequence: torch.Tensor, n: int) -> torch.Tensor:
    """The target's own next n greedy tokens after `sequence` (1, t)."""
    out = target.generate(sequence, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, sequence.shape[1] :]


def make_oracle(drafter, target, wrong_from: int | None = None):
    """Patch `draft_block` to propose the target's greedy continuation (wrong from draft `wrong_from` on, if set).

    The generator still feeds the real drafter its context every round; only the proposals are forced, so long
    accepted runs, EOS inside a block and `max_new_tokens` inside a block are exercised.
    """

    def draft_block(cache, anchor_id, num_drafts=None, input_ids=None, **kwargs):
        n = min(num_drafts or drafter.num_draft_tokens, drafter.num_draft_tokens)
        tokens = target_greedy_continuation(target, input_ids, n)
        if wrong_from is not None:
            tokens[:, wrong_from:] = (tokens[:, wrong_from:] + 1) % target.config.vocab_size
        return DSparkDraftOutput(token_ids=tokens)

    drafter.draft_block = draft_block
    return drafter


@pytest.mark.parametrize("architecture", sorted(TINY_ARCHITECTURES))
def test_greedy_is_token_identical_to_plain_generate(architecture):
    """≥ 50 prompt × length cases over four architectures: random drafter, perfect drafter, partly perfect drafter."""
    target = make_tiny_target(architecture)
    cases = 0
    drafter = make_drafter(target, block_size=5)
    for prompt, length in itertools.product(PROMPTS, [1, 6, 19]):
        expected = greedy(target, prompt, max_new_tokens=length)
        assert torch.equal(greedy(target, prompt, max_new_tokens=length, assistant_model=drafter), expected)
        cases += 1

    for prompt in PROMPTS:
        plain = greedy(target, prompt, max_new_tokens=24, eos_token_id=None)
        eos = int(plain[0, len(prompt) + 6])  # a token the target emits mid-way: EOS lands inside a drafted block
        for wrong_from, kwargs in [
            (None, {"max_new_tokens": 23, "eos_token_id": None}),  # max_new_tokens inside a block
            (None, {"max_new_tokens": 24, "eos_token_id": eos}),
            (2, {"max_new_tokens": 17, "eos_token_id": None}),  # rejections mid-block
        ]:
            oracle = make_oracle(make_drafter(target, block_size=5), target, wrong_from)
            expected = greedy(target, prompt, **kwargs)
            assert torch.equal(greedy(target, prompt, assistant_model=oracle, **kwargs), expected)
            stats = oracle.last_generation_stats
            if wrong_from is None:
                # every round accepts its whole block, except a last one cut by EOS / max length
                assert all(a == d for a, d in zip(stats.accepted[:-1], stats.drafted[:-1]))
            else:
                assert max(stats.accepted) <= wrong_from
            cases += 1
    assert cases == 18


def test_greedy_over_architectures_reaches_fifty_cases():
    # 4 architectures × 18 cases in the test above.
    assert len(TINY_ARCHITECTURES) * 18 >= 50


@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("markov_head_type, markov_input_vocab", [("gated", "target"), ("rnn", "target"), ("vanilla", "draft")])
def test_greedy_lossless_for_every_head_and_slot_convention(sample_from_anchor, markov_head_type, markov_input_vocab):
    target = make_tiny_target("qwen3")
    drafter = make_drafter(target, markov_head_type=markov_head_type, sample_from_anchor=sample_from_anchor, draft_vocab_size=40,
                           markov_input_vocab=markov_input_vocab)
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=15)
        assert torch.equal(greedy(target, prompt, max_new_tokens=15, assistant_model=drafter), expected)


def test_statistics_account_for_every_committed_token():
    target = make_tiny_target("llama")
    oracle = make_oracle(make_drafter(target, block_size=5), target, wrong_from=3)
    prompt = PROMPTS[1]
    out = greedy(target, prompt, max_new_tokens=30, eos_token_id=None, assistant_model=oracle)
    stats = oracle.last_generation_stats
    new_tokens = out.shape[1] - len(prompt)
    # prefill gives one token; each round commits its accepted drafts plus one target token
    assert 1 + sum(a + 1 for a in stats.accepted) == new_tokens
    assert stats.acceptance_cumulative()[:3] == [1.0, 1.0, 1.0] and stats.acceptance_cumulative()[3] == 0.0
    assert stats.acceptance_conditional()[3] == 0.0
    assert sum(stats.accepted_histogram()) == stats.rounds
    assert stats.draft_time_s > 0 and stats.verify_time_s > 0
    assert stats.drafted[-1] < 4  # the last round had room for fewer drafts than a block
    assert stats.mean_accepted_length == pytest.approx((new_tokens - 1) / stats.rounds)


# ----------------------------------------------------------------------------------------------------------------
# Sampling: the output distribution equals plain sampling (exact reference, χ² goodness of fit).

SAMPLING_VOCAB = 6
SAMPLING_PROMPT = [1, 3, 4, 2, 3]
SAMPLES = 900
ALPHA = 1e-3


def exact_pair_distribution(target, temperature: float, top_p: float | None = None) -> torch.Tensor:
    """P(t2, t3) of plain sampling (3 new tokens, t1 marginalized), by enumerating every continuation."""
    V = SAMPLING_VOCAB
    triples = torch.tensor(list(itertools.product(range(V), repeat=3)))
    sequences = torch.cat([torch.tensor(SAMPLING_PROMPT).expand(len(triples), -1), triples], dim=1)
    with torch.no_grad():
        logits = target(sequences).logits.double() / temperature
        if top_p is not None:  # applied after the temperature, as generate does
            logits = TopPLogitsWarper(top_p)(None, logits.reshape(-1, V)).reshape(logits.shape)
        logprobs = torch.log_softmax(logits, dim=-1)
    L = len(SAMPLING_PROMPT)
    joint = sum(logprobs[torch.arange(len(triples)), L - 1 + i, triples[:, i]] for i in range(3)).exp()
    return joint.reshape(V, V, V).sum(0)  # (t2, t3)


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled into one."""
    expected = probabilities.flatten() * counts.sum()
    counts = counts.flatten().double()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    keep = expected > 0
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0))


def sample_pairs(target, drafter, temperature: float, seed: int, **options) -> torch.Tensor:
    counts = torch.zeros(SAMPLING_VOCAB, SAMPLING_VOCAB)
    torch.manual_seed(seed)
    prompt = torch.tensor([SAMPLING_PROMPT])
    for _ in range(SAMPLES):
        out = target.generate(
            prompt, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=0, eos_token_id=None,
            pad_token_id=0, assistant_model=drafter, **options,
        )
        counts[out[0, -2], out[0, -1]] += 1
    return counts


def sampling_setup(markov_head_type: str, **drafter_options):
    target = make_tiny_target("llama", vocab_size=SAMPLING_VOCAB, layers=2, seed=11)
    drafter = make_drafter(target, block_size=3, mask_token_id=SAMPLING_VOCAB - 1, markov_head_type=markov_head_type, seed=5,
                           **drafter_options)
    with torch.no_grad():  # a strong Markov bias, so that forgetting it in q would show
        drafter.markov_head.markov_w1.weight.normal_(0, 1.5)
        drafter.markov_head.markov_w2.weight.normal_(0, 1.5)
    return target, drafter


@pytest.mark.parametrize("markov_head_type, temperature", [("vanilla", 1.0), ("gated", 0.7), ("rnn", 1.0)])
def test_sampling_matches_plain_sampling(markov_head_type, temperature):
    target, drafter = sampling_setup(markov_head_type)
    reference = exact_pair_distribution(target, temperature)
    counts = sample_pairs(target, drafter, temperature, seed=0)
    stats = drafter.last_generation_stats
    assert stats.rounds > 0
    p_value = chi_square_p_value(counts, reference)
    assert p_value > ALPHA, f"speculative sampling drifted from plain sampling (χ² p = {p_value:.2e})"


def test_sampling_on_a_smaller_draft_vocabulary_with_top_p_matches_plain_sampling():
    """Drafts drawn and warped (temperature, top-p) on a 4-token draft vocabulary of the 6-token target: q scattered
    to the target vocabulary, zero on the two tokens the drafter cannot propose, which only the residual can give.
    The Markov input table spans the draft vocabulary (two tokens share its last row)."""
    target, drafter = sampling_setup("vanilla", draft_vocab_size=4, markov_input_vocab="draft")
    assert drafter.draft_to_target_ids.tolist() == [0, 1, 2, 4]
    reference = exact_pair_distribution(target, 0.8, top_p=0.9)
    p_value = chi_square_p_value(sample_pairs(target, drafter, 0.8, seed=2, top_p=0.9), reference)
    assert drafter.last_generation_stats.rounds > 0
    assert p_value > ALPHA, f"speculative sampling on a draft vocabulary drifted from plain sampling (χ² p = {p_value:.2e})"


def test_draft_sampler_draws_from_the_given_probabilities():
    """The drafter's inverse-CDF sampler, one draw per row: frequencies fit each row's probabilities (χ²) and
    zero-probability ids never come up, at the ends of the vocabulary included."""
    sample_from = token_choice_dspark.sample_from
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0], [0.5, 0.0, 0.2, 0.0, 0.0, 0.1, 0.2]])
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros_like(probs)
    for _ in range(4000):
        counts[torch.arange(2), sample_from(probs, generator)] += 1
    for row in range(2):
        assert counts[row][probs[row] == 0].sum() == 0
        assert chi_square_p_value(counts[row], probs[row]) > ALPHA


def test_sampling_test_fails_when_q_skips_the_markov_bias():
    """Drafts sampled with the Markov bias but verified against q without it: the χ² test must reject."""
    target, drafter = sampling_setup("vanilla")
    original = drafter.draft_block

    def draft_block_with_wrong_q(cache, anchor_id, **kwargs):
        out = original(cache, anchor_id, **kwargs)
        hidden = drafter.block_hidden_states(cache, torch.as_tensor(anchor_id).reshape(1))[:, : out.token_ids.shape[1]]
        wrong = torch.full_like(out.target_logits, float("-inf"))
        wrong[..., drafter.draft_to_target_ids] = drafter.lm_head(hidden).float()
        return DSparkDraftOutput(token_ids=out.token_ids, target_logits=wrong)

    drafter.draft_block = draft_block_with_wrong_q
    reference = exact_pair_distribution(target, 1.0)
    p_value = chi_square_p_value(sample_pairs(target, drafter, 1.0, seed=0), reference)
    assert p_value < 1e-6, f"a wrong q went unnoticed (χ² p = {p_value:.2e})"


def test_sampling_with_confidence_schedule_matches_plain_sampling():
    target, drafter = sampling_setup("vanilla")
    drafter.generation_config.dspark_confidence_threshold = 0.3
    counts = sample_pairs(target, drafter, 1.0, seed=1)
    assert chi_square_p_value(counts, exact_pair_distribution(target, 1.0)) > ALPHA


# ----------------------------------------------------------------------------------------------------------------
# Confidence-scheduled draft length


@pytest.mark.parametrize("schedule", [{"dspark_confidence_threshold": 0.4}, {"dspark_verify_cost": 0.15}])
def test_confidence_scheduling_is_lossless(schedule):
    target = make_tiny_target("gemma3")
    drafter = make_drafter(target, block_size=6)
    for name, value in schedule.items():
        setattr(drafter.generation_config, name, value)
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=20)
        assert torch.equal(greedy(target, prompt, max_new_tokens=20, assistant_model=drafter), expected)


def test_perfect_confidence_head_drafts_fewer_rejected_tokens():
    """A confidence head that knows which drafts survive cuts each block before its first rejection."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=6)
    original, confidence_head = drafter.draft_block, drafter.confidence_head
    cut_at = {}

    def perfect_confidence(hidden, prev_embeds):
        step = cut_at["step"]
        cut_at["step"] += 1
        return torch.full(hidden.shape[:-1], 30.0 if step < cut_at["survivors"] else -30.0)

    def draft_block(cache, anchor_id, input_ids=None, **kwargs):
        cut_at.update(step=0, survivors=drafter.num_draft_tokens)
        fixed = original(cache, anchor_id, input_ids=input_ids, **{**kwargs, "confidence_threshold": None})
        truth = target_greedy_continuation(target, input_ids, fixed.token_ids.shape[1])
        matches = (fixed.token_ids == truth).int().cumprod(-1).sum()
        cut_at.update(step=0, survivors=int(matches))
        return original(cache, anchor_id, input_ids=input_ids, **kwargs)

    rejected = {}
    for scheduled in (False, True):
        drafter.draft_block = draft_block if scheduled else original
        confidence_head.forward = perfect_confidence if scheduled else type(confidence_head).forward.__get__(confidence_head)
        drafter.generation_config.dspark_confidence_threshold = 0.5 if scheduled else None
        total = 0
        for prompt in PROMPTS:
            expected = greedy(target, prompt, max_new_tokens=20)
            assert torch.equal(greedy(target, prompt, max_new_tokens=20, assistant_model=drafter), expected)
            stats = drafter.last_generation_stats
            total += sum(stats.drafted) - sum(stats.accepted)
        rejected[scheduled] = total
    assert rejected[True] == 0 < rejected[False]


# ----------------------------------------------------------------------------------------------------------------
# Routing, other assistants, user options, errors


def test_routing_hook_is_installed_once_and_delegates():
    hook = GenerationMixin._get_candidate_generator
    assert getattr(hook, "_dspark_routing", False)
    routing_dspark.install_dspark_routing()
    assert GenerationMixin._get_candidate_generator is hook
    assert not getattr(hook.__wrapped__, "_dspark_routing", False)  # wraps the original, not another wrapper


def test_plain_small_lm_assistant_and_prompt_lookup_still_work():
    target = make_tiny_target("llama")
    assistant = make_tiny_target("llama", seed=3, layers=1)
    prompt = PROMPTS[1]
    expected = greedy(target, prompt, max_new_tokens=20)
    generators = []
    original = AssistedCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        generators.append(type(self))
        original(self, *args, **kwargs)

    AssistedCandidateGenerator.__init__ = spy
    try:
        assert torch.equal(greedy(target, prompt, max_new_tokens=20, assistant_model=assistant), expected)
    finally:
        AssistedCandidateGenerator.__init__ = original
    assert generators == [AssistedCandidateGenerator]
    assert torch.equal(greedy(target, prompt, max_new_tokens=20, prompt_lookup_num_tokens=3), expected)


def test_builtin_dflash_path_runs_a_heads_off_drafter():
    target = make_tiny_target("qwen3")
    drafter = make_drafter(target, markov_rank=0, enable_confidence_head=False)
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=18)
        out = greedy(target, prompt, max_new_tokens=18, assistant_model=drafter, speculation_type="dflash")
        assert torch.equal(out, expected)
    with_heads = make_drafter(target)
    with pytest.raises(ValueError, match="speculation_type='dflash' drafts with the target's full LM head"):
        greedy(target, PROMPTS[0], max_new_tokens=5, assistant_model=with_heads, speculation_type="dflash")


def test_user_output_hidden_states_with_return_dict():
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    prompt = PROMPTS[0]
    plain = greedy(target, prompt, max_new_tokens=8, return_dict_in_generate=True, output_hidden_states=True)
    spec = greedy(target, prompt, max_new_tokens=8, return_dict_in_generate=True, output_hidden_states=True, assistant_model=drafter)
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.hidden_states) == len(plain.hidden_states)
    assert all(len(step) == target.config.num_hidden_layers + 1 for step in spec.hidden_states)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 2}, "does not support beam search"),
        ({"num_return_sequences": 2, "do_sample": True}, "returns one sequence"),
    ],
)
def test_unsupported_generation_modes_fail_clearly(kwargs, message):
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, assistant_model=drafter, pad_token_id=0, **kwargs)


def test_batch_of_two_goes_to_the_batched_loop():
    """A batch no longer fails: the routing hook hands it to batched speculation (tests/test_batching.py)."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    batch = torch.tensor([PROMPTS[0], PROMPTS[0]])
    expected = target.generate(batch, max_new_tokens=5, pad_token_id=0, do_sample=False)
    assert torch.equal(target.generate(batch, max_new_tokens=5, assistant_model=drafter, pad_token_id=0, do_sample=False),
                       expected)
    assert drafter.last_generation_stats.widths  # batch rounds were recorded


def test_mismatched_targets_fail_clearly():
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    wider = AutoModelForCausalLM.from_config(target.config.__class__(**{**target.config.to_dict(), "hidden_size": 96, "head_dim": 24}))
    shallower = make_tiny_target("llama", layers=2)
    other_vocab = make_tiny_target("llama", vocab_size=97)
    for other, message in [
        (wider, "expects target hidden size 64 but the target has 96"),
        (shallower, "aux layer id 3 is beyond the target's 2 layers"),
    ]:
        with pytest.raises(ValueError, match=message):
            other.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, assistant_model=drafter, pad_token_id=0)
    # our one-line error, not transformers' advice to pass `tokenizer` and `assistant_tokenizer`
    with pytest.raises(ValueError, match="vocab_size=96 differs from the target's 97") as error:
        other_vocab.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, assistant_model=drafter, pad_token_id=0)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="vocab_size=96 differs from the target's 97"):
        drafter.bind_target(other_vocab)


def test_real_smollm2_target_greedy_is_identical(smollm2):
    """The real target (fp32): a random drafter and a perfect one both leave a greedy chat answer unchanged."""
    target, tokenizer = smollm2
    geometry = dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64, mask_token_id=0,
                    aux_hidden_state_layer_ids=[1, 15, 29], block_size=6)
    messages = [{"role": "user", "content": "Give me two tips for sleeping better."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    drafter = make_drafter(target, draft_vocab_size=4096, **geometry)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)
    oracle = make_oracle(make_drafter(target, **geometry), target)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=oracle), expected)
    assert oracle.last_generation_stats.mean_accepted_length > 3


def test_target_whose_cache_cannot_be_cropped_fails_clearly():
    from transformers import MambaConfig, MambaForCausalLM

    recurrent = MambaForCausalLM(MambaConfig(hidden_size=64, num_hidden_layers=4, vocab_size=96, state_size=8)).eval()
    drafter = make_drafter(make_tiny_target("llama"))
    with pytest.raises(ValueError, match="not supported with stateful models") as error:
        recurrent.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, assistant_model=drafter, pad_token_id=0)
    assert "\n" not in str(error.value)
