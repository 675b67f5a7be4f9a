"""Hardware-aware draft length: the verify-cost profile, the schedule's choices, the drafter back-off, prompt-lookup
drafts priced by the same schedule, and that generation stays lossless with the schedule on. Profiles are synthetic (injected), so nothing here is timed."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_drafter, make_tiny_target
from test_generation import (
    ALPHA,
    PROMPTS,
    chi_square_p_value,
    exact_pair_distribution,
    greedy,
    sample_pairs,
    sampling_setup,
)

from dspark_hf import DSparkForDrafting, cli, measuring
from dspark_hf.remote_code import generation_dspark, live_profiling_dspark, modeling_dspark, profiling_dspark
from dspark_hf.remote_code.live_profiling_dspark import DSparkLiveVerifyProfile
from dspark_hf.remote_code.settings_dspark import DSparkDraftingSettings
from dspark_hf.remote_code.profiling_dspark import (
    DSparkVerifyProfile,
    store_json,
    verify_profile_key,
    verify_profile_path,
)
from dspark_hf.remote_code.scheduling_dspark import (
    DSparkDrafterBackoff,
    DSparkHardwareAwareSchedule,
    DSparkPromptLookup,
    make_schedule,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2-dspark"


def synthetic_profile(times: list[float], key: dict | None = None, noisy: bool = False) -> DSparkVerifyProfile:
    """t(k) = times[k] at every context length (16 and 256 tokens)."""
    return DSparkVerifyProfile(
        key=key or {"target": "synthetic"}, context_lengths=[16, 256], verify_time_s=[list(times), list(times)],
        spread_s=[[0.0] * len(times)] * 2, noisy=noisy,
    )


def linear_profile(slope: float, max_drafts: int = 7, **kwargs) -> DSparkVerifyProfile:
    """A verify pass of k drafts costs 1 + slope·k (in units of a plain step)."""
    return synthetic_profile([1.0 + slope * k for k in range(max_drafts + 1)], **kwargs)


def live(profile: DSparkVerifyProfile) -> DSparkLiveVerifyProfile:
    """A measured profile as the shape of a live one (what `make_schedule` hands a schedule), kept in memory."""
    return DSparkLiveVerifyProfile(profile.key, profile.max_drafts, profile)


def row_schedule(profile: DSparkLiveVerifyProfile, draft_time_s: float | None = None, **kwargs):
    """The hardware-aware schedule of one row, priced by this live profile and a drafter time."""
    if draft_time_s is not None:
        profile.draft_time_s[1] = draft_time_s
    return DSparkHardwareAwareSchedule(profile, **kwargs)


def pinned_draft_time(seconds: float):
    """`DSparkLiveVerifyProfile.observe` (each round's last word) with one row's drafter time pinned at `seconds`: what
    else it learns is learned as ever (a batch's drafter time and verify passes)."""
    original = DSparkLiveVerifyProfile.observe

    def observe(self, num_drafts, context_length, verify_s, rows=1):
        original(self, num_drafts, context_length, verify_s, rows)
        if rows == 1:
            self.draft_time_s[1] = seconds
    return observe


def observe(schedule, num_drafted: int, num_accepted: int, verify_s: float = 1.0, draft_s: float | None = None,
            drafter_ran: bool = True):
    """One row's round outcome, as the candidate generator reports it."""
    return schedule.observe_round(torch.tensor([num_drafted]), torch.tensor([num_accepted]), drafter_ran, draft_s,
                                  verify_s)


def drafted(schedule: DSparkHardwareAwareSchedule, confidences: list[float]) -> int:
    """How many drafts the schedule admits, left to right, for these calibrated confidences c_1, c_2, ... (one row's
    numbers, or a tensor of every row's per position)."""
    schedule.start()
    count = 0
    for c in confidences:
        if not schedule.admit(torch.as_tensor(c, dtype=torch.float64).reshape(-1)):
            break
        count += 1
    return count


# ----------------------------------------------------------------------------------------------------------------
# The schedule's decisions


def test_no_drafts_when_every_extra_token_costs_a_full_step():
    """t(k) = (1 + k)·t(0): even near-certain drafts cannot beat a plain step (expected tokens < 1 + k)."""
    schedule = row_schedule(live(linear_profile(1.0)), draft_time_s=0.0)
    assert drafted(schedule, [0.99] * 7) == 0
    assert drafted(schedule, [0.3] * 7) == 0


def test_full_blocks_when_verify_is_nearly_free():
    schedule = row_schedule(live(linear_profile(0.01)), draft_time_s=0.05)
    assert drafted(schedule, [0.8] * 7) == 7


def test_cheaper_verify_means_longer_blocks():
    lengths = [drafted(row_schedule(live(linear_profile(s)), draft_time_s=0.05), [0.7] * 7)
               for s in (0.01, 0.1, 0.25, 0.5, 1.0)]
    assert lengths == sorted(lengths, reverse=True)
    assert lengths[0] == 7 and 0 < lengths[2] < 7 and lengths[-1] == 0


def test_no_drafts_when_the_drafter_costs_more_than_it_saves():
    """Flat t(k), but the drafter's own time per round is three plain steps: drafting cannot pay."""
    assert drafted(row_schedule(live(linear_profile(0.0)), draft_time_s=3.0), [0.7] * 7) == 0
    assert drafted(row_schedule(live(linear_profile(0.0)), draft_time_s=0.1), [0.7] * 7) == 7


def test_block_stops_where_confidence_drops():
    schedule = row_schedule(live(linear_profile(0.1)), draft_time_s=0.05)
    assert drafted(schedule, [0.95, 0.95, 0.9, 0.05, 0.95, 0.95, 0.95]) == 3


def test_min_gain_raises_the_bar_for_drafting_but_not_the_length_of_a_drafted_block():
    """A drafted round must promise `min_gain` × a plain step's rate; among drafted lengths nothing changes."""
    marginal, sure = [0.45] * 7, [0.95, 0.95, 0.9, 0.05, 0.95, 0.95, 0.95]
    plain_bar = row_schedule(live(linear_profile(0.3)), draft_time_s=0.05)
    raised_bar = row_schedule(live(linear_profile(0.3)), draft_time_s=0.05, min_gain=1.3)
    assert drafted(plain_bar, marginal) > 0 and drafted(raised_bar, marginal) == 0
    assert drafted(plain_bar, sure) == drafted(raised_bar, sure) == 3


def proposed(schedule: DSparkHardwareAwareSchedule, confidences: list[float]) -> int:
    """How many drafts a lookahead schedule proposes after drafting while it admits (`finish` may cut back)."""
    return schedule.finish(drafted(schedule, confidences))


def test_greedy_lookahead_sees_past_a_weak_first_draft_and_cuts_back_after_a_dip():
    """Left to right, c_1 = 0.15 projects a hopeless block; seeing c_2.. = 0.95 the whole block pays. Where the
    verify cost jumps at k = 3, three sure drafts lure a left-to-right schedule past it; with lookahead it drafts
    on (later drafts could have been sure), sees c_4 fall and proposes k = 2, the better stop."""
    weak_start = [0.15] + [0.95] * 6
    left_to_right = row_schedule(live(linear_profile(0.1)), draft_time_s=0.05)
    lookahead = row_schedule(live(linear_profile(0.1)), draft_time_s=0.05, lookahead=True)
    assert drafted(left_to_right, weak_start) == 0 and proposed(lookahead, weak_start) == 7
    assert drafted(lookahead, [0.01] * 7) == 0  # nothing later could rescue it: the drafter stops at once

    jump, fall = synthetic_profile([1.0, 1.2, 1.4, 2.5, 2.6, 2.7, 2.8, 2.9]), [0.9, 0.9, 0.9, 0.2, 0.2, 0.2, 0.2]
    assert drafted(row_schedule(live(jump), draft_time_s=0.05), fall) >= 3
    lookahead = row_schedule(live(jump), draft_time_s=0.05, lookahead=True)
    assert drafted(lookahead, fall) == 3 and lookahead.finish(3) == 2


def test_schedule_follows_the_context_length_and_the_live_verify_speed():
    """Verify cost interpolated at the current context; a drafter time that grows relative to the (rescaled) verify."""
    profile = DSparkVerifyProfile(
        key={"target": "synthetic"}, context_lengths=[16, 256],
        verify_time_s=[[1.0 + 0.01 * k for k in range(8)], [1.0 + 1.0 * k for k in range(8)]], spread_s=[[0.0] * 8] * 2,
    )
    assert profile.verify_time(3, 136) == pytest.approx((1.03 + 4.0) / 2)
    schedule = row_schedule(live(profile), draft_time_s=0.05)
    schedule.context_length = 16
    assert drafted(schedule, [0.8] * 7) == 7
    schedule.context_length = 256
    assert drafted(schedule, [0.8] * 7) == 0
    schedule.context_length = 16
    for _ in range(40):  # the drafter's own time per round grows to half a profiled step: still worth it
        observe(schedule, 0, 0, draft_s=0.5)
    assert schedule.costs.draft_time_s[1] == pytest.approx(0.5, rel=1e-2)
    assert drafted(schedule, [0.8] * 7) == 7
    for _ in range(40):  # verify passes now run 10× faster than profiled: the same drafter time weighs 10× more
        observe(schedule, 0, 0, verify_s=0.1, drafter_ran=False)
    assert schedule.costs.verify_time(0, 16) == pytest.approx(0.1, rel=1e-2)
    assert schedule.costs.verify_time(7, 16) == pytest.approx(0.107, rel=1e-2)  # k unseen: its neighbours' ratio
    schedule.start()
    assert drafted(schedule, [0.8] * 7) == 0


def test_a_draft_count_priced_far_above_the_rest_is_priced_by_its_neighbours_until_it_is_run_again():
    """Passes of one k timed while the machine stalled (or by an older process) can price that k so high that the
    schedule never runs it again, and so never corrects it: one k at 25× the lowest ratio is priced by its neighbours;
    a pass 3× slower is taken as measured; once it has run at its usual speed again, its own ratio prices it."""
    costs = live(linear_profile(0.1))
    for k in range(8):
        costs.observe(k, 16, 1.0 + 0.1 * k)  # every k as profiled: ratio 1
    costs.observe(3, 16, 49.0 * 1.3)  # a 49× stall: k = 3's running mean is now 25× the others'
    assert costs.verify_time(3, 16) == pytest.approx(1.3)
    schedule = row_schedule(costs, draft_time_s=0.0)
    schedule.context_length = 16
    assert schedule.finish(drafted(schedule, [0.99, 0.99, 0.99, 0.01])) == 3  # as if it had never stalled
    for _ in range(20):
        costs.observe(3, 16, 1.3)
    assert costs.verify_time(3, 16) == pytest.approx(1.3 * costs.ratios[1][3]) and costs.ratios[1][3] > 1.01
    costs.observe(5, 16, 3.0 * 1.5)  # slower, but not far above the rest: priced as measured
    assert costs.verify_time(5, 16) == pytest.approx(1.5 * costs.ratios[1][5]) and costs.ratios[1][5] == pytest.approx(2.0)


def test_noisy_profile_falls_back_to_the_threshold_rule():
    """On a noisy profile the schedule admits while a_n = Π c_i ≥ 0.5, whatever the timings say."""
    assert drafted(row_schedule(live(linear_profile(1.0)), draft_time_s=0.0), [0.8] * 7) == 0
    noisy = row_schedule(live(linear_profile(1.0, noisy=True)), draft_time_s=0.0)
    assert drafted(noisy, [0.8] * 7) == 3  # 0.8, 0.64, 0.512, then 0.41 < 0.5


def test_profile_noise_is_detected_from_the_timings(monkeypatch):
    """Timings that cannot rank k (one spread wider than a quarter of its median, or typical spreads over 10 %)
    mark the profile noisy; clean timings do not, nor does a consistent inversion (another CPU kernel), which the
    profile keeps as measured: every k is timed, none interpolated or smoothed."""
    target = make_tiny_target("llama")

    def fake_timings(samples_per_k):
        monkeypatch.setattr(measuring, "_time_verify_passes", lambda *args: [list(s) for s in samples_per_k])
        return measuring.measure_verify_profile(target, 3, context_lengths=(16,), repeats=4)

    clean = fake_timings([[1.0, 1.01, 1.0, 1.02], [1.1, 1.1, 1.11, 1.1], [1.2, 1.21, 1.2, 1.2], [1.4, 1.4, 1.41, 1.4]])
    assert not clean.noisy
    assert clean.verify_time_s[0] == pytest.approx([1.01, 1.1, 1.2, 1.4], abs=0.011)
    inverted = fake_timings([[1.0] * 4, [1.3] * 4, [1.0] * 4, [1.4] * 4])  # t(2) < t(1) every time: real
    assert not inverted.noisy
    assert inverted.verify_time_s[0] == pytest.approx([1.0, 1.3, 1.0, 1.4])
    assert fake_timings([[1.0, 1.0, 2.0, 2.0], [1.1] * 4, [1.2] * 4, [1.4] * 4]).noisy  # one wide spread
    jittery = [[0.85 * t, 0.95 * t, 1.08 * t, 1.2 * t] for t in (1.0, 1.1, 1.2, 1.4)]  # every spread 13 %
    assert fake_timings(jittery).noisy


def test_measured_profile_times_every_draft_count(monkeypatch):
    """The profile asks the timer for every k = 0..max_drafts (a CPU's t(k) is not monotone: fp32 on the 2-core
    EPYC verifies 3 tokens slower than 4, so no k may be interpolated from its neighbours)."""
    target = make_tiny_target("llama")
    asked = []

    def timer(target, tokens, length, counts, repeats):
        asked.append(list(counts))
        return [[1.0 + 0.1 * k] * repeats for k in counts]

    monkeypatch.setattr(measuring, "_time_verify_passes", timer)
    profile = measuring.measure_verify_profile(target, 5, context_lengths=(16, 32), repeats=4)
    assert asked == [[0, 1, 2, 3, 4, 5]] * 2
    assert profile.max_drafts == 5


# ----------------------------------------------------------------------------------------------------------------
# Online recalibration: the confidences learn, within and across generate calls, how often drafts really survive


def test_online_bias_learns_from_the_drafts_verification_reached():
    """Each reached draft (all before it accepted) is one outcome; drafts after the first rejection teach nothing."""
    schedule = row_schedule(live(linear_profile(0.0)), draft_time_s=0.0)
    assert drafted(schedule, [0.5] * 3) == 3
    assert observe(schedule, 3, 0) == (pytest.approx(0.5), 0, 1)  # draft 1 rejected: drafts 2, 3 never verified
    assert schedule.bias == pytest.approx(-schedule.recalibration_rate * 0.5)
    drafted(schedule, [0.5] * 3)
    predicted, accepted, reached = observe(schedule, 3, 3)  # all three accepted: the bias rises again
    assert accepted == reached == 3 and schedule.bias > 0
    for _ in range(500):  # a long run of misses lowers confidences, but never pins them at 0
        drafted(schedule, [0.9] * 3)
        observe(schedule, 3, 0)
    assert schedule.bias == -schedule.max_bias


def test_lowered_confidences_draft_fewer_tokens():
    """The same offline confidences, after the bias learned that they overstate survival, buy shorter blocks."""
    trusting = row_schedule(live(linear_profile(0.3)), draft_time_s=0.0)
    doubtful = row_schedule(live(linear_profile(0.3)), draft_time_s=0.0)
    doubtful.bias = -1.5
    assert drafted(trusting, [0.8] * 7) > drafted(doubtful, [0.8] * 7) > 0


def test_online_bias_carries_over_between_generate_calls_of_one_decoding_setting():
    """An untrained drafter's confident drafts are rejected: the greedy bias falls over the first call, the second
    call starts where the first ended, sampling keeps its own; the text stays the target's own."""
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0] * 6, confident=False)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(2.0)  # c ≈ 0.88 for every draft of a random drafter
    expected = greedy(target, PROMPTS[0], max_new_tokens=24, eos_token_id=None)
    assert torch.equal(greedy(target, PROMPTS[0], max_new_tokens=24, eos_token_id=None, assistant_model=drafter), expected)
    (key, first), = drafter.drafting_state.confidence_bias.items()
    assert key[1] == "greedy" and first < 0
    stats = drafter.last_generation_stats
    assert stats.confidence_observed < stats.confidence_predicted  # the drafts survived less often than predicted
    assert torch.equal(greedy(target, PROMPTS[0], max_new_tokens=24, eos_token_id=None, assistant_model=drafter), expected)
    assert drafter.drafting_state.confidence_bias[key] < first
    target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=8, do_sample=True, assistant_model=drafter)
    assert len(drafter.drafting_state.confidence_bias) == 2 and drafter.drafting_state.confidence_bias[key] < first


# ----------------------------------------------------------------------------------------------------------------
# Back-off: the drafter's own cost vanishes when drafting does not pay


def test_backoff_skips_the_drafter_exponentially_and_resets_when_drafting_resumes():
    backoff = DSparkDrafterBackoff(max_skip=8)
    pattern = []
    for _ in range(30):
        if backoff.should_skip():
            pattern.append("s")
            continue
        pattern.append("p")
        backoff.record(0)  # every probe still drafts nothing
    assert "".join(pattern).startswith("ps" + "p" + "ss" + "p" + "ssss" + "p" + "s" * 8 + "p" + "s" * 8 + "p")
    backoff.record(3)
    assert not backoff.should_skip()


# ----------------------------------------------------------------------------------------------------------------
# Generation with the schedule on (fp32): lossless, and the choices show in the statistics


def scheduled_drafter(target, profile_times, confident: bool = True, **overrides):
    drafter = make_drafter(target, block_size=6, **overrides)
    drafter.generation_config.dspark_schedule = "hardware"
    if profile_times is not None:
        drafter.drafting_state.verify_profile = synthetic_profile(profile_times, key=verify_profile_key(target))
    if confident and drafter.confidence_head is not None:  # c_n ≈ 1: only the costs decide
        with torch.no_grad():
            drafter.confidence_head.proj.bias.fill_(12.0)
    return drafter


def test_every_priced_round_is_reported_with_what_it_took(monkeypatch):
    """One row and a batch: each plain step and drafted round carries the seconds the schedule priced it at before it
    ran (the frozen profile's t(k) plus the drafter's time) beside the seconds it took; rounds whose drafts were all
    refused are not priced (the schedule never chooses them). `eval`/`bench` report the medians of priced / took."""
    from dspark_hf.evaluation import live_acceptance

    monkeypatch.setattr(DSparkLiveVerifyProfile, "observe", pinned_draft_time(0.25))
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0 + 0.05 * k for k in range(6)])
    greedy(target, PROMPTS[0], max_new_tokens=16, eos_token_id=None, assistant_model=drafter)
    stats = drafter.last_generation_stats
    drafted = [(k, price) for (d, price, took), k in zip(stats.round_prices, stats.drafted) if d]
    assert drafted and all(price == pytest.approx(1.0 + 0.05 * k + 0.25) for k, price in drafted[1:])
    assert all(took > 0 for _, _, took in stats.round_prices)
    live = live_acceptance(stats)
    assert live["drafted_rounds_priced"] == len(drafted) and live["drafted_price_ratio"] > 0
    batch = {"input_ids": torch.tensor([[0, 1, 17, 42], [1, 5, 5, 5]]), "attention_mask": torch.tensor([[0, 1, 1, 1], [1] * 4])}
    target.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None, assistant_model=drafter)
    stats = drafter.last_generation_stats
    assert {d for d, _, _ in stats.round_prices} == {False, True}  # the first plain step is timed, then rounds draft
    assert len(stats.round_prices) <= len(stats.widths)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("slope", [0.0, 1.5])
def test_greedy_with_hardware_schedule_is_token_identical(architecture, slope):
    target = make_tiny_target(architecture)
    drafter = scheduled_drafter(target, [1.0 + slope * k for k in range(6)])
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=24)
        assert torch.equal(greedy(target, prompt, max_new_tokens=24, assistant_model=drafter), expected)
        stats = drafter.last_generation_stats
        if slope > 1.0:  # drafting cannot pay: plain steps only
            assert sum(stats.drafted) == 0
        else:
            assert sum(stats.drafted) > 0


DRAFT_TIME_S = 0.2  # a drafting round against the synthetic profile's 1 s plain step


def test_greedy_lookahead_proposes_fewer_than_it_drafted_and_stays_token_identical(monkeypatch):
    """An uncalibrated confidence head (c_n all over the place) under a steep profile: rounds are cut back after
    drafting, and greedy output is still exactly plain generate's."""
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0, 1.05, 1.1, 2.5, 2.6, 2.7], confident=False)
    cuts, original = [], DSparkHardwareAwareSchedule.finish

    def finish(self, num_drafted):
        kept = original(self, num_drafted)
        cuts.append((num_drafted, kept))
        return kept

    monkeypatch.setattr(DSparkHardwareAwareSchedule, "finish", finish)
    # the costs are the profile's and a fixed draft time, not the live timings, so the choices depend on the
    # confidences alone, not on how busy the machine is
    monkeypatch.setattr(DSparkLiveVerifyProfile, "observe", pinned_draft_time(DRAFT_TIME_S))
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=24, eos_token_id=None)
        assert torch.equal(greedy(target, prompt, max_new_tokens=24, eos_token_id=None, assistant_model=drafter), expected)
    assert any(kept < num for num, kept in cuts) and any(kept > 0 for _, kept in cuts)


def test_lookahead_is_on_for_greedy_only_and_can_be_turned_off(monkeypatch):
    seen, original = [], DSparkHardwareAwareSchedule.finish
    monkeypatch.setattr(DSparkHardwareAwareSchedule, "finish", lambda self, n: seen.append(self.lookahead) or original(self, n))
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0 + 0.1 * k for k in range(6)])
    greedy(target, PROMPTS[0], max_new_tokens=8, eos_token_id=None, assistant_model=drafter)
    assert seen and all(seen)
    greedy_rounds = len(seen)
    target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=True, eos_token_id=None, pad_token_id=0,
                    assistant_model=drafter)
    assert seen[greedy_rounds:] and not any(seen[greedy_rounds:])  # sampling never cuts a block back
    sampled_rounds = len(seen)
    drafter.generation_config.dspark_lookahead = False
    greedy(target, PROMPTS[0], max_new_tokens=8, eos_token_id=None, assistant_model=drafter)
    assert len(seen) > sampled_rounds and not any(seen[sampled_rounds:])


def test_skipped_rounds_reach_the_drafter_context_in_one_later_extension(monkeypatch):
    """Rounds that skip the drafter stash their aux rows; when it runs again its context equals a fresh one."""
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0] * 6)
    skips = iter([False, True, True, False, True, False] + [False] * 50)
    monkeypatch.setattr(DSparkDrafterBackoff, "should_skip", lambda self: next(skips))
    original, checked = drafter.draft_block, []

    def draft_block(cache, anchor_id, input_ids=None, **kwargs):
        context = input_ids[:, :-1]
        hidden = target(context, output_hidden_states=True).hidden_states
        fresh = drafter.extend_context(
            modeling_dspark.DSparkContextCache(),
            torch.cat([hidden[i] for i in drafter.config.aux_hidden_state_layer_ids], dim=-1),
        )
        assert cache.get_seq_length() == context.shape[1]
        torch.testing.assert_close(cache[0][0], fresh[0][0], rtol=1e-4, atol=1e-5)
        checked.append(context.shape[1])
        return original(cache, anchor_id, input_ids=input_ids, **kwargs)

    drafter.draft_block = draft_block
    expected = greedy(target, PROMPTS[1], max_new_tokens=20, eos_token_id=None)
    assert torch.equal(greedy(target, PROMPTS[1], max_new_tokens=20, eos_token_id=None, assistant_model=drafter), expected)
    assert len(checked) >= 3 and drafter.last_generation_stats.drafted[1:3] == [0, 0]


def test_sampling_with_hardware_schedule_matches_plain_sampling():
    target, drafter = sampling_setup("vanilla")
    drafter.generation_config.dspark_schedule = "hardware"
    drafter.drafting_state.verify_profile = synthetic_profile([1.0, 1.2, 1.4], key=verify_profile_key(target))
    counts = sample_pairs(target, drafter, 1.0, seed=2)
    assert chi_square_p_value(counts, exact_pair_distribution(target, 1.0)) > ALPHA


def test_drafter_without_confidence_head_keeps_fixed_length():
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, None, enable_confidence_head=False)
    out = greedy(target, PROMPTS[0], max_new_tokens=40, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(out, greedy(target, PROMPTS[0], max_new_tokens=40, eos_token_id=None))
    assert drafter.last_generation_stats.drafted[:4] == [drafter.num_draft_tokens] * 4


def test_explicit_threshold_knob_takes_precedence_over_the_hardware_schedule():
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0 + 2.0 * k for k in range(6)])  # hardware would draft nothing
    drafter.generation_config.dspark_confidence_threshold = 0.01
    greedy(target, PROMPTS[0], max_new_tokens=12, eos_token_id=None, assistant_model=drafter)
    assert sum(drafter.last_generation_stats.drafted) > 0


def test_min_gain_knob_reaches_the_schedule_and_bad_values_fail_clearly():
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0 + 0.2 * k for k in range(6)])
    greedy(target, PROMPTS[0], max_new_tokens=12, eos_token_id=None, assistant_model=drafter)
    assert sum(drafter.last_generation_stats.drafted) > 0
    drafter.generation_config.dspark_min_gain = 50.0  # no round can promise 50× a plain step
    greedy(target, PROMPTS[0], max_new_tokens=12, eos_token_id=None, assistant_model=drafter)
    assert sum(drafter.last_generation_stats.drafted) == 0
    drafter.generation_config.dspark_min_gain = "fast"
    with pytest.raises(ValueError, match="dspark_min_gain='fast' is not a positive number"):
        greedy(target, PROMPTS[0], max_new_tokens=4, assistant_model=drafter)


def test_unknown_schedule_name_fails_clearly():
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, None)
    drafter.generation_config.dspark_schedule = "fastest"
    with pytest.raises(ValueError, match="dspark_schedule='fastest' is not a DSpark schedule"):
        greedy(target, PROMPTS[0], max_new_tokens=4, assistant_model=drafter)


@pytest.mark.parametrize("knob, value, message", [
    ("dspark_confidence_threshold", "high", "dspark_confidence_threshold='high' is not a probability"),
    ("dspark_confidence_threshold", 1.5, "dspark_confidence_threshold=1.5 is not a probability"),
    ("dspark_verify_cost", "x", "dspark_verify_cost='x' is not a cost"),
    ("dspark_verify_cost", -1.0, "dspark_verify_cost=-1.0 is not a cost"),
    ("num_assistant_tokens", 0, "num_assistant_tokens=0 is not a number of drafts; use 1 to 5"),
    ("num_assistant_tokens", -2, "num_assistant_tokens=-2 is not a number of drafts"),
])
def test_a_drafting_knob_of_the_wrong_kind_is_one_line_naming_it(knob, value, message):
    """Before a round runs, one batch row or many: a TypeError or ZeroDivisionError escaped here before."""
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0] * 6)
    setattr(drafter.generation_config, knob, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        greedy(target, PROMPTS[0], max_new_tokens=4, assistant_model=drafter)
    batch = {"input_ids": torch.tensor([PROMPTS[0], PROMPTS[0]])}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        target.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=0, assistant_model=drafter)


def test_more_drafts_than_the_block_means_the_whole_block():
    target = make_tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.generation_config.num_assistant_tokens = 20  # transformers' own default for an assistant
    greedy(target, PROMPTS[0], max_new_tokens=12, eos_token_id=None, assistant_model=drafter)
    assert max(drafter.last_generation_stats.drafted) == 3


def test_every_drafter_drafts_with_the_hardware_schedule_and_lookup_unless_it_says_otherwise(tmp_path):
    """A new drafter (what train, convert and --init-from make), a checkpoint saved without those keys (as the README
    pipeline saved them before: {"num_assistant_tokens": 7}) and one without generation_config.json all draft with
    the shipped defaults; a checkpoint that sets a key keeps it."""
    target = make_tiny_target("llama")
    drafter = make_drafter(target, schedule="hardware")
    defaults = {"dspark_schedule": "hardware", "dspark_lookup_ngram_size": 4, "num_assistant_tokens": 3}
    assert {k: getattr(drafter.generation_config, k) for k in defaults} == defaults
    assert DSparkDraftingSettings.from_drafter(drafter).hardware
    drafter.save_pretrained(tmp_path / "new")
    (tmp_path / "new" / "generation_config.json").write_text('{"num_assistant_tokens": 2}')  # an older save
    older = DSparkForDrafting.from_pretrained(tmp_path / "new")
    assert (older.generation_config.dspark_schedule, older.generation_config.dspark_lookup_ngram_size) == ("hardware", 4)
    assert older.generation_config.num_assistant_tokens == 2
    (tmp_path / "new" / "generation_config.json").unlink()
    assert DSparkForDrafting.from_pretrained(tmp_path / "new").generation_config.dspark_schedule == "hardware"
    (tmp_path / "new" / "generation_config.json").write_text('{"dspark_schedule": "fixed", "dspark_lookup_ngram_size": 0}')
    fixed = DSparkForDrafting.from_pretrained(tmp_path / "new")
    assert (fixed.generation_config.dspark_schedule, fixed.generation_config.dspark_lookup_ngram_size) == ("fixed", 0)
    assert not DSparkDraftingSettings.from_drafter(fixed).hardware


def test_shipped_generation_config_turns_the_hardware_schedule_on():
    settings = json.loads((EXAMPLE / "generation_config.json").read_text())
    assert settings["dspark_schedule"] == "hardware" and settings["dspark_lookup_ngram_size"] == 4
    assert "dspark_confidence_threshold" not in settings and "dspark_verify_cost" not in settings


# ----------------------------------------------------------------------------------------------------------------
# Prompt-lookup drafts, priced by the hardware schedule against the drafter's


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    lookup = DSparkPromptLookup(max_ngram=3, max_tokens=4)
    tokens, ngram = lookup.propose(torch.tensor([5, 6, 7, 8, 5, 6]), budget=3)
    assert ngram == 2 and tokens.tolist() == [7, 8, 5]
    tokens, ngram = lookup.propose(torch.tensor([1, 2, 9, 1, 2, 7, 1, 2]), budget=8)
    assert ngram == 2 and tokens.tolist() == [7, 1, 2]  # the latest earlier occurrence, not the first
    tokens, ngram = lookup.propose(torch.tensor([4, 1, 2, 3, 9, 1, 2, 3]), budget=8)
    assert ngram == 3 and tokens.tolist() == [9, 1, 2, 3]  # the longest n-gram that occurs; at most max_tokens
    assert lookup.propose(torch.tensor([1, 2, 3]), budget=4)[1] == 0


def test_prompt_lookup_learns_its_acceptance_per_ngram_size():
    lookup = DSparkPromptLookup(max_ngram=3, max_tokens=7)
    assert lookup.survivals(1, 2) == [0.25, 0.0625] and lookup.survivals(3, 1) == [0.5]  # longer matches start higher
    lookup.observe(2, num_drafted=4, num_accepted=4)
    lookup.observe(1, num_drafted=4, num_accepted=0)  # only the first draft was reached
    assert lookup.survivals(2, 1) == [pytest.approx((1.6 + 4) / (4 + 4))]
    assert lookup.survivals(1, 1) == [pytest.approx(1 / 5)] and lookup.survivals(3, 1) == [0.5]


def lookup_drafter(target, profile_times):
    """A drafter whose own drafts never pay (c_n ≈ 0), prompt lookup on."""
    drafter = scheduled_drafter(target, profile_times, confident=False)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(-12.0)
    drafter.generation_config.dspark_lookup_ngram_size = 3
    return drafter


def test_greedy_with_prompt_lookup_is_token_identical():
    target = make_tiny_target("llama")
    drafter = lookup_drafter(target, [1.0] * 6)
    lookup_rounds = 0
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=32, eos_token_id=None)
        assert torch.equal(greedy(target, prompt, max_new_tokens=32, eos_token_id=None, assistant_model=drafter), expected)
        stats = drafter.last_generation_stats
        assert stats.lookup_accepted <= stats.lookup_drafted <= sum(stats.drafted)
        lookup_rounds += stats.lookup_rounds
    assert lookup_rounds > 0 and drafter.drafting_state.lookup_counts  # kept on the drafter for the next call
    drafter.generation_config.dspark_lookup_ngram_size = 0
    greedy(target, PROMPTS[0], max_new_tokens=32, eos_token_id=None, assistant_model=drafter)
    assert drafter.last_generation_stats.lookup_rounds == 0


def test_prompt_lookup_drafts_stop_where_plain_generate_stops():
    """A custom stopping criterion firing inside a lookup block: the round ends on it, as plain generate does."""
    from test_generate_options import StopAfterToken
    from transformers import StoppingCriteriaList

    target = make_tiny_target("llama")
    drafter = lookup_drafter(target, [1.0] * 6)
    lookup_rounds = 0
    for prompt in PROMPTS:
        plain = greedy(target, prompt, max_new_tokens=32, eos_token_id=None)
        for at in (5, 11, 20):
            criteria = StoppingCriteriaList([StopAfterToken(int(plain[0, len(prompt) + at]))])
            expected = greedy(target, prompt, max_new_tokens=32, eos_token_id=None, stopping_criteria=criteria)
            out = greedy(target, prompt, max_new_tokens=32, eos_token_id=None, stopping_criteria=criteria,
                         assistant_model=drafter)
            assert torch.equal(out, expected), (prompt, at)
            lookup_rounds += drafter.last_generation_stats.lookup_rounds
    assert lookup_rounds > 0


def test_sampling_with_prompt_lookup_matches_plain_sampling():
    """Lookup drafts carry a one-hot q: speculative sampling accepts x with probability p(x), so T = 1 stays exact."""
    target, drafter = sampling_setup("vanilla")
    drafter.generation_config.dspark_schedule = "hardware"
    drafter.generation_config.dspark_lookup_ngram_size = 2
    drafter.drafting_state.verify_profile = synthetic_profile([1.0, 1.0, 1.0], key=verify_profile_key(target))
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(-12.0)
    counts = sample_pairs(target, drafter, 1.0, seed=3)
    assert chi_square_p_value(counts, exact_pair_distribution(target, 1.0)) > ALPHA
    verified = sum(reached - DSparkPromptLookup.prior_weight for by_size in drafter.drafting_state.lookup_counts.values()
                   for _, reached in by_size.values())
    assert verified > 100  # lookup drafts were verified hundreds of times


def test_sampling_weighs_lookup_against_the_drafter_by_nothing_its_drafts_decide():
    """When sampling, whether the drafter's block is kept against lookup drafts may read a_1 = c_1 only: c_{n+1} reads
    x_n, so keeping the block by its later survivals would keep x_n by its own value (x_n no longer a draw from q;
    speculative sampling then drifts: χ² p = 2e-4 over 3,600 samples of a drafter built for it, 0.23 after). Greedy
    decoding, exact for any proposal, may read every survival."""
    from transformers import GenerationConfig

    target = make_tiny_target("llama")
    drafter = lookup_drafter(target, [1.0] * 6)  # every round costs the same: rates are expected tokens
    prompt = torch.tensor([[1, 2, 3, 1, 2]])  # its last 2-gram occurred before: lookup proposes [3, 1]
    chose_lookup = {}
    for do_sample in (False, True):
        config = GenerationConfig(do_sample=do_sample, max_length=20, num_beams=1, num_return_sequences=1)
        generator = generation_dspark.DSparkCandidateGenerator(drafter, target, prompt, config)
        generator.lookup.counts = {n: [0.2e6, 1e6] for n in generator.lookup.counts}  # ℓ = 0.2: 1 + 0.2 + 0.04
        for a_2 in (0.15, 0.0225):  # the drafter's block promises 1 + 0.15 + a_2
            generator.schedule.survivals, generator._last_drafted, generator._lookup_ngram = [[0.15], [a_2]], 2, 0
            generator._prefer_lookup(prompt, 2, True, torch.cat([prompt, torch.tensor([[4, 5]])], dim=1), None)
            chose_lookup[do_sample, a_2] = generator._lookup_ngram > 0
    assert chose_lookup[False, 0.15] is False and chose_lookup[False, 0.0225] is True  # greedy: a_2 decides
    # sampling: a_2 (it reads x_1) does not; the block is weighed as 1 + 0.15 + 0.15², so lookup wins both times
    assert chose_lookup[True, 0.15] is True and chose_lookup[True, 0.0225] is True


def test_lookup_knob_must_be_an_ngram_size():
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, [1.0] * 6)
    drafter.generation_config.dspark_lookup_ngram_size = "yes"
    with pytest.raises(ValueError, match="dspark_lookup_ngram_size='yes' is not an n-gram size"):
        greedy(target, PROMPTS[0], max_new_tokens=4, assistant_model=drafter)


# ----------------------------------------------------------------------------------------------------------------
# Stored profiles: per target/device/dtype/torch, bad files ignored with one warning and re-measured


@pytest.fixture
def profile_home(tmp_path, monkeypatch):
    """HF_HOME in a temporary folder, no profile in memory, and measuring replaced by a counted synthetic one."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    measured = []

    def fake_measure(target, max_drafts, *args, **kwargs):
        measured.append(max_drafts)
        return linear_profile(0.1, max_drafts, key=verify_profile_key(target))

    monkeypatch.setattr(measuring, "measure_verify_profile", fake_measure)
    return measured


@pytest.fixture
def warnings_seen(caplog):
    transformers.logging.enable_propagation()
    caplog.set_level(logging.WARNING)
    yield caplog
    transformers.logging.disable_propagation()


def test_first_call_measures_nothing_learns_from_its_rounds_and_the_next_process_goes_on(profile_home, monkeypatch):
    monkeypatch.setattr(live_profiling_dspark, "STORE_EVERY", 1)
    target = make_tiny_target("llama")
    drafter = scheduled_drafter(target, None)
    for prompt in PROMPTS[:2]:
        expected = greedy(target, prompt, max_new_tokens=24, eos_token_id=None)
        assert torch.equal(greedy(target, prompt, max_new_tokens=24, eos_token_id=None, assistant_model=drafter), expected)
    assert profile_home == []  # nothing measured on the call
    live = drafter.drafting_state.live_verify_profiles[False]
    assert sum(live.counts[1]) > 0
    assert live.prior is None and not live.noisy()
    path = Path(verify_profile_path({**verify_profile_key(target), "axis": "live"}))
    assert path.is_file()
    again = live_profiling_dspark.live_verify_profile(target, live.max_drafts)  # a new process starts where this one was
    assert again.counts == live.counts and again.ratios[1] == pytest.approx(live.ratios[1])


def test_a_stored_measured_profile_shapes_the_live_one_and_live_rounds_correct_it(profile_home):
    target = make_tiny_target("llama")
    key = verify_profile_key(target)
    store_json(linear_profile(1.0, 5, key=key).to_dict(), verify_profile_path(key))
    live = live_profiling_dspark.live_verify_profile(target, 5)
    assert not live.noisy() and live.verify_time(3, 16) == pytest.approx(4.0)
    for _ in range(10):  # one-draft rounds cost 3 steps here, not the profile's 2
        live.observe(1, 16, 6.0)
    assert live.verify_time(1, 16) == pytest.approx(6.0) and live.verify_time(5, 16) == pytest.approx(18.0)
    store_json(linear_profile(0.5, 5, key=key).to_dict(), verify_profile_path(key))  # re-measured: start over
    assert live_profiling_dspark.live_verify_profile(target, 5).counts == {}


def test_a_noisy_profile_is_refined_by_live_rounds_not_abandoned():
    schedule = row_schedule(live(linear_profile(1.0, noisy=True)), draft_time_s=0.0)
    assert drafted(schedule, [0.8] * 7) == 3  # nothing to rank k by yet: the threshold rule
    schedule.context_length = 16
    for k in range(8):
        observe(schedule, k, 0, verify_s=1.0, drafter_ran=False)  # every k as cheap as a plain step here
    assert not schedule.costs.noisy(1)
    assert drafted(schedule, [0.8] * 7) == 7


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "something else"}),
                                     json.dumps({"format": profiling_dspark.PROFILE_FORMAT, "key": {}}),
                                     json.dumps({"format": "dspark-verify-profile/1", "key": {}})])  # older: interpolated
def test_corrupt_profile_is_ignored_with_one_warning(profile_home, warnings_seen, content):
    target = make_tiny_target("llama")
    path = Path(verify_profile_path(verify_profile_key(target)))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    live = live_profiling_dspark.live_verify_profile(target, 5)
    assert profile_home == [] and live.prior is None and live.key == verify_profile_key(target)
    unreadable = [r for r in warnings_seen.records if "unreadable" in r.getMessage()]
    assert len(unreadable) == 1 and str(path) in unreadable[0].getMessage()
    live_path = Path(verify_profile_path({**verify_profile_key(target), "axis": "live"}))
    live_path.write_text(content)
    assert live_profiling_dspark.live_verify_profile(target, 5).counts == {}


def test_foreign_profile_is_ignored_with_one_warning(profile_home, warnings_seen):
    target = make_tiny_target("llama")
    key = verify_profile_key(target)
    path = Path(verify_profile_path(key))
    path.parent.mkdir(parents=True)
    foreign = linear_profile(0.0, 5, key={**key, "device_name": "another machine"})
    path.write_text(json.dumps(foreign.to_dict()))
    assert live_profiling_dspark.live_verify_profile(target, 5).prior is None and profile_home == []
    assert sum("belongs to another" in r.getMessage() for r in warnings_seen.records) == 1


def test_profile_identity_covers_dtype_and_target():
    target = make_tiny_target("llama")
    key = verify_profile_key(target)
    assert verify_profile_key(make_tiny_target("llama").to(torch.bfloat16))["dtype"] == "bfloat16" != key["dtype"]
    assert verify_profile_key(make_tiny_target("qwen3"))["config_sha256"] != key["config_sha256"]
    assert {"target", "revision", "device", "device_name", "torch"} <= set(key)
    drafter = scheduled_drafter(target, None)  # an injected profile of another dtype is not used
    drafter.drafting_state.verify_profile = linear_profile(0.0, 5, key={**key, "dtype": "bfloat16"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(live_profiling_dspark, "_read_stored_profile", lambda path, k: linear_profile(9.0, 5, key=key))
        settings = dataclasses.replace(DSparkDraftingSettings.from_drafter(drafter), num_drafts=5)
        schedule = make_schedule(settings, False, lambda: drafter.drafting_state.round_costs_for(target, settings.num_drafts))
    assert schedule.costs.key == key and schedule.costs.verify_time(1, 16) == 10.0


def test_profile_command_measures_stores_and_prints_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    target_dir = tmp_path / "tiny"
    make_tiny_target("llama").save_pretrained(target_dir)
    code = cli.main(["profile", "--target", str(target_dir), "--dtype", "float32", "--max-drafts", "3",
                     "--contexts", "8", "16", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "verify cost t(k)" in out and "stored in" in out
    stored = list((tmp_path / "hf" / "dspark" / "profiles").glob("*.json"))
    assert len(stored) == 1
    profile = DSparkVerifyProfile.from_dict(json.loads(stored[0].read_text()))
    assert profile.context_lengths == [8, 16] and profile.max_drafts == 3


@pytest.mark.slow
def test_an_unmeasured_half_precision_drafter_runs_in_fp32_where_torch_has_no_fast_half_gemm(tmp_path, monkeypatch,
                                                                                              smollm2):
    """With nothing measured, "auto" keeps a bf16 drafter bf16 where oneDNN runs bf16 matmuls and casts it to fp32
    where torch would run its own GEMM (an AVX2-only CPU: 3.4x slower over a block), lossless either way; an fp32
    drafter and a pinned dtype stay as they are."""
    from transformers import AutoModel

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored measurement
    target, tokenizer = smollm2
    fast_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    expected = target.generate(**inputs, max_new_tokens=8, do_sample=False)
    drafter = AutoModel.from_pretrained(EXAMPLE, trust_remote_code=True)
    assert profiling_dspark.unmeasured_drafter_dtype(drafter) == (None if fast_bf16 else "float32")
    assert torch.equal(target.generate(**inputs, max_new_tokens=8, do_sample=False, assistant_model=drafter), expected)
    assert next(drafter.parameters()).dtype == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert profiling_dspark.unmeasured_drafter_dtype(drafter.float()) is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # as on an AVX2-only CPU
    pinned = AutoModel.from_pretrained(EXAMPLE, trust_remote_code=True)
    assert profiling_dspark.unmeasured_drafter_dtype(pinned) == "float32"
    pinned.generation_config.dspark_drafter_dtype = "as-loaded"
    target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=pinned)
    assert next(pinned.parameters()).dtype == torch.bfloat16


@pytest.mark.slow
def test_profile_recommends_the_fastest_pair_and_drafters_then_run_in_that_dtype(tmp_path, monkeypatch, capsys):
    """`dspark-hf profile --drafter`: plain and DSpark tokens/s for each target × drafter dtype on the real target,
    the recommendation line, and the fastest drafter dtype stored, which a drafter left at "auto" then runs in."""
    from transformers import AutoModel

    from dspark_hf.targets import load_target

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code = cli.main(["profile", "--target", "smollm2", "--dtype", "float32", "--max-drafts", "3", "--contexts", "16",
                     "--repeats", "1", "--drafter", str(EXAMPLE), "--recommend-prompts", "1", "--recommend-tokens", "6"])
    out = capsys.readouterr().out
    assert code == 0 and out.count(" | plain    | ") == 2 and "recommended: target " in out
    target, _ = load_target("smollm2", dtype="float32")
    fastest = profiling_dspark.stored_drafter_dtype(target)
    assert fastest in ("float32", "bfloat16")
    drafter = AutoModel.from_pretrained(EXAMPLE, trust_remote_code=True, dtype=torch.float16)
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
    expected = target.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=drafter), expected)
    assert next(drafter.parameters()).dtype == getattr(torch, fastest)
    drafter.to(torch.float16).generation_config.dspark_drafter_dtype = "as-loaded"
    target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    assert next(drafter.parameters()).dtype == torch.float16
