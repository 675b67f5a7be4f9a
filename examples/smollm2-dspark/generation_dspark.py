# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""DSpark inside `target.generate(**inputs, assistant_model=drafter)`: stats and the candidate generator.

Remote-code file (imports only torch and transformers). transformers' assisted-decoding loop verifies candidates
and commits tokens; this file supplies the candidates. Reading order: generation stats → the candidate generator
(one verify round at a time: extend the drafter's context, draft a block, let the schedule and the stops decide how
much of it to propose, learn from the outcome). `routing_dspark.py` hands it to generate().
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.utils import ModelOutput

from .scheduling_dspark import make_prompt_lookup, make_schedule
from .settings_dspark import DSparkDraftingSettings, prepare_drafter
from .token_choice_dspark import one_hot_scores

# ------------------------------------------------------------------------------------------------------------------
# Generation stats

# The fields of DSparkGenerationStats with one entry per round, and the counters that add up over generate calls.
PER_ROUND_STATS = ("drafted", "accepted", "widths", "round_rows", "verified_tokens", "round_prices")
SUMMED_STATS = ("draft_time_s", "verify_time_s", "confidence_predicted", "confidence_observed", "confidence_verified",
                "lookup_rounds", "lookup_drafted", "lookup_accepted", "prefill_tokens", "prefill_padded_tokens")


@dataclass
class DSparkGenerationStats:
    """What happened in the last `generate` call: one entry per verify round (batched: per row and round)."""

    num_draft_tokens: int
    drafted: list[int] = field(default_factory=list)  # drafts proposed per round
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round (bonus token not included)
    widths: list[int] = field(default_factory=list)  # batched generation: the widest row's drafts in each batch round
    round_rows: list[int] = field(default_factory=list)  # batched: the rows each batch round verified
    verified_tokens: list[int] = field(default_factory=list)  # batched: tokens through the target's layers per round
    # hardware schedule: per round (drafted, seconds the schedule priced it at, seconds it took), priced before it ran
    round_prices: list[tuple[bool, float, float]] = field(default_factory=list)
    packed: bool | None = None  # batched: whether rounds were verified packed (each row's own tokens) or padded
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    confidence_predicted: float = 0.0  # Σ recalibrated c_n over drafts verification reached (hardware schedule)
    confidence_observed: int = 0  # ... and how many of them were accepted
    confidence_verified: int = 0  # ... of how many drafts
    lookup_rounds: int = 0  # rounds (batched: row rounds) whose drafts came from prompt lookup (in drafted/accepted)
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    prefill_tokens: int = 0  # batched: prompt tokens through the target's layers (packed: each row's own)
    prefill_padded_tokens: int = 0  # ... and rows × longest prompt, what a padded prefill runs

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify round, bonus included (τ measured live)."""
        return 1.0 + sum(self.accepted) / max(self.rounds, 1)

    def record_round(self, schedule, counts: torch.Tensor, accepted: torch.Tensor, drafter_ran: bool,
                     draft_s: float | None, verify_s: float, own: torch.Tensor | None = None) -> tuple[float, int, int] | None:
        """One verify round, the drafts each row verified and accepted (rows,): its price as the schedule set it before
        the round (`round_prices`), then what the schedule learned from it (returned: Σ the predicted survival of the
        drafter's drafts verification reached (`own`: the rows they were the drafter's, not prompt lookup's; None:
        every row), how many were accepted, how many; None where it learns nothing)."""
        self.drafted += counts.tolist()
        self.accepted += accepted.tolist()
        price = schedule.price_of(counts, drafter_ran)
        if price is not None:
            self.round_prices.append((bool(counts.any()), price, (draft_s or 0.0) + verify_s))
        outcome = schedule.observe_round(counts, accepted, drafter_ran, draft_s, verify_s, own=own)
        if outcome is not None:
            self.confidence_predicted += outcome[0]
            self.confidence_observed += outcome[1]
            self.confidence_verified += outcome[2]
        return outcome

    def record_lookup(self, lookup, ngrams: torch.Tensor, counts: torch.Tensor, accepted: torch.Tensor) -> None:
        """The rows whose drafts came from prompt lookup this round (`ngrams` (rows,) > 0, the n-gram size matched):
        what lookup learns from them, and the lookup counts."""
        for ngram, drafted, taken in zip(ngrams.tolist(), counts.tolist(), accepted.tolist()):
            if ngram:
                lookup.observe(ngram, drafted, taken)
                self.lookup_rounds += 1
                self.lookup_drafted += drafted
                self.lookup_accepted += min(taken, drafted)

    def acceptance_cumulative(self) -> list[float]:
        """P(drafts 1..k all accepted) over rounds that proposed at least k drafts."""
        return [
            sum(a >= k for a, d in zip(self.accepted, self.drafted) if d >= k) / max(sum(d >= k for d in self.drafted), 1)
            for k in range(1, self.num_draft_tokens + 1)
        ]

    def acceptance_conditional(self) -> list[float]:
        """P(draft k accepted | drafts 1..k-1 accepted), over rounds that proposed draft k."""
        rates = []
        for k in range(1, self.num_draft_tokens + 1):
            reached = [a for a, d in zip(self.accepted, self.drafted) if d >= k and a >= k - 1]
            rates.append(sum(a >= k for a in reached) / max(len(reached), 1))
        return rates

    def accepted_histogram(self) -> list[int]:
        """Rounds by number of accepted drafts 0..N."""
        return [sum(a == k for a in self.accepted) for k in range(self.num_draft_tokens + 1)]

    def padded_tokens(self) -> list[int]:
        """Batched: the tokens each round would have verified padded to its widest row, rows × (w + 1)."""
        return [rows * (width + 1) for rows, width in zip(self.round_rows, self.widths)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "drafted_tokens": sum(self.drafted),
            "accepted_tokens": sum(self.accepted),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_cumulative": self.acceptance_cumulative(),
            "acceptance_conditional": self.acceptance_conditional(),
            "accepted_histogram": self.accepted_histogram(),
            "widths": list(self.widths),
            "verified_tokens": list(self.verified_tokens),
            "round_prices": list(self.round_prices),
            "padded_tokens": self.padded_tokens(),
            "packed": self.packed,
            **{name: getattr(self, name) for name in SUMMED_STATS},
        }


# ------------------------------------------------------------------------------------------------------------------
# The candidate generator: one verify round at a time


def _stops_inside_a_round(stopping_criteria: StoppingCriteriaList | None) -> StoppingCriteriaList | None:
    """The criteria a round must check draft by draft: transformers itself cuts rounds at max length and EOS."""
    kept = [c for c in stopping_criteria or () if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    return StoppingCriteriaList(kept) if kept else None


def check_generation_limits(generation_config: GenerationConfig, batch_size: int | None = None):
    """The limits of assisted generation, each as one clear error (transformers would silently beam-search)."""
    beams, returns = generation_config.num_beams, generation_config.num_return_sequences
    if beams > 1:
        raise ValueError(f"DSpark speculative decoding does not support beam search (num_beams={beams}); use num_beams=1.")
    if returns > 1:
        raise ValueError(f"DSpark speculative decoding returns one sequence (num_return_sequences={returns}); call "
                         "generate repeatedly instead.")
    if batch_size is not None and batch_size != 1:
        raise ValueError(f"DSpark speculative decoding supports batch size 1, got {batch_size}; call generate once per prompt.")


def decoding_key(target: PreTrainedModel, generation_config: GenerationConfig) -> tuple:
    """What a draft's survival depends on besides the text: the target's dtype and the decoding settings."""
    if not generation_config.do_sample:
        return (str(target.dtype), "greedy")
    return (str(target.dtype), "sample", generation_config.temperature, generation_config.top_k, generation_config.top_p)


class DSparkCandidateGenerator(CandidateGenerator):
    """Feeds the drafter the aux hidden states of committed positions from each verify pass and drafts one block.

    Round 0 returns the prompt unchanged so the target's prefill yields the prompt's hidden states. Afterwards the
    positions committed since the last round (the whole prompt on round 1; the previous anchor plus the accepted
    drafts later) are appended to the drafter's context cache, and the newest target token is the anchor.
    """

    requires_model_outputs = True

    def __init__(self, drafter, target: PreTrainedModel, input_ids: torch.LongTensor, generation_config: GenerationConfig,
                 logits_processor: LogitsProcessorList | None = None, model_kwargs: dict[str, Any] | None = None,
                 stopping_criteria: StoppingCriteriaList | None = None):
        check_generation_limits(generation_config, batch_size=input_ids.shape[0])
        self.drafter, self.state = drafter, drafter.drafting_state
        self.settings = DSparkDraftingSettings.from_drafter(drafter)
        prepare_drafter(drafter, target, self.settings)
        self.aux_layer_ids = list(drafter.config.aux_hidden_state_layer_ids)
        # Ask the verify pass for exactly the aux layers; a user asking for all hidden states gets them all.
        wants_all = generation_config.output_hidden_states and generation_config.return_dict_in_generate
        self.model_kwargs_overrides = {"output_hidden_states": True if wants_all else self.aux_layer_ids}
        self.do_sample = bool(generation_config.do_sample)
        self.num_drafts = self.settings.num_drafts
        self.schedule = make_schedule(self.settings, self.do_sample,
                                      lambda: self.state.round_costs_for(target, self.settings.num_drafts, self.do_sample))
        self.bias_key = decoding_key(target, generation_config)
        self.schedule.bias = self.state.confidence_bias.get(self.bias_key, 0.0)  # learned by earlier calls
        # After rounds that draft nothing the drafter itself may rest (the schedule's back-off); the aux rows of the
        # rounds it skipped wait in `_pending_aux` until it runs again.
        self._pending_aux: list[torch.Tensor] = []
        self.lookup = make_prompt_lookup(self.settings, self.schedule, self.do_sample, self.state.lookup_counts,
                                         self.bias_key)
        self._lookup_ngram = 0  # n-gram size matched when this round's drafts came from prompt lookup, else 0
        self.logits_processor = logits_processor if logits_processor else None
        self.stopping_criteria = _stops_inside_a_round(stopping_criteria)
        self.generation_config = generation_config  # the one `_assisted_decoding` reads each round
        self.max_length = generation_config.max_length
        self.cache = drafter.new_context_cache()
        self.stats = self.state.last_stats = DSparkGenerationStats(num_draft_tokens=drafter.num_draft_tokens)
        self._last_drafted = 0
        self._drafter_ran, self._draft_s = False, None  # this round: whether the drafter ran, its time (None: no measure)
        self._verify_started = None
        self._prefilled = False

    def _end_round_at(self, max_length: int):
        """transformers commits the accepted drafts plus a bonus token, cropped to `generation_config.max_length`,
        which it reads each round: a stop inside the block lowers it for this round, and every round restores it."""
        self.generation_config.max_length = max_length

    def _commit_context(self, input_ids: torch.LongTensor, model_outputs: ModelOutput | None) -> bool:
        """Append every position before the anchor that the drafter has not seen yet (aux states of the last verify).

        Returns False, keeping the rows for later, when the back-off rests the drafter this round (a plain step)."""
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DSpark drafting needs the target's hidden states from the verify pass; none were returned.")
        waiting = sum(rows.shape[1] for rows in self._pending_aux)
        num_new = input_ids.shape[1] - 1 - self.cache.get_seq_length() - waiting
        aux = torch.cat([model_outputs.hidden_states[i][:, :num_new] for i in self.aux_layer_ids], dim=-1)
        if self.schedule.should_skip():
            self._pending_aux.append(aux)
            return False
        if self._pending_aux:  # extend lazily, in one call, with the rounds the drafter skipped
            aux, self._pending_aux = torch.cat(self._pending_aux + [aux], dim=1), []
        self.drafter.extend_context(self.cache, aux.to(self.drafter.fc.weight.device))
        return True

    def _cut_at_stop(self, input_ids: torch.LongTensor, tokens: torch.LongTensor) -> torch.LongTensor:
        """Drafts up to the first on which a stopping criterion fires, and a round that ends on it if it is accepted.

        Whether draft n is proposed depends only on the tokens before it (lossless, as for EOS)."""
        if self.stopping_criteria is None:
            return tokens
        for n in range(tokens.shape[1]):
            if bool(self.stopping_criteria(torch.cat([input_ids, tokens[:, : n + 1]], dim=-1), None).any()):
                self._end_round_at(input_ids.shape[1] + n + 1)
                return tokens[:, : n + 1]
        return tokens

    def _draft(self, input_ids: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Candidates (the sequence plus up to `budget` drafts) and, when sampling, the q they were drawn from."""
        device = self.drafter.fc.weight.device
        draft = self.drafter.draft_block(self.cache, input_ids[0, -1].to(device), num_drafts=budget, do_sample=self.do_sample,
                                         logits_processor=self.logits_processor, input_ids=input_ids.to(device),
                                         schedule=self.schedule)
        tokens = self._cut_at_stop(input_ids, draft.token_ids.to(input_ids.device))
        self._last_drafted = tokens.shape[1]
        candidates = torch.cat([input_ids, tokens], dim=-1)
        return candidates, draft.target_logits[:, : tokens.shape[1]] if self.do_sample and self._last_drafted else None

    def _prefer_lookup(self, input_ids, budget: int, drafter_ran: bool, candidates, candidate_logits):
        """Prompt-lookup drafts instead of the drafter's where they promise more tokens per second
        (`DSparkPromptLookup.choose`, as for each row of a batch); when sampling their q is one-hot."""
        own = self.lookup.drafter_survivals(self.schedule, 0, self._last_drafted, budget) if drafter_ran else []
        tokens, ngram = self.lookup.choose(self.schedule, input_ids[0], budget, own, drafter_ran)
        if not ngram:
            return candidates, candidate_logits
        self._end_round_at(self.max_length)  # undo a stop cut of the drafter's block
        tokens = self._cut_at_stop(input_ids, tokens[None].to(input_ids.device))
        self._last_drafted, self._lookup_ngram = tokens.shape[1], ngram
        q = one_hot_scores(tokens, self.drafter.config.vocab_size) if self.do_sample and self._last_drafted else None
        return torch.cat([input_ids, tokens], dim=-1), q

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any] | None = None,
                       model_outputs: ModelOutput | None = None, is_first_iteration: bool = False, n_last_matches: int = 0,
                       **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        start = time.perf_counter()
        self._last_drafted = 0
        if is_first_iteration:
            self._verify_started = time.perf_counter()
            return input_ids, None
        first_round = self.cache.get_seq_length() == 0
        candidates, candidate_logits = input_ids, None
        self._lookup_ngram = 0
        self.schedule.context_length = input_ids.shape[1]
        drafter_runs = self._commit_context(input_ids, model_outputs)
        budget = min(self.num_drafts, self.max_length - input_ids.shape[1] - 1)
        self._drafter_ran = drafter_runs and budget > 0
        if self._drafter_ran:
            candidates, candidate_logits = self._draft(input_ids, budget)
        # the first round's prompt-sized context extension is no measure of a round's drafting time
        self._draft_s = None if first_round else time.perf_counter() - start
        if self.lookup is not None and budget > 0 and self.lookup.may_pay(self.schedule, budget, 1, drafter_runs):
            candidates, candidate_logits = self._prefer_lookup(input_ids, budget, drafter_runs, candidates, candidate_logits)
        self.stats.draft_time_s += time.perf_counter() - start
        self._verify_started = time.perf_counter()
        return candidates, candidate_logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self._end_round_at(self.max_length)  # undo a stop's round cut (see `_cut_at_stop`)
        elapsed = time.perf_counter() - self._verify_started if self._verify_started is not None else 0.0
        self.stats.verify_time_s += elapsed
        if self._prefilled:  # every verify round after the prefill, including rounds with no room left to draft
            counts, accepted = torch.tensor([self._last_drafted]), torch.tensor([int(num_matches)])
            ngrams = torch.tensor([self._lookup_ngram])
            outcome = self.stats.record_round(self.schedule, counts, accepted, self._drafter_ran, self._draft_s, elapsed,
                                              own=ngrams == 0)
            if self.lookup is not None:
                self.stats.record_lookup(self.lookup, ngrams, counts, accepted)
            if outcome is not None:  # keep the schedule's bias on the drafter for the next call
                self.state.confidence_bias[self.bias_key] = self.schedule.bias
        self._prefilled = True


__all__ = ["DSparkCandidateGenerator", "DSparkGenerationStats", "check_generation_limits", "decoding_key"]
