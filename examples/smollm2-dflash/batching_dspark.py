# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""Batched speculative generation: `target.generate(**padded_batch, assistant_model=drafter)` with many rows.

Remote-code file (imports only torch and transformers). transformers' assisted loop serves one row; for a batch the
routing hook (`routing_dspark.py`) calls this loop instead. Every round the drafter drafts a block for every active
row in one pass (the same drafting loop, token chooser and schedule as one row), the schedule picks how many drafts
each row verifies (`scheduling_dspark.py`, priced by the batch round costs), and the target verifies all rows in one
forward: packed over each row's own anchor and drafts (`packing_dspark.py`), or padded to the widest row where
packing cannot serve the target. Rows accept different numbers of drafts, so the caches become ragged: a rejected
draft's column stays in the target's cache but is masked out of attention from then on (a mask with holes), each
row's position ids count only its valid columns, columns no row needs are cropped, and the caches are compacted when
holes pile up (`batch_rows_dspark.py` keeps that layout, the rows' ids and their scores). A finished row leaves the
batch. Each row therefore sees exactly its own tokens, as in plain batched `generate`: greedy rows are the target's
own argmax, sampled rows pass speculative sampling row by row. The prompts go through the target packed too
(`_packed_prefill`).

Reading order: what a batch cannot do → one batched call: prefill, draft, verify, accept, commit, stop → the output
in `generate`'s layout.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch_rows_dspark import DSparkBatchIds, DSparkBatchRows, DSparkBatchScores
from .generation_dspark import DSparkGenerationStats, check_generation_limits, decoding_key
from .packing_dspark import DSparkPackedCache, DSparkPacking, attention_windows, install_packed_attention, packs
from .scheduling_dspark import make_prompt_lookup, make_schedule
from .settings_dspark import DSparkDraftingSettings, prepare_drafter
from .token_choice_dspark import VOCAB_AGNOSTIC_WARPERS, DSparkTokenChooser, one_hot_scores

def check_batch_limits(target: PreTrainedModel, generation_config: GenerationConfig, attention_mask, streamer):
    """What a batch cannot do with a DSpark drafter, each as one line naming the fix."""
    check_generation_limits(generation_config)
    wants = [name for name in ("output_attentions", "output_hidden_states") if getattr(generation_config, name, False)]
    if generation_config.return_dict_in_generate and wants:
        raise ValueError(f"DSpark batched speculation returns sequences, scores and logits, not {', '.join(wants)}; "
                         "drop them or generate one prompt at a time.")
    if streamer is not None:
        raise ValueError("DSpark batched speculation cannot stream; drop the streamer or generate one prompt at a time.")
    if target.config.is_encoder_decoder:
        raise ValueError("DSpark batched speculation serves decoder-only targets; generate one prompt at a time.")
    if attention_mask is not None and bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("DSpark batched speculation needs left padding (a row has padding after its tokens); "
                         "tokenize with padding_side=\"left\".")


class DSparkBatchGeneration:
    """One batched `generate` call with a DSpark drafter (see the module docstring)."""

    def __init__(self, drafter, target: PreTrainedModel, generation_config: GenerationConfig,
                 logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList, model_kwargs: dict):
        self.drafter, self.target, self.config = drafter, target, generation_config
        self.processors = logits_processor or LogitsProcessorList()
        self.batched_processors = all(isinstance(p, VOCAB_AGNOSTIC_WARPERS) for p in self.processors)
        self.stopping_criteria = stopping_criteria
        # transformers pads a stopped row only where an EOS criterion exists; without one it goes on writing the row
        # until every row has stopped, and so does this loop then
        self.pads_finished = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
        self.model_kwargs = model_kwargs
        self.do_sample = bool(generation_config.do_sample)
        self.windows = attention_windows(target)  # attention layer type -> sliding window (None: full)
        self.windowed = any(self.windows.values())
        self.aux_layer_ids = list(drafter.config.aux_hidden_state_layer_ids)
        self.settings = DSparkDraftingSettings.from_drafter(drafter)
        self.bias_key = decoding_key(target, generation_config)
        state, num_drafts = drafter.drafting_state, self.settings.num_drafts
        self.schedule = make_schedule(self.settings, self.do_sample,
                                      lambda: state.round_costs_for(target, num_drafts, self.do_sample))
        self.schedule.bias = state.confidence_bias.get(self.bias_key, 0.0)
        self.lookup = make_prompt_lookup(self.settings, self.schedule, self.do_sample, state.lookup_counts, self.bias_key)
        self.chooser = DSparkTokenChooser(drafter.draft_to_target_ids, drafter.config.vocab_size, self.do_sample,
                                          logits_processor)
        self.stats = drafter.drafting_state.last_stats = DSparkGenerationStats(num_draft_tokens=drafter.num_draft_tokens)
        self.drafter_ran = True  # whether the drafter ran this round (`_draft` says)
        returns = generation_config.return_dict_in_generate
        self.scores = self.logits = None  # DSparkBatchScores, made in `generate`, when the call asks for them
        self.wants_scores = bool(returns and generation_config.output_scores)
        self.wants_logits = bool(returns and generation_config.output_logits)

    # -------------------------------------------------------------------------------------------------- the call

    def generate(self, input_ids: torch.LongTensor):
        """Generate every row to its end; the output has plain `generate`'s layout."""
        self.ids = DSparkBatchIds(input_ids)
        self.scores = DSparkBatchScores(input_ids.shape[0]) if self.wants_scores else None
        self.logits = DSparkBatchScores(input_ids.shape[0]) if self.wants_logits else None
        self.stopped_at: list[int | None] = [None] * input_ids.shape[0]  # tokens a row had when it stopped
        mask = self.model_kwargs.get("attention_mask")
        self.prompt_starts = [0] * input_ids.shape[0] if mask is None else (mask.shape[1] - mask.sum(dim=1)).tolist()
        batch = self._prefill(input_ids)
        while batch.rows.numel():
            self._round(batch)
        if self.schedule.prices_rounds:
            self.drafter.drafting_state.confidence_bias[self.bias_key] = self.schedule.bias
        return self._output()

    def _prefill(self, input_ids: torch.LongTensor) -> DSparkBatchRows:
        """The prompts through the target and the first token of every row: packed, each row's own tokens only,
        where the prompts differ in length and packing serves the target (`_packed_prefill`); else plain generate's
        own left-padded prefill."""
        mask = self.model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask.long()
        cache = self.model_kwargs.get("cache")
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("DSpark batched speculation starts from an empty cache; drop the `cache` you passed.")
        cache = self._new_cache()
        can_pack = packs(self.target, cache)
        self.packed = self.settings.packed_verification and can_pack
        self.schedule.packed = self.stats.packed = self.packed
        self.stats.prefill_padded_tokens = self.stats.prefill_tokens = input_ids.numel()
        if can_pack and not bool(mask.all()):
            outputs, mask, positions = self._packed_prefill(input_ids, mask, cache)
            self.stats.prefill_tokens = int(mask.sum())
        else:
            positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
            outputs = self.target(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                                  use_cache=True, output_hidden_states=self.aux_layer_ids, logits_to_keep=1)
        raw = outputs.logits[:, -1].float()
        scores = self.processors(input_ids, raw.clone() if self.wants_logits else raw)
        first = torch.multinomial(F.softmax(scores, dim=-1), 1).squeeze(1) if self.do_sample else scores.argmax(-1)
        self._keep_scores(torch.arange(input_ids.shape[0]), scores[:, None], raw[:, None], torch.zeros_like(first))
        prepare_drafter(self.drafter, self.target, self.settings)
        batch = DSparkBatchRows(torch.arange(input_ids.shape[0], device=input_ids.device), mask, outputs.cache,
                                self.drafter.new_context_cache())
        self._extend_context(batch, outputs.hidden_states, positions)
        batch.anchor = first
        self._commit(batch, [[t] for t in first.tolist()])
        return batch

    def _packed_prefill(self, input_ids: torch.LongTensor, mask: torch.LongTensor, cache: DSparkPackedCache):
        """The prefill over only the prompts' own tokens, end to end (1, Σ_r L_r), as packed rounds verify: plain
        generate runs every row as long as the longest and masks the padding, which on a CPU costs rows × longest.
        The caches get each row's tokens first and holes after them (masked, like a rejected draft's column), and
        the target's LM head runs at each row's last token only. Returns (outputs in the padded layout, the caches'
        column mask (a, W), the columns' positions (a, W))."""
        lengths = mask.sum(dim=1)
        packing = DSparkPacking(lengths - 1, rows_alone=not self.windowed)  # slot s < L_r: row r's prompt token s
        order = mask.argsort(dim=1, descending=True, stable=True)[:, : packing.width]  # each row's tokens first
        ids, positions = input_ids.gather(1, order), torch.arange(packing.width, device=mask.device).expand_as(order)
        last = lengths.cumsum(0) - 1  # each row's last token among the packed ones
        empty = mask[:, :0]
        outputs = self._packed_call(packing, input_ids=packing.pack(ids), position_ids=packing.pack(positions),
                                    attention_mask=self._round_mask(empty, packing, positions, packed=True),
                                    cache=cache, logits_to_keep=last)
        outputs.logits = outputs.logits[0][:, None]  # (a, 1, V)
        return outputs, packing.valid.long(), positions

    def _new_cache(self) -> DSparkPackedCache:
        """The target's cache for this call: generate's own layers where every layer attends fully; with sliding
        windows, layers that keep every column (holes scatter a row's last positions, so the round's masks cut each
        window instead: `_round_mask`). Other layers (recurrent, chunked) and attention kernels that take no 4-D mask
        are refused."""
        kinds = set(self.windows) - {"full_attention", "sliding_attention"}
        kernel = self.target.config._attn_implementation
        if kinds or (self.windowed and kernel not in ("sdpa", "eager")):
            raise ValueError(f"DSpark batched speculation serves full and sliding-window attention layers through sdpa or "
                             f"eager attention (this target: {', '.join(sorted(self.windows))}, {kernel}); generate one "
                             "prompt at a time.")
        cache = DSparkPackedCache() if self.windowed else DSparkPackedCache(config=self.target.config)
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise ValueError("DSpark batched speculation needs a target whose cache keeps attention keys and values only "
                             "(no recurrent layers); generate one prompt at a time.")
        return cache

    def _extend_context(self, batch: DSparkBatchRows, hidden_states, positions: torch.LongTensor):
        """The drafter's context gets the same new columns as the target's cache (holes included, masked later), when
        it next runs (`_catch_up`): a round the drafter rests then costs no more than a plain step."""
        aux = torch.cat([hidden_states[i] for i in self.aux_layer_ids], dim=-1)
        batch.pending_context.append((aux, positions))

    def _catch_up(self, batch: DSparkBatchRows):
        """The columns the drafter's context is behind by, through it in one call."""
        if not batch.pending_context:
            return
        aux, positions = (torch.cat(parts, dim=1) for parts in zip(*batch.pending_context))
        batch.pending_context = []
        device = self.drafter.fc.weight.device
        self.drafter.extend_context(batch.drafter_cache, aux.to(device), positions.to(device))

    # -------------------------------------------------------------------------------------------------- a round

    def _round(self, batch: DSparkBatchRows):
        """Draft, verify, accept and commit once for every active row."""
        started = time.perf_counter()
        room = self._room(batch)  # (a,) drafts each row may still propose
        drafts = self._draft(batch, int(room.max()))
        drafted_s = time.perf_counter() - started
        lengths = self.schedule.row_lengths(drafts.token_ids.shape[1], batch.rows.numel())
        counts = torch.minimum(room, lengths.to(room.device))  # (a,) drafts each row verifies
        looking = time.perf_counter()
        drafts, counts, ngrams = self._with_lookup(batch, drafts, counts, room)
        lookup_s = time.perf_counter() - looking  # the drafts' time, but not the drafter's: priced by neither
        logits, raw, outputs = self._verify(batch, drafts.token_ids, counts)
        accepted, bonus = self._accept(batch, drafts, counts, logits)
        self._keep_scores(batch.rows, logits, raw, accepted)
        verified_s = time.perf_counter() - started - drafted_s - lookup_s
        self.stats.record_round(self.schedule, counts, accepted, self.drafter_ran, drafted_s, verified_s, own=ngrams == 0)
        if self.lookup is not None:
            self.stats.record_lookup(self.lookup, ngrams, counts, accepted)
        self._record(counts, drafted_s + lookup_s, verified_s)
        self._advance(batch, drafts.token_ids, counts, accepted, bonus, outputs)

    def _room(self, batch: DSparkBatchRows) -> torch.LongTensor:
        """Per row, how many drafts fit before max_length (the bonus token takes one place)."""
        room = self.config.max_length - self.ids.lengths_of(batch.rows) - 1
        return room.clamp(min=0, max=self.settings.num_drafts)

    def _draft(self, batch: DSparkBatchRows, room: int):
        """One block per row; the width schedule decides how many drafts the batch verifies (0: a plain step)."""
        self.schedule.batch_size = batch.rows.numel()
        self.schedule.context_length = batch.mask.shape[1]
        if room == 0 or self.schedule.should_skip():
            self.schedule.start()  # a round without drafts: nothing of an earlier round's is learned from again
            self.drafter_ran = False
            return SimpleNamespace(token_ids=batch.anchor.new_zeros((batch.anchor.shape[0], 0)), target_logits=None)
        self.drafter_ran = True
        self._catch_up(batch)
        device = self.drafter.fc.weight.device
        return self.drafter.draft(batch.drafter_cache, batch.anchor.to(device), room, self.chooser, self.schedule,
                                  batch.next_position.to(device), batch.mask.bool().to(device))

    def _with_lookup(self, batch: DSparkBatchRows, drafts, counts: torch.LongTensor, room: torch.LongTensor):
        """Each row's prompt-lookup drafts in place of its drafter's where they promise more tokens per second
        (`DSparkPromptLookup.choose`, as for one row), with a one-hot q when sampling. Returns the round's drafts up to
        its widest row (the cache takes width + 1 new columns), the drafts each row verifies, and each row's n-gram
        size matched (a,) (0: the drafter's drafts, or none)."""
        ngrams, chosen = torch.zeros_like(counts), {}
        looks = self.lookup is not None and self.lookup.may_pay(self.schedule, int(room.max()), len(counts), self.drafter_ran)
        for i, row in enumerate(batch.rows.tolist() if looks else ()):
            budget, sequence = int(room[i]), self.ids.sequence(row)[self.prompt_starts[row] :]
            own = self.lookup.drafter_survivals(self.schedule, i, int(counts[i]), budget) if self.drafter_ran else []
            others = [0] * len(counts) if self.do_sample else counts.tolist()  # sampling: no row's drafts decide
            tokens, ngram = self.lookup.choose(self.schedule, sequence, budget, own, self.drafter_ran, others, i)
            if ngram:
                chosen[i], ngrams[i], counts[i] = tokens.to(counts.device), ngram, tokens.shape[0]
        width = int(counts.max()) if counts.numel() else 0
        token_ids, q = drafts.token_ids[:, :width], None if drafts.target_logits is None else drafts.target_logits[:, :width]
        if not chosen:  # the drafter's drafts up to the widest row: views, no copy
            return SimpleNamespace(token_ids=token_ids, target_logits=q), counts, ngrams
        token_ids = F.pad(token_ids, (0, width - token_ids.shape[1]))  # a copy, widened where lookup drafts more
        if self.do_sample:  # a q for slots past a row's drafts is never read: any finite one serves
            q = F.pad(q.float(), (0, 0, 0, width - q.shape[1])) if q is not None else token_ids.new_zeros(
                (*token_ids.shape, self.drafter.config.vocab_size), dtype=torch.float)
        for i, tokens in chosen.items():
            token_ids[i, : tokens.shape[0]] = tokens
            if q is not None:  # its slots past the lookup drafts keep the drafter's q, never read
                q[i, : tokens.shape[0]] = one_hot_scores(tokens.to(q.device), q.shape[-1])
        return SimpleNamespace(token_ids=token_ids, target_logits=q), counts, ngrams

    def _verify(self, batch: DSparkBatchRows, tokens: torch.LongTensor, counts: torch.LongTensor):
        """One target forward of [anchor, drafts] per row: packed, over each row's anchor and `counts` drafts only
        (`packing_dspark`), or padded, w + 1 wide with a row's slots past its drafts masked. Either way the logits
        (a, w + 1, V) and the aux hidden states come back in the padded layout, and the cache gains w + 1 columns."""
        tokens = tokens.to(batch.anchor.device)
        ids = torch.cat([batch.anchor[:, None], tokens], dim=1)  # (a, w + 1)
        packing, positions = DSparkPacking(counts), batch.next_position[:, None] + torch.arange(ids.shape[1], device=ids.device)
        outputs = (self._packed_forward if self.packed else self._padded_forward)(batch, ids, packing, positions)
        raw = outputs.logits.float()
        processed = self._processed(batch, ids, packing.valid, raw.clone() if self.wants_logits else raw)
        return processed, raw, outputs

    def _round_mask(self, cache_mask: torch.Tensor, packing: DSparkPacking, positions: torch.LongTensor, packed: bool):
        """Full attention: the rows' columns (`cache_mask` (a, T)) as a 2-D mask (padded; transformers adds the rest)
        or the 4-D one (packed). Sliding windows: a 4-D mask per layer type (a dict where types differ), from each
        row's own positions."""
        if not self.windowed:
            return packing.attention_mask(cache_mask) if packed else torch.cat([cache_mask, packing.valid.long()], 1)
        key_positions = torch.cat([cache_mask.cumsum(-1) - 1, positions], dim=1)
        masks = packing.windowed_masks(cache_mask, key_positions, self.windows)
        if self.target.config._attn_implementation == "eager":  # eager adds its mask to the scores
            lowest = torch.finfo(self.target.dtype).min
            masks = {kind: torch.zeros(m.shape, dtype=self.target.dtype).masked_fill_(~m, lowest) for kind, m in masks.items()}
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def _padded_forward(self, batch: DSparkBatchRows, ids: torch.LongTensor, packing: DSparkPacking, positions):
        return self.target(input_ids=ids, attention_mask=self._round_mask(batch.mask, packing, positions, packed=False),
                           position_ids=positions, cache=batch.target_cache, use_cache=True,
                           output_hidden_states=self.aux_layer_ids, dspark_batch_round=ids.shape[1] > 1)

    def _packed_forward(self, batch: DSparkBatchRows, ids: torch.LongTensor, packing: DSparkPacking, positions):
        """The forward over the packed tokens (1, N); its logits unpacked to (a, w + 1, V)."""
        outputs = self._packed_call(packing, input_ids=packing.pack(ids), position_ids=packing.pack(positions),
                                    attention_mask=self._round_mask(batch.mask, packing, positions, packed=True),
                                    cache=batch.target_cache)
        outputs.logits = packing.unpack(outputs.logits)
        return outputs

    def _packed_call(self, packing: DSparkPacking, cache: DSparkPackedCache, **inputs):
        """One target forward over packed tokens: the cache and the attention function see the rows apart; the aux
        hidden states come back unpacked to (a, W, d)."""
        cache.packing = packing
        try:
            outputs = self.target(**inputs, cache=cache, use_cache=True, output_hidden_states=self.aux_layer_ids,
                                  dspark_packing=packing, dspark_batch_round=True)
        finally:
            cache.packing = None
        outputs.hidden_states = tuple(None if h is None else packing.unpack(h) for h in outputs.hidden_states)
        return outputs

    def _processed(self, batch: DSparkBatchRows, ids: torch.LongTensor, valid: torch.Tensor,
                   logits: torch.Tensor) -> torch.Tensor:
        """The target's logits (a, w + 1, V) after the logits processors, slot j of row r seeing exactly the ids plain
        batched generate would pass there (the row's padded prompt, its tokens, its drafts before j): one call per
        length among the verified slots (`valid`), on the whole batch at that length."""
        if not self.processors:
            return logits
        if self.batched_processors:  # probability-only warpers: every row alike, ids unread
            flat = logits.reshape(-1, logits.shape[-1])
            return self.processors(ids.reshape(-1, 1), flat).reshape(logits.shape)
        self.ids.stage(batch.rows, ids[:, 1:])
        slots = torch.arange(ids.shape[1], device=ids.device)
        lengths = self.ids.lengths_of(batch.rows)[:, None] + slots  # (a, w + 1): how many ids slot j reads
        scores = logits.new_zeros((len(self.ids.lengths), logits.shape[-1]))  # rows of other lengths: read by no one
        for length in lengths[valid].unique().tolist():
            i, j = ((lengths == length) & valid).nonzero(as_tuple=True)
            rows = batch.rows[i]
            scores[rows] = logits[i, j]
            logits[i, j] = self.processors(self.ids.columns(length), scores)[rows]
        return logits

    # -------------------------------------------------------------------------------------------------- acceptance

    def _accept(self, batch, drafts, counts: torch.LongTensor, logits: torch.Tensor):
        """(accepted drafts per row (a,), the token after them (a,)): greedy, the target's argmax wherever the drafts
        agreed with it; sampling, speculative sampling row by row."""
        tokens = drafts.token_ids.to(logits.device)
        if not tokens.shape[1]:  # a plain step: the target's own token
            first = logits[:, 0]
            return torch.zeros_like(counts), torch.multinomial(first.softmax(-1), 1)[:, 0] if self.do_sample else first.argmax(-1)
        proposed = torch.arange(tokens.shape[1], device=logits.device)[None, :] < counts[:, None]
        if not self.do_sample:
            choice = logits.argmax(dim=-1)  # (a, w + 1)
            agree = (tokens == choice[:, :-1]) & proposed
            accepted = agree.long().cumprod(dim=1).sum(dim=1)
            return accepted, choice.gather(1, accepted[:, None]).squeeze(1)
        return self._accept_sampled(tokens, drafts.target_logits, proposed, logits)

    def _accept_sampled(self, tokens, draft_scores, proposed, logits):
        """Draft n survives with probability min(1, p(x)/q(x)); the first that does not is replaced by a draw from
        norm(max(p - q, 0)), and a row whose drafts all survive draws its bonus token from p (Leviathan et al.)."""
        p = F.softmax(logits, dim=-1)  # (a, w + 1, V)
        q = F.softmax(draft_scores.to(p.device).float(), dim=-1)  # (a, w, V)
        p_x, q_x = p[:, :-1].gather(2, tokens[..., None]).squeeze(2), q.gather(2, tokens[..., None]).squeeze(2)
        survives = (torch.rand_like(p_x) * q_x < p_x) & proposed
        accepted = survives.long().cumprod(dim=1).sum(dim=1)  # (a,)
        rejected = accepted < proposed.sum(dim=1)
        at = accepted[:, None, None].expand(-1, 1, p.shape[-1])
        q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, at).squeeze(1)
        residual = (p.gather(1, at).squeeze(1) - q_at * rejected[:, None]).clamp_(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p.gather(1, at).squeeze(1))
        return accepted, torch.multinomial(residual, 1).squeeze(1)

    def _keep_scores(self, rows: torch.LongTensor, scores: torch.Tensor, raw: torch.Tensor, accepted: torch.LongTensor):
        """The processed scores and raw logits (a, w + 1, V) of the slots each row commits (its accepted drafts and
        the token after them), where the call asks for them (`_commit` drops what follows a row's stop)."""
        for kept, values in ((self.scores, scores), (self.logits, raw)):
            for i, row in enumerate(rows.tolist() if kept is not None else ()):
                kept.append(row, values[i, : int(accepted[i]) + 1].clone())

    # -------------------------------------------------------------------------------------------------- commit

    def _advance(self, batch: DSparkBatchRows, tokens, counts, accepted, bonus, outputs):
        """Commit each row's accepted drafts and bonus token, mark rejected columns as holes, let finished rows go."""
        width, rows = tokens.shape[1], batch.rows.numel()
        slots = torch.arange(width + 1, device=accepted.device)
        self._extend_context(batch, outputs.hidden_states, batch.next_position[:, None] + slots)
        batch.mask = torch.cat([batch.mask, (slots[None, :] <= accepted[:, None]).long()], dim=1)
        committed = [row[:n] + [token] for row, n, token in zip(tokens.tolist(), accepted.tolist(), bonus.tolist())]
        batch.next_position, batch.anchor = batch.next_position + accepted + 1, bonus
        self._commit(batch, committed)
        if width or batch.rows.numel() < rows:  # a plain step that every row stays for leaves no column to tidy
            batch.tidy(lambda: self._catch_up(batch))

    def _commit(self, batch: DSparkBatchRows, committed: list[list[int]]):
        """Append each row's new tokens up to the first on which it stops (EOS, max length, stop strings, custom
        criteria; asked once per length, shortest first, on the whole batch as plain generate asks), then drop the
        rows that are done."""
        checks: dict[int, list[int]] = {}  # length -> rows that reach it this round and have not stopped
        for row, tokens in zip(batch.rows.tolist(), committed):
            if self.stopped_at[row] is None:
                start = self.ids.lengths[row]
                for length in range(start + 1, start + len(tokens) + 1):
                    checks.setdefault(length, []).append(row)
        self.ids.append(batch.rows.tolist(), committed)
        for length in sorted(checks):
            stops = self.stopping_criteria(self.ids.columns(length), None)
            for row in checks[length]:
                if self.stopped_at[row] is None and bool(stops[row]):
                    self.stopped_at[row] = length - self.ids.prompt_length
                    if self.pads_finished:
                        self.ids.lengths[row] = length
                        for kept in (self.scores, self.logits):
                            if kept is not None:
                                kept.truncate(row, self.stopped_at[row])
        keep = [not self._done(row) for row in batch.rows.tolist()]
        if not all(keep):
            batch.keep(torch.tensor(keep, device=batch.rows.device))

    def _done(self, row: int) -> bool:
        """A row is done when it stopped (pads follow), or, where transformers writes on after a stop, at max length
        or once every row has stopped and this one has reached the last stop."""
        if self.stopped_at[row] is None:
            return False
        if self.pads_finished or self.ids.lengths[row] >= self.config.max_length:
            return True
        return None not in self.stopped_at and self.ids.lengths[row] - self.ids.prompt_length >= max(self.stopped_at)

    def _record(self, counts, draft_s: float, verify_s: float):
        width = int(counts.max()) if counts.numel() else 0
        self.stats.widths.append(width)
        self.stats.round_rows.append(int(counts.numel()))
        # tokens through the target's layers: each row's anchor and drafts, or every row padded to the widest
        self.stats.verified_tokens.append(int((counts + 1).sum()) if self.packed else counts.numel() * (width + 1))
        self.stats.draft_time_s += draft_s
        self.stats.verify_time_s += verify_s

    def _output(self):
        """Plain generate's layout: the padded prompts, then each row's tokens, padded after a finished row."""
        pad = self.config._pad_token_tensor
        pad = int(pad) if pad is not None else 0
        longest = max(self.stopped_at)  # the step at which plain generate's last row stopped
        sequences = self.ids.columns(self.ids.prompt_length + longest).clone()
        for row, length in enumerate(self.ids.lengths):
            sequences[row, length:] = pad
        if self.config.return_dict_in_generate:
            steps = sequences.shape[1] - self.ids.prompt_length
            scores, logits = (kept.steps(steps, pad) if kept is not None else None for kept in (self.scores, self.logits))
            return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
        return sequences


install_packed_attention()

__all__ = ["DSparkBatchGeneration", "check_batch_limits"]
