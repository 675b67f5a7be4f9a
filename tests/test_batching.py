"""Batched speculative generation: `generate(**padded_batch, assistant_model=drafter)` is lossless row by row.

Greedy fp32 rows are token-identical to plain batched `generate` (tiny targets with random and oracle drafters; the
real SmolLM2 target with the shipped drafter, stop strings and a custom criterion in the mix); sampled rows pass a χ²
test at every row position; what a batch cannot do is refused in one line; finished rows leave the batch; the caches
stay compact; the batch width schedules choose as their costs say.
"""

from __future__ import annotations

import itertools
import json
import types

import pytest
import torch
from conftest import make_drafter, make_tiny_target
from test_generation import ALPHA, SAMPLES, chi_square_p_value, sampling_setup, target_greedy_continuation
from test_scheduling import drafted
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from dspark_hf.remote_code import batch_rows_dspark, batching_dspark, profiling_dspark, scheduling_dspark
from dspark_hf.remote_code.live_profiling_dspark import DSparkLiveVerifyProfile
from dspark_hf.remote_code.profiling_dspark import DSparkBatchVerifyProfile

PROMPTS = [[1, 17, 42, 9], [1, 5, 5, 5, 60, 61, 62, 30, 11], [1, 88, 3, 77, 14, 50], [1, 30], [1, 7, 7, 7, 7, 7, 7],
           [1, 91, 4], [1, 60, 61, 62, 63, 64], [1, 2, 40, 41, 42, 43, 44, 45, 46, 47]]


def left_padded(prompts: list[list[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    return {"input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
            "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])}


def batched_greedy(target, batch, **kwargs):
    return target.generate(**batch, do_sample=False, pad_token_id=0, **kwargs)


@pytest.fixture
def batch_oracle(monkeypatch):
    """Make every batched round propose each row's own greedy continuation (wrong from draft `wrong_from` on): long
    accepted runs, EOS and max_new_tokens inside a block, ragged acceptance across rows."""
    settings = {"wrong_from": None}

    def draft(self, batch, room):
        mask = self.model_kwargs["attention_mask"]
        rows = []
        for row in batch.rows.tolist():
            sequence = self.ids.sequence(row)[torch.cat([mask[row], mask.new_ones(self.ids.lengths[row] - self.ids.prompt_length)]).bool()]
            tokens = target_greedy_continuation(self.target, sequence[None], room)[0] if room else sequence[:0]
            if settings["wrong_from"] is not None:
                tokens[settings["wrong_from"]:] = (tokens[settings["wrong_from"]:] + 1) % self.target.config.vocab_size
            rows.append(tokens)
        return types.SimpleNamespace(token_ids=torch.stack(rows), target_logits=None)

    monkeypatch.setattr(batching_dspark.DSparkBatchGeneration, "_draft", draft)
    return settings


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_batched_greedy_is_token_identical_to_plain_batched_generate(architecture):
    """Random drafter, every batch size 2..8, EOS on and off: the same tensor as plain batched generate."""
    target = make_tiny_target(architecture)
    drafter = make_drafter(target, block_size=5)
    for size, eos, length in itertools.product([2, 3, 5, 8], [None, 7], [1, 6, 19]):
        batch = left_padded(PROMPTS[:size])
        expected = batched_greedy(target, batch, max_new_tokens=length, eos_token_id=eos)
        assert torch.equal(batched_greedy(target, batch, max_new_tokens=length, eos_token_id=eos, assistant_model=drafter),
                           expected), (size, eos, length)


@pytest.mark.parametrize("wrong_from", [None, 0, 2])
def test_batched_greedy_with_accepted_drafts_is_token_identical(batch_oracle, wrong_from):
    """Perfect and partly perfect drafts: rows accept different numbers of drafts every round (holes in the cache),
    stop on EOS inside a block, and finish at different rounds."""
    batch_oracle["wrong_from"] = wrong_from
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=5)
    batch = left_padded(PROMPTS)
    for eos, length in [(None, 23), (62, 23), (7, 9)]:
        expected = batched_greedy(target, batch, max_new_tokens=length, eos_token_id=eos)
        out = batched_greedy(target, batch, max_new_tokens=length, eos_token_id=eos, assistant_model=drafter)
        assert torch.equal(out, expected), (eos, length)
        stats = drafter.last_generation_stats
        assert (sum(stats.accepted) > 0) == (wrong_from != 0)


class StopAfterToken(StoppingCriteria):
    """A custom criterion: a row stops once it has produced `token` (per row, as transformers' criteria are)."""

    def __init__(self, token: int, prompt_length: int):
        self.token, self.prompt_length = token, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_length:] == self.token).any(dim=1)


def test_custom_stopping_criterion_and_min_new_tokens_end_rows_where_plain_generate_does(batch_oracle):
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=5)
    batch = left_padded(PROMPTS)
    width = batch["input_ids"].shape[1]
    for token in range(40, 96, 7):
        options = dict(max_new_tokens=20, eos_token_id=None, min_new_tokens=3,
                       stopping_criteria=StoppingCriteriaList([StopAfterToken(token, width)]))
        expected = batched_greedy(target, batch, **options)
        assert torch.equal(batched_greedy(target, batch, assistant_model=drafter, **options), expected), token


@pytest.mark.parametrize("wrong_from", [None, 1])
def test_processors_that_read_ids_see_each_row_at_its_index_and_length(batch_oracle, wrong_from):
    """Repetition penalty, no-repeat n-grams, min_new_tokens and a `prefix_allowed_tokens_fn` that reads the batch
    index, over ragged rows (each row's ids at its own length, called once per length on the whole batch): the same
    tensor as plain batched generate."""
    batch_oracle["wrong_from"] = wrong_from
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=5)
    batch = left_padded(PROMPTS)

    def allowed(batch_id, ids):  # each row its own window of the vocabulary, moving with its length
        start = (11 * batch_id + int(ids.shape[-1])) % 56
        return list(range(start, start + 40))

    for options in [dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=9, eos_token_id=7),
                    dict(prefix_allowed_tokens_fn=allowed, eos_token_id=None),
                    dict(prefix_allowed_tokens_fn=allowed, repetition_penalty=1.3, min_new_tokens=4, eos_token_id=62)]:
        expected = batched_greedy(target, batch, max_new_tokens=17, **options)
        out = batched_greedy(target, batch, max_new_tokens=17, assistant_model=drafter, **options)
        assert torch.equal(out, expected), options.keys()


def test_return_dict_in_generate_gives_the_same_sequences():
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    batch = left_padded(PROMPTS[:4])
    expected = batched_greedy(target, batch, max_new_tokens=8, return_dict_in_generate=True).sequences
    out = batched_greedy(target, batch, max_new_tokens=8, return_dict_in_generate=True, assistant_model=drafter)
    assert torch.equal(out.sequences, expected)


def test_finished_rows_leave_the_batch_and_the_cache_stays_compact(batch_oracle, monkeypatch):
    """After a row stops, verify passes carry fewer rows; and the holes of rejected drafts never pile up: the target's
    cache never holds much more than the longest row."""
    batch_oracle["wrong_from"] = 1  # one accepted draft per round, four holes
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=5)
    rows_seen, columns_seen = [], []
    verify = batching_dspark.DSparkBatchGeneration._verify

    def recording_verify(self, batch, tokens, counts):
        rows_seen.append(batch.rows.numel())
        columns_seen.append(batch.mask.shape[1])
        return verify(self, batch, tokens, counts)

    monkeypatch.setattr(batching_dspark.DSparkBatchGeneration, "_verify", recording_verify)
    batch = left_padded(PROMPTS[:4])
    out = batched_greedy(target, batch, max_new_tokens=60, eos_token_id=7, assistant_model=drafter)
    assert torch.equal(out, batched_greedy(target, batch, max_new_tokens=60, eos_token_id=7))
    finished_early = (out[:, batch["input_ids"].shape[1]:] == 0).any(dim=1)
    assert finished_early.any() and rows_seen[-1] < 4 and rows_seen == sorted(rows_seen, reverse=True)
    longest = batch["input_ids"].shape[1] + 60
    assert max(columns_seen) <= longest / (1 - batch_rows_dspark.COMPACT_WHEN_WASTED) + 5


def test_compaction_keeps_each_rows_columns_in_order():
    """Both caches move every row's valid columns to the right end, in order, and the mask follows."""
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1]])
    keys = torch.arange(12.0).reshape(2, 1, 6, 1)
    target_cache = DynamicCache()
    target_cache.update(keys, keys + 100, 0)
    drafter = make_drafter(make_tiny_target("llama"))
    drafter_cache = drafter.new_context_cache()
    drafter_cache.update(0, keys.clone(), keys.clone())
    rows = batch_rows_dspark.DSparkBatchRows(torch.arange(2), mask, target_cache, drafter_cache)
    rows._compact(4)
    assert rows.mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert target_cache.layers[0].keys[:, 0, :, 0].tolist() == [[5.0, 0.0, 2.0, 3.0], [7.0, 8.0, 10.0, 11.0]]
    assert drafter_cache.keys[0][:, 0, :, 0].tolist() == target_cache.layers[0].keys[:, 0, :, 0].tolist()


@pytest.mark.parametrize("options, message", [
    ({"num_beams": 2}, "beam search"),
    ({"num_return_sequences": 2, "do_sample": True}, "one sequence"),
    ({"return_dict_in_generate": True, "output_attentions": True}, "not output_attentions"),
    ({"return_dict_in_generate": True, "output_hidden_states": True}, "not output_hidden_states"),
])
def test_what_a_batch_cannot_do_is_refused_in_one_line(options, message):
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=message):
        target.generate(**left_padded(PROMPTS[:2]), max_new_tokens=4, pad_token_id=0, assistant_model=drafter, **options)


def test_right_padding_is_refused_with_the_fix():
    target = make_tiny_target("llama")
    drafter = make_drafter(target)
    right = {"input_ids": torch.tensor([[1, 17, 42], [1, 5, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    with pytest.raises(ValueError, match='padding_side="left"'):
        target.generate(**right, max_new_tokens=4, pad_token_id=0, assistant_model=drafter)


SLIDING = {  # targets whose layers attend over a window of 4 positions, all of them or some
    "gemma3 mixed": ("gemma3", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)),
    "gemma3 all sliding": ("gemma3", dict(sliding_window=4)),
    "qwen2 upper layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
}


@pytest.mark.parametrize("name, attention, packed", [("gemma3 mixed", "sdpa", False), ("gemma3 mixed", "eager", False),
                                                     ("gemma3 mixed", "sdpa", True), ("gemma3 all sliding", "sdpa", False),
                                                     ("qwen2 upper layers", "sdpa", True)])
def test_sliding_window_targets_are_served_in_batches_token_identical(batch_oracle, name, attention, packed):
    """Windows shorter than the prompts, two drafts accepted a round and the rest rejected (holes in every row), rows
    that leave: every row is plain batched generate's, padded or packed, sdpa or eager, one mask for every layer or
    one per layer type."""
    batch_oracle["wrong_from"] = 2
    architecture, window = SLIDING[name]
    target = make_tiny_target(architecture, **window)
    target.set_attn_implementation(attention)
    drafter = make_drafter(target)
    drafter.generation_config.dspark_packed_verification = packed
    batch = left_padded(PROMPTS)
    expected = batched_greedy(target, batch, max_new_tokens=24, eos_token_id=7)
    assert torch.equal(batched_greedy(target, batch, max_new_tokens=24, eos_token_id=7, assistant_model=drafter), expected)
    stats = drafter.last_generation_stats
    assert stats.packed is (packed and attention == "sdpa") and sum(stats.drafted) > sum(stats.accepted) > 0


UNPACKED_FAMILIES = {  # decoders whose layers attend without the forward's kwargs, each way transformers ships them
    "stablelm": dict(), "stablelm parallel residual": dict(use_parallel_residual=True),
    "falcon": dict(), "falcon new decoder": dict(new_decoder_architecture=True, num_kv_heads=2),
    "falcon alibi": dict(alibi=True), "nemotron": dict(),
}


@pytest.mark.parametrize("name", list(UNPACKED_FAMILIES))
def test_targets_whose_layers_drop_the_packing_are_served_padded_in_batches(batch_oracle, name):
    """StableLM, Falcon and Nemotron at batch sizes 1 to 8, packing asked for: prompts of different lengths (a packed
    prefill where packing serves), two drafts accepted a round (holes), rows that leave; every row is plain batched
    generate's, verified padded."""
    batch_oracle["wrong_from"] = 2
    target = make_tiny_target(name.split()[0], **UNPACKED_FAMILIES[name])
    drafter = make_drafter(target)
    drafter.generation_config.dspark_packed_verification = True
    for size in (1, 3, 8):
        batch = left_padded(PROMPTS[:size])
        expected = batched_greedy(target, batch, max_new_tokens=16, eos_token_id=7)
        assert torch.equal(batched_greedy(target, batch, max_new_tokens=16, eos_token_id=7, assistant_model=drafter),
                           expected), size
    stats = drafter.last_generation_stats
    assert stats.packed is False and stats.prefill_tokens == stats.prefill_padded_tokens
    assert sum(stats.drafted) > sum(stats.accepted) > 0


def test_packing_is_trusted_only_where_a_packed_forward_matches_the_padded_one():
    from dspark_hf.remote_code.packing_dspark import serves_packed

    assert serves_packed(make_tiny_target("llama")) and serves_packed(make_tiny_target("gemma3", sliding_window=4))
    assert not any(serves_packed(make_tiny_target(family)) for family in ("stablelm", "falcon", "nemotron"))


def test_attention_a_batch_cannot_serve_is_refused_in_one_line():
    target = make_tiny_target("gemma3", sliding_window=4)
    target.config.layer_types[1], target.config.attention_chunk_size = "chunked_attention", 4
    with pytest.raises(ValueError, match="full and sliding-window attention.*chunked_attention"):
        target.generate(**left_padded(PROMPTS[:2]), max_new_tokens=4, pad_token_id=0, assistant_model=make_drafter(target))


# ----------------------------------------------------------------------------------------------------------------
# Sampling: every row of a batch samples from the target's distribution


def exact_pairs(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t2, t3) of plain sampling after `prompt` (3 new tokens, t1 marginalized), by enumeration."""
    V = target.config.vocab_size
    triples = torch.tensor(list(itertools.product(range(V), repeat=3)))
    sequences = torch.cat([torch.tensor(prompt).expand(len(triples), -1), triples], dim=1)
    with torch.no_grad():
        logprobs = torch.log_softmax(target(sequences).logits.double() / temperature, dim=-1)
    L = len(prompt)
    joint = sum(logprobs[torch.arange(len(triples)), L - 1 + i, triples[:, i]] for i in range(3)).exp()
    return joint.reshape(V, V, V).sum(0)


@pytest.mark.parametrize("markov_head_type, temperature", [("vanilla", 1.0), ("rnn", 0.7)])
def test_batched_sampling_matches_plain_sampling_at_every_row_position(markov_head_type, temperature):
    target, drafter = sampling_setup(markov_head_type)
    prompts = [[1, 3, 4, 2, 3], [1, 2], [1, 3, 4, 2, 3], [1, 4, 4]]
    batch = left_padded(prompts)
    counts = torch.zeros(len(prompts), target.config.vocab_size, target.config.vocab_size)
    torch.manual_seed(0)
    accepted = 0
    for _ in range(SAMPLES):
        out = target.generate(**batch, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=0,
                              eos_token_id=None, pad_token_id=0, assistant_model=drafter)
        accepted += sum(drafter.last_generation_stats.accepted)
        for row in range(len(prompts)):
            counts[row, out[row, -2], out[row, -1]] += 1
    assert accepted > SAMPLES // 10  # drafts were accepted, not only rejected
    for row, prompt in enumerate(prompts):
        p = chi_square_p_value(counts[row], exact_pairs(target, prompt, temperature))
        assert p > ALPHA, (row, p)


# ----------------------------------------------------------------------------------------------------------------
# Batch widths and the batch verify profile


def batch_profile(slope: float, sizes=(1, 4, 16), widths=(0, 1, 3, 7)) -> DSparkBatchVerifyProfile:
    """t(B, w) = B · (1 + slope · w) / 4 + 1: a fixed cost per pass, plus work per row and per drafted slot."""
    times = [[size * (1 + slope * w) / 4 + 1 for w in widths] for size in sizes]
    return DSparkBatchVerifyProfile({"target": "synthetic", "axis": "batch"}, list(sizes), list(widths), 64, times,
                                    [[0.0] * len(widths)] * len(sizes))


def hardware_width(profile: DSparkBatchVerifyProfile, lookahead: bool = False):
    """The hardware-aware schedule of a batch, priced by this batch profile."""
    live = DSparkLiveVerifyProfile({"target": "synthetic"}, 7, batch_prior=profile)
    return scheduling_dspark.DSparkHardwareAwareSchedule(live, 7, lookahead=lookahead)


def chosen_width(schedule, confidences: list[torch.Tensor]) -> int:
    """The width a batch schedule verifies for these per-position confidences: admitted left to right, then finished."""
    return schedule.finish(drafted(schedule, confidences))


def test_batch_profile_interpolates_widths_and_batch_sizes():
    profile = batch_profile(1.0)
    assert profile.verify_time(4, 3) == pytest.approx(5.0)
    assert profile.verify_time(4, 2) == pytest.approx((profile.verify_time(4, 1) + profile.verify_time(4, 3)) / 2)
    assert profile.verify_time(2, 1) == pytest.approx((2 * profile.verify_time(1, 1) + profile.verify_time(4, 1)) / 3)
    assert profile.verify_time(32, 7) == pytest.approx(2 * profile.verify_time(16, 7))
    assert DSparkBatchVerifyProfile.from_dict(profile.to_dict()) == profile
    with pytest.raises(ValueError):
        DSparkBatchVerifyProfile.from_dict({**profile.to_dict(), "verify_time_s": [[1.0]] * 3})


@pytest.mark.parametrize("lookahead", [False, True])
def test_hardware_width_drafts_when_verifying_is_cheap_and_steps_plainly_when_it_is_dear(lookahead):
    sure = [torch.full((8,), 0.95)] * 7
    cheap = hardware_width(batch_profile(0.01), lookahead=lookahead)
    cheap.batch_size = 8
    assert chosen_width(cheap, sure) == 7
    dear = hardware_width(batch_profile(3.0), lookahead=lookahead)
    dear.batch_size = 8
    assert chosen_width(dear, sure) == 0 and dear.should_skip()  # a plain step, then the drafter rests


def test_hardware_width_grows_with_the_rows_survivals():
    """Same costs: a batch whose rows are sure drafts wider than one whose rows are not."""
    schedule = hardware_width(batch_profile(0.3))
    schedule.batch_size = 8
    assert chosen_width(schedule, [torch.full((8,), 0.9)] * 7) > chosen_width(schedule, [torch.full((8,), 0.4)] * 7)


def test_live_costs_take_their_level_from_the_first_pass_and_price_an_untried_batch_size_by_its_neighbour():
    """A prior profile is unitless: the first verify pass of a batch size sets its level at once (not a running mean
    from 1 s). A batch size that has only stepped plainly prices drafted rounds with the drafted / plain ratio of the
    nearest batch size that did both, so a row leaving never makes drafting look many times dearer than it is."""
    live = DSparkLiveVerifyProfile({"target": "synthetic"}, 7, batch_prior=batch_profile(0.0))
    live.observe(0, 64, 0.05, rows=4)
    assert live.ratio(0, 4) == pytest.approx(0.05 / 2.0)  # seconds per unit of the shape, t(4, 0) = 2
    live.observe(3, 64, 0.075, rows=4)
    live.observe(0, 64, 0.08, rows=8)
    assert live.verify_time(0, 64, 8) == pytest.approx(0.08)
    assert live.verify_time(3, 64, 8) == pytest.approx(0.08 * 1.5)
    assert live.verify_time(0, 64, 16) == pytest.approx(0.08 / 3 * 5)  # never run: batch 8's level, 16's shape
    assert live.needs_plain_step(32) and not live.needs_plain_step(8)
    assert not live.needs_plain_step(1)  # one row drafts from its first round


def test_prior_batch_profile_prices_a_token_by_device_and_dtype():
    """Without a stored table the shape follows the kind of machine: a bf16 pass is cheap per token where bf16 has
    matmul units, dearer in fp32, dearest where bf16 is emulated, and almost free on an accelerator."""
    def widening(dtype, device="cpu", name="AMD EPYC (AVX512, bf16 native), 1 thread(s)"):
        prior = DSparkLiveVerifyProfile({"device": device, "device_name": name, "dtype": dtype}, 7)
        return prior.shape(7, 64, 16) / prior.shape(0, 64, 16)

    emulated = widening("bfloat16", name="AMD EPYC (AVX2, bf16 emulated), 1 thread(s)")
    assert widening("float32", "cuda", "NVIDIA H200") < widening("bfloat16") < widening("float32") < emulated


def test_a_noisy_stored_batch_profile_gives_way_to_the_prior(tmp_path, monkeypatch):
    from dspark_hf.remote_code import profiling_dspark

    target = make_tiny_target()
    monkeypatch.setattr(profiling_dspark, "verify_profile_path", lambda key: str(tmp_path / "batch.json"))
    measured = batch_profile(0.5)
    measured.key = profiling_dspark.batch_profile_key(target)
    profiling_dspark.store_json(measured.to_dict(), str(tmp_path / "batch.json"))
    assert profiling_dspark.batch_verify_profile(target, 7).verify_time_s == measured.verify_time_s
    measured.noisy = True
    profiling_dspark.store_json(measured.to_dict(), str(tmp_path / "batch.json"))
    assert profiling_dspark.batch_verify_profile(target, 7) is None


def test_a_batch_profile_set_by_hand_prices_rounds_until_it_is_cleared(tmp_path, monkeypatch):
    """Clearing `batch_verify_profile` hands pricing back to the stored shape at once, not after a rebuild for
    another reason."""
    target = make_tiny_target()
    monkeypatch.setattr(profiling_dspark, "verify_profile_path", lambda key: str(tmp_path / "none.json"))
    state, mine = make_drafter(target).drafting_state, batch_profile(1.0)
    mine.key = profiling_dspark.batch_profile_key(target)
    state.batch_verify_profile = mine
    assert state.round_costs_for(target, 7).batch_prior is mine
    state.batch_verify_profile = None
    assert state.round_costs_for(target, 7).batch_prior is None


def test_hardware_width_probes_again_when_half_the_rows_have_left():
    """The back-off after plain steps belongs to a batch: one row finishing changes little of what pays, so the
    drafter rests on; once half the rows have left, it probes again."""
    schedule = hardware_width(batch_profile(3.0))
    for size in (8, 7, 4):
        schedule.costs.observe(0, 64, 1.0, rows=size)
    schedule.batch_size = 8
    schedule.should_skip()
    for _ in range(2):  # two rounds that drafted nothing: the drafter rests two rounds
        assert chosen_width(schedule, [torch.full((8,), 0.9)] * 7) == 0
    schedule.batch_size = 7
    assert schedule.should_skip()  # one row gone: it rests on
    schedule.batch_size = 4
    assert not schedule.should_skip()  # half gone: a probe


def test_threshold_and_verify_cost_widths_follow_the_rows():
    threshold = scheduling_dspark.DSparkDraftSchedule(threshold=0.5)
    rows = [torch.tensor([0.9, 0.3])] * 7  # the first row's survival 0.9^n falls below 0.5 after five drafts
    assert chosen_width(threshold, rows) == 6
    verify_cost = scheduling_dspark.DSparkDraftSchedule(verify_cost=0.2)
    verify_cost.batch_size = 2
    assert 0 < chosen_width(verify_cost, rows) < 7


# ----------------------------------------------------------------------------------------------------------------
# Packed verification and a draft length per row


def per_row_drafter(target, token_cost: float = 0.1, **overrides):
    """A drafter with the hardware schedule, priced by a batch profile in which every verified token costs
    `token_cost` of a one-row step: the rows' survivals then decide how many drafts each verifies."""
    drafter = make_drafter(target, block_size=6, schedule="hardware", **overrides)
    with torch.no_grad():  # confident: drafting pays whatever the tiny models' own timings say
        drafter.confidence_head.proj.bias.fill_(12.0)
    drafter.generation_config.dspark_packed_verification = True
    profile = batch_profile(0.0)
    profile.verify_time_s = [[1 + token_cost * (size * (w + 1) - 1) for w in profile.widths] for size in profile.batch_sizes]
    profile.key = profiling_dspark.batch_profile_key(target)
    drafter.drafting_state.batch_verify_profile = profile
    return drafter


def test_packed_rounds_verify_each_rows_own_drafts_and_stay_token_identical():
    """Each round's target forward verifies exactly Σ (l_r + 1) tokens, each row's anchor and its own drafts, and
    every row is still plain batched generate's (how the lengths are chosen: the next test)."""
    target = make_tiny_target("llama")
    drafter = per_row_drafter(target)
    batch = left_padded(PROMPTS)
    for length in (9, 30):
        expected = batched_greedy(target, batch, max_new_tokens=length, eos_token_id=None)
        assert torch.equal(batched_greedy(target, batch, max_new_tokens=length, eos_token_id=None,
                                          assistant_model=drafter), expected)
        stats = drafter.last_generation_stats
        assert stats.packed and len(stats.verified_tokens) == len(stats.widths) == len(stats.round_rows)
        start = 0
        for rows, tokens in zip(stats.round_rows, stats.verified_tokens):  # each round: its rows' anchors and drafts
            assert tokens == rows + sum(stats.drafted[start : start + rows])
            start += rows
        assert sum(stats.drafted) > 0


def test_the_prefill_runs_each_rows_own_tokens_and_stays_token_identical():
    """Prompts of mixed lengths go through the target packed, each row's own tokens (Σ L_r, not rows × longest), with
    every row still plain batched generate's, packed or padded rounds after it; prompts of one length, and a target
    packing cannot serve (eager attention), run plain generate's own padded prefill."""
    target = make_tiny_target("llama")
    eager = make_tiny_target("llama")
    eager.set_attn_implementation("eager")
    mixed, even = left_padded(PROMPTS), left_padded([p[:2] for p in PROMPTS])
    for model, batch, packed_prefill in ((target, mixed, True), (target, even, False), (eager, mixed, False)):
        for packed_rounds in (True, False):
            drafter = per_row_drafter(model)
            drafter.generation_config.dspark_packed_verification = packed_rounds
            expected = batched_greedy(model, batch, max_new_tokens=14, eos_token_id=None)
            out = batched_greedy(model, batch, max_new_tokens=14, eos_token_id=None, assistant_model=drafter)
            assert torch.equal(out, expected), (packed_prefill, packed_rounds)
            stats = drafter.last_generation_stats
            assert stats.prefill_padded_tokens == batch["input_ids"].numel()
            own = int(batch["attention_mask"].sum())
            assert stats.prefill_tokens == (own if packed_prefill else batch["input_ids"].numel())
    assert own < mixed["input_ids"].numel()


def test_folded_query_heads_attend_exactly_as_transformers_does():
    """A batch round's attention (several queries per row, a mask with holes, two query heads per key/value head)
    runs the query heads that share a key/value head as that head's queries: the output is bit-identical to the
    registered SDPA function's, and calls without DSpark's kwargs are that function's own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dspark_hf.remote_code import packing_dspark

    module = make_tiny_target("llama").model.layers[0].self_attn
    assert module.num_key_value_groups == 2
    attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
    original = attention.__wrapped__
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 5, 16, generator=generator)
    key, value = torch.randn(2, 3, 2, 11, 16, generator=generator)
    mask = torch.rand(3, 1, 5, 11, generator=generator) > 0.3
    mask[..., -1] = True  # every query sees a column
    expected, _ = original(module, query, key, value, mask, scaling=module.scaling)
    folded, _ = attention(module, query, key, value, mask, scaling=module.scaling, dspark_batch_round=True)
    assert torch.equal(folded, expected) and folded.shape == (3, 5, 4, 16)
    assert torch.equal(attention(module, query, key, value, mask, scaling=module.scaling)[0], expected)
    assert getattr(attention, "_dspark_attention_version", 0) == packing_dspark.ATTENTION_VERSION


def test_an_older_copys_attention_wrapper_gives_way_to_the_newest():
    """A process that loaded an older checkpoint's remote code first holds that copy's SDPA wrapper (packing only):
    installing this copy wraps what that one wrapped, once, and a second install changes nothing."""
    import functools

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    from dspark_hf.remote_code import packing_dspark

    newest = ALL_ATTENTION_FUNCTIONS["sdpa"]
    original = newest.__wrapped__

    @functools.wraps(original)
    def older(*args, dspark_packing=None, **kwargs):
        return original(*args, **kwargs)

    older._dspark_packing = True
    try:
        AttentionInterface.register("sdpa", older)
        packing_dspark.install_packed_attention()
        installed = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert installed is not older and installed.__wrapped__ is original
        assert installed._dspark_attention_version == packing_dspark.ATTENTION_VERSION
        packing_dspark.install_packed_attention()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is installed
    finally:
        AttentionInterface.register("sdpa", newest)


def test_row_lengths_rank_candidates_by_survival_and_sampling_decides_left_to_right():
    """Greedy: the best prefix of all (row, position) candidates by survival; sampling: row r's draft n is decided from
    survivals up to n only, so changing its later confidences never changes whether draft n is verified."""
    profile = batch_profile(0.0)
    profile.verify_time_s = [[1 + 0.2 * (size * (w + 1) - 1) for w in profile.widths] for size in profile.batch_sizes]

    def lengths_for(confidences: list[list[float]], lookahead: bool) -> torch.Tensor:
        schedule = hardware_width(profile, lookahead=lookahead)
        schedule.packed, schedule.batch_size = True, 3
        schedule.costs.observe(0, 64, profile.verify_time(3, 0), rows=3)  # priced as the profile says
        schedule.start()
        schedule.survivals = torch.tensor(confidences, dtype=torch.float64).cumprod(dim=0).tolist()  # per position
        return schedule.row_lengths(len(confidences), 3)

    confidences = [[0.97, 0.5, 0.8]] * 5
    for lookahead in (True, False):
        lengths = lengths_for(confidences, lookahead)
        assert lengths[0] > lengths[2] > lengths[1], lengths
    sampled = lengths_for(confidences, lookahead=False)
    later = confidences[:2] + [[0.97, 0.01, 0.01]] * 3  # rows 1 and 2 change only from position 3 on
    assert torch.equal(lengths_for(later, lookahead=False)[1:].clamp(max=2), sampled[1:].clamp(max=2))
    padded = hardware_width(profile)
    padded.batch_size = 3
    assert padded.row_lengths(4, 3).tolist() == [4, 4, 4]  # verified padded: every row the whole width


@pytest.mark.parametrize("lookahead", [False, True])
def test_packed_rows_are_cut_after_drafting_with_the_drafters_time_already_paid(lookahead):
    """By the time a packed round's rows are cut (`row_lengths`) the drafter has run: a round that verifies no drafts
    still paid for it, so the first admitted candidate does not have to earn the drafter's time back alone. With 8
    rows, a drafter costing half a plain step and cheap verified tokens, confident drafts are verified (the rule that
    charged the drafter to the first candidate alone refused every draft at T = 1: 8 rows · 0.5 > any survival)."""
    profile = batch_profile(0.0, sizes=(1, 8, 16))
    profile.verify_time_s = [[1 + 0.01 * (size * (w + 1) - 1) for w in profile.widths] for size in profile.batch_sizes]
    schedule = hardware_width(profile, lookahead=lookahead)
    schedule.packed, schedule.batch_size = True, 8
    schedule.costs.observe(0, 64, profile.verify_time(8, 0), rows=8)  # priced as the profile says
    schedule.costs.draft_time_s[8] = 0.5 * profile.verify_time(8, 0)
    schedule.start()
    schedule.survivals = torch.full((3, 8), 0.9, dtype=torch.float64).cumprod(dim=0).tolist()
    assert schedule.row_lengths(3, 8).tolist() == [3] * 8


def test_targets_packing_cannot_serve_verify_padded_and_say_so():
    """Eager attention (not the registered SDPA function packing wraps) with packing asked for, or packing not asked
    for (the default): padded rounds, the same rows, and the stats say so; a knob of the wrong kind is one line."""
    eager = make_tiny_target("llama")
    eager.set_attn_implementation("eager")
    batch = left_padded(PROMPTS[:4])
    for target, knob in ((eager, True), (make_tiny_target("llama"), None)):
        drafter = per_row_drafter(target)
        drafter.generation_config.dspark_packed_verification = knob
        expected = batched_greedy(target, batch, max_new_tokens=12, eos_token_id=None)
        assert torch.equal(batched_greedy(target, batch, max_new_tokens=12, eos_token_id=None, assistant_model=drafter),
                           expected)
        stats = drafter.last_generation_stats
        assert stats.packed is False and stats.verified_tokens == stats.padded_tokens()
    drafter.generation_config.dspark_packed_verification = "yes"
    with pytest.raises(ValueError, match="dspark_packed_verification='yes' is not a switch"):
        batched_greedy(target, batch, max_new_tokens=4, assistant_model=drafter)


def test_packed_per_row_sampling_matches_plain_sampling_at_every_row_position():
    """T = 1 with the hardware schedule's per-row lengths on packed rounds: the χ² test of every row position."""
    target, drafter = sampling_setup("vanilla")
    drafter.generation_config.dspark_schedule = "hardware"
    drafter.generation_config.dspark_packed_verification = True
    profile = batch_profile(0.0)
    profile.verify_time_s = [[1 + 0.1 * (size * (w + 1) - 1) for w in profile.widths] for size in profile.batch_sizes]
    profile.key = profiling_dspark.batch_profile_key(target)
    drafter.drafting_state.batch_verify_profile = profile
    prompts = [[1, 3, 4, 2, 3], [1, 2], [1, 3, 4, 2, 3], [1, 4, 4]]
    batch = left_padded(prompts)
    counts = torch.zeros(len(prompts), target.config.vocab_size, target.config.vocab_size)
    torch.manual_seed(0)
    drafted = []
    for _ in range(SAMPLES):
        out = target.generate(**batch, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0,
                              eos_token_id=None, pad_token_id=0, assistant_model=drafter)
        drafted += drafter.last_generation_stats.drafted
        for row in range(len(prompts)):
            counts[row, out[row, -2], out[row, -1]] += 1
    assert drafter.last_generation_stats.packed and 0 < sum(drafted) < max(drafted) * len(drafted)  # ragged lengths
    for row, prompt in enumerate(prompts):
        p = chi_square_p_value(counts[row], exact_pairs(target, prompt, 1.0))
        assert p > ALPHA, (row, p)


# ----------------------------------------------------------------------------------------------------------------
# Prompt lookup in batches: each row's own lookup drafts, priced as for one row


def lookup_batch_drafter(target, packed: bool, ngram: int = 3, **overrides):
    """A drafter whose own drafts never pay (c_n ≈ 0), prompt lookup on, every verified token cheap: a row's drafts
    then come from lookup or from nowhere."""
    drafter = per_row_drafter(target, token_cost=0.01, **overrides)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(-12.0)
    drafter.generation_config.dspark_packed_verification = packed
    drafter.generation_config.dspark_lookup_ngram_size = ngram
    return drafter


@pytest.fixture
def profile_prices(monkeypatch):
    """Rounds priced by the batch profile's shape alone, without the drafter's time: the tiny models' own timings are
    noise, and a tiny drafter costs what the tiny target costs (lookup would rarely pay)."""
    observe = DSparkLiveVerifyProfile.observe
    monkeypatch.setattr(DSparkLiveVerifyProfile, "observe", lambda self, k, context, seconds, rows=1: observe(
        self, k, context, self.shape(min(round(k), self.max_drafts), context, rows), rows))
    monkeypatch.setattr(DSparkLiveVerifyProfile, "observe_drafter", lambda self, rows, seconds: None)


class StopAtToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_a_rows_lookup_drafts_are_priced_by_what_they_add_to_the_batch_round():
    """A row's lookup drafts are weighed by the whole round: the batch's tokens against the widened round's cost, not
    one row's. Alone they pay; as one row of 16 widening a plain step they do not; where the other rows already verify
    as wide (greedy), they ride along."""
    schedule = hardware_width(batch_profile(0.05))
    lookup = scheduling_dspark.DSparkPromptLookup(2, 7)
    lookup.counts[2] = [2.0, 4.0]  # a lookup draft is accepted half the time
    sequence = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])  # "5 6" again: "7 8 5 6" followed it

    def drafts_taken(rows: int, counts=None) -> int:
        schedule.batch_size = rows
        schedule.start()
        return lookup.choose(schedule, sequence, 4, [], False, counts, 0)[0].shape[0]

    assert drafts_taken(1) > 0
    assert drafts_taken(16, [0] * 16) == 0
    assert drafts_taken(16, [0] + [4] * 15) == 4


@pytest.mark.parametrize("slope, rows", [(0.3, 1), (0.3, 4), (0.05, 4), (0.05, 16)])
def test_rows_are_looked_up_only_where_some_rows_lookup_drafts_could_be_chosen(slope, rows):
    """`may_pay` lets a round the drafter rested skip looking up every row (about 2 % of a plain step at batch 16), and
    is exact: where it says no, `choose` would have given no row lookup drafts; where it says yes, rows with a match
    get them. A plain step looks up nothing."""
    generator, answers = torch.Generator().manual_seed(0), set()
    for acceptance in (0.02, 0.1, 0.3, 0.6, 0.9, 0.99):
        schedule = hardware_width(batch_profile(slope))
        schedule.batch_size = rows
        schedule.start()
        lookup = scheduling_dspark.DSparkPromptLookup(3, 7)
        lookup.counts = {n: [acceptance * 100, 100.0] for n in lookup.counts}
        may = lookup.may_pay(schedule, 7, rows, drafter_ran=False)
        sequences = [torch.randint(0, 4, (40,), generator=generator) for _ in range(5)]
        chosen = any(lookup.choose(schedule, sequence, 7, [], False, [0] * rows, row)[1]
                     for sequence in sequences for row in range(rows))
        assert chosen == may, (acceptance, may)
        answers.add(may)
        schedule.plain_only = True
        assert not lookup.may_pay(schedule, 7, rows, drafter_ran=False)
    assert answers == {True, False}


@pytest.mark.parametrize("packed", [False, True])
def test_batched_greedy_with_prompt_lookup_is_token_identical(packed, profile_prices):
    """Each row proposes what followed its own last n-gram, in place of its drafter's drafts where lookup promises
    more, and every row is still plain batched generate's (EOS, a custom criterion and max length in the mix); what
    lookup learned is kept on the drafter for the next call, as for one row."""
    target = make_tiny_target("llama")
    drafter = lookup_batch_drafter(target, packed)
    looked_up = 0
    for size, eos, stops in [(8, None, None), (5, 7, None), (3, None, 60), (2, 7, 62)]:
        batch = left_padded(PROMPTS[:size])
        options = dict(max_new_tokens=40, eos_token_id=eos)
        if stops is not None:
            options["stopping_criteria"] = StoppingCriteriaList([StopAtToken(stops)])
        expected = batched_greedy(target, batch, **options)
        assert torch.equal(batched_greedy(target, batch, assistant_model=drafter, **options), expected), (size, eos, stops)
        stats = drafter.last_generation_stats
        assert stats.lookup_accepted <= stats.lookup_drafted <= sum(stats.drafted)
        looked_up += stats.lookup_drafted
    print(f"lookup drafts: {looked_up}")
    assert looked_up > 0 and drafter.drafting_state.lookup_counts
    drafter.generation_config.dspark_lookup_ngram_size = 0
    batched_greedy(target, left_padded(PROMPTS), max_new_tokens=40, eos_token_id=None, assistant_model=drafter)
    assert drafter.last_generation_stats.lookup_rounds == 0


@pytest.mark.parametrize("packed", [False, True])
def test_batched_sampling_with_prompt_lookup_matches_plain_sampling_at_every_row_position(packed, profile_prices):
    """Lookup drafts carry a one-hot q in a batch too: the χ² test of every row position stays exact."""
    target, drafter = sampling_setup("vanilla")
    drafter.generation_config.dspark_schedule = "hardware"
    drafter.generation_config.dspark_packed_verification = packed
    drafter.generation_config.dspark_lookup_ngram_size = 2
    profile = batch_profile(0.0)
    # a verified token costs so little that the batch's round pays for a lookup draft that is rarely right
    profile.verify_time_s = [[1 + 0.001 * (size * (w + 1) - 1) for w in profile.widths] for size in profile.batch_sizes]
    profile.key = profiling_dspark.batch_profile_key(target)
    drafter.drafting_state.batch_verify_profile = profile
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(-12.0)
    prompts = [[1, 3, 4, 2, 3], [1, 2, 2], [1, 3, 4, 3, 4], [1, 4, 4]]
    batch = left_padded(prompts)
    counts = torch.zeros(len(prompts), target.config.vocab_size, target.config.vocab_size)
    torch.manual_seed(0)
    for _ in range(SAMPLES):
        out = target.generate(**batch, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0,
                              eos_token_id=None, pad_token_id=0, assistant_model=drafter)
        for row in range(len(prompts)):
            counts[row, out[row, -2], out[row, -1]] += 1
    verified = sum(reached - scheduling_dspark.DSparkPromptLookup.prior_weight
                   for by_size in drafter.drafting_state.lookup_counts.values() for _, reached in by_size.values())
    print(f"lookup drafts verified: {verified:.0f}")
    assert verified > 100  # lookup drafts were verified hundreds of times
    for row, prompt in enumerate(prompts):
        p = chi_square_p_value(counts[row], exact_pairs(target, prompt, 1.0))
        assert p > ALPHA, (row, p)


# ----------------------------------------------------------------------------------------------------------------
# Scores and logits of a batch


def assert_same_steps(plain, drafted, new_tokens: torch.LongTensor, eos: int | None, atol: float = 1e-4):
    """Per generated step, for every row still generating there: the same values (within `atol`) and the same -inf
    entries as plain batched generate, for the processed scores and the raw logits alike."""
    for name in ("scores", "logits"):
        steps, expected = getattr(drafted, name), getattr(plain, name)
        assert len(steps) == len(expected) == new_tokens.shape[1], name
        for t, (ours, theirs) in enumerate(zip(steps, expected)):
            live = ~(new_tokens[:, :t] == eos).any(dim=1) if eos is not None else torch.ones(len(ours), dtype=torch.bool)
            ours, theirs = ours[live], theirs[live]
            assert ours.dtype == theirs.dtype and torch.equal(torch.isinf(ours), torch.isinf(theirs)), (name, t)
            finite = torch.isfinite(theirs)
            assert torch.allclose(ours[finite], theirs[finite], atol=atol, rtol=0), (name, t)


@pytest.mark.parametrize("wrong_from", [None, 2])
def test_batch_scores_and_logits_are_plain_batched_generates(batch_oracle, wrong_from):
    """`output_scores` and `output_logits` on a batch whose rows accept different numbers of drafts and stop at
    different steps, with and without processors that read ids: each step's (batch, V) tensor matches
    plain batched generate for every row still generating; a finished row's filler gives transition scores of 0."""
    batch_oracle["wrong_from"] = wrong_from
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=5)
    batch = left_padded(PROMPTS)
    for eos, processors in [(43, {}), (16, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3})]:
        options = dict(max_new_tokens=17, eos_token_id=eos, return_dict_in_generate=True, output_scores=True,
                       output_logits=True, **processors)
        plain = batched_greedy(target, batch, **options)
        drafted = batched_greedy(target, batch, assistant_model=drafter, **options)
        assert torch.equal(drafted.sequences, plain.sequences)
        new_tokens = plain.sequences[:, batch["input_ids"].shape[1]:]
        assert (new_tokens == eos).any(dim=1).sum() >= 2, "rows should finish early"
        assert_same_steps(plain, drafted, new_tokens, eos)
        transition = target.compute_transition_scores(drafted.sequences, drafted.scores, normalize_logits=True)
        finished = torch.cat([torch.zeros_like(new_tokens[:, :1]), (new_tokens == eos).long().cumsum(1)[:, :-1]], 1) > 0
        assert torch.isfinite(transition).all() and (transition[finished] == 0).all()
        assert (sum(drafter.last_generation_stats.accepted) > 0) == (wrong_from != 0)


def test_sampled_batch_scores_are_the_processed_scores_of_each_committed_token():
    """T = 0.7, top-k 10: every committed token of a row still generating has a finite processed score at its step,
    and the transition scores are log-probabilities (<= 0)."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=5)
    batch = left_padded(PROMPTS[:5])
    torch.manual_seed(0)
    out = target.generate(**batch, max_new_tokens=12, do_sample=True, temperature=0.7, top_k=10, pad_token_id=0,
                          eos_token_id=None, return_dict_in_generate=True, output_scores=True, assistant_model=drafter)
    assert out.logits is None and len(out.scores) == 12 and out.scores[0].shape == (5, target.config.vocab_size)
    transition = target.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert torch.isfinite(transition).all() and (transition <= 0).all()
    assert all(int(torch.isfinite(step).sum(dim=1).max()) <= 10 for step in out.scores)  # top-k applied


# ----------------------------------------------------------------------------------------------------------------
# The real target and the shipped drafter


def test_smollm2_batches_are_token_identical_to_plain_batched_generate(smollm2):
    """41 held-out prompts of mixed lengths (chat, multi-turn chat, code) at batch sizes 2, 3, 8 and 16, fp32 greedy,
    with stop strings, a custom criterion and EOS in the mix, the schedules alternating between whole blocks (every
    round drafts) and the shipped hardware schedule (drafts what pays here): every row equals plain batched
    generate's."""
    from dspark_hf.evaluation import load_drafter
    from dspark_hf.prompts import domain_prompts

    target, tokenizer = smollm2
    drafter = load_drafter("examples/smollm2-dspark", target, torch.float32)
    prompts = (domain_prompts("chitchat", "test", 16) + domain_prompts("chitchat-long:test:3", "test", 16)
               + domain_prompts("humaneval:all", "test", 9))
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    newline = tokenizer.encode("\n")[-1]
    groups = [(2, {"stop_strings": [". "], "tokenizer": tokenizer})] * 4 + [(3, {"custom": newline})] * 3 + [
        (8, {"stop_strings": ["!"], "tokenizer": tokenizer, "custom": newline}), (16, {})]
    start, rows, accepted = 0, 0, 0
    for turn, (size, options) in enumerate(groups):
        drafter.generation_config.dspark_schedule = ("hardware", "fixed")[turn % 2]
        batch = tokenizer(texts[start : start + size], padding=True, padding_side="left", return_tensors="pt")
        start += size
        options = dict(options)
        if "custom" in options:
            criterion = StopAfterToken(options.pop("custom"), batch["input_ids"].shape[1])
            options["stopping_criteria"] = StoppingCriteriaList([criterion])
        expected = target.generate(**batch, max_new_tokens=24, do_sample=False, **options)
        out = target.generate(**batch, max_new_tokens=24, do_sample=False, assistant_model=drafter, **options)
        assert torch.equal(out, expected), (size, options.keys(), drafter.generation_config.dspark_schedule)
        rows, accepted = rows + size, accepted + sum(drafter.last_generation_stats.accepted)
    assert rows == len(prompts) >= 32 and accepted > 0  # drafts were accepted


def test_smollm2_batch_scores_match_plain_batched_generate(smollm2):
    """The real target, the shipped drafter, fp32 greedy, six mixed prompts in batches of 3 and 6 ending at EOS or
    max_new_tokens: scores and logits within 1e-4 of plain batched generate's for every row still generating."""
    from dspark_hf.evaluation import load_drafter
    from dspark_hf.prompts import domain_prompts

    target, tokenizer = smollm2
    drafter = load_drafter("examples/smollm2-dspark", target, torch.float32)
    drafter.generation_config.dspark_schedule = "fixed"
    prompts = domain_prompts("chitchat", "test", 3) + domain_prompts("humaneval:all", "test", 3)
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    for size in (3, 6):
        batch = tokenizer(texts[-size:], padding=True, padding_side="left", return_tensors="pt")
        options = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
                       output_logits=True)
        plain = target.generate(**batch, **options)
        drafted = target.generate(**batch, **options, assistant_model=drafter)
        assert torch.equal(drafted.sequences, plain.sequences)
        new_tokens = plain.sequences[:, batch["input_ids"].shape[1]:]
        assert_same_steps(plain, drafted, new_tokens, target.generation_config.eos_token_id)
        assert sum(drafter.last_generation_stats.accepted) > 0


def test_profile_command_shows_the_batch_axis(tmp_path, monkeypatch, capsys):
    """`dspark-hf profile --batch-sizes 1 2 4`: t(B, w) measured, stored beside t(k) under its own key, printed."""
    from dspark_hf import cli

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    make_tiny_target("llama").save_pretrained(tmp_path / "tiny")
    code = cli.main(["profile", "--target", str(tmp_path / "tiny"), "--dtype", "float32", "--max-drafts", "3",
                     "--contexts", "8", "--repeats", "2", "--batch-sizes", "4", "1", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "batched verify cost t(B, w)" in out
    stored = sorted((tmp_path / "hf" / "dspark" / "profiles").glob("*.json"))
    batch = [DSparkBatchVerifyProfile.from_dict(json.loads(p.read_text())) for p in stored if '"axis"' in p.read_text()]
    assert len(stored) == 2 and len(batch) == 1
    assert batch[0].batch_sizes == [1, 2, 4] and batch[0].widths == [0, 1, 3] and batch[0].key["axis"] == "batch"
