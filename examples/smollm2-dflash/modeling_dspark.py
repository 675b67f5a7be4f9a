# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""DSpark drafter: a DFlash-style parallel block drafter with a Markov logit-bias head and a confidence head.

Remote-code file: copied next to every checkpoint, imports only torch and transformers (siblings as `from .x`).

Reading order (as in `modeling_llama.py`): norm → rotary → MLP → attention with KV injection → draft layer → Markov
head variants → confidence head → draft schedules → token choice → context cache and outputs → checkpoint/target
checks → PreTrainedModel → DSparkForDrafting (training forward and `draft_block`) → the candidate generator that plugs
the drafter into `target.generate(assistant_model=drafter)` → the routing hook installed when this module is imported.

Notation: d hidden size, m aux layers, B block size, N drafts per block (B-1, or B with `sample_from_anchor`),
V_t target vocab, V_d draft vocab, r Markov rank. Draft n (1..N) always predicts the token at position p+n, where
p is the anchor's position; its hidden row is slot n (DFlash/Kimi convention) or slot n-1 (`sample_from_anchor`).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from transformers import GenerationConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, logging

from .configuration_dspark import DSparkConfig

logger = logging.get_logger(__name__)


class DSparkRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DSparkRotaryEmbedding(nn.Module):
    """Rotate-half (neox) RoPE with the drafter's own theta/scaling; context keys and block rows use their own positions."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.compute_inv_freq(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)  # re-set in _init_weights: not in the checkpoint

    @staticmethod
    def compute_inv_freq(config: DSparkConfig, device=None) -> tuple[torch.Tensor, float]:
        if config.rope_parameters.get("rope_type", "default") != "default":
            return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, device)
        dim = config.head_dim
        arange = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (config.rope_theta ** (arange / dim)), 1.0

    def _apply(self, fn, recurse=True):
        # Casting the model to bf16 must not round the frequencies: keep them fp32, only follow the device.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)  # (b, t, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, t, hd)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (b, heads, t, hd) by cos/sin (b, t, hd). Queries and keys differ in length here, so one at a time."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class DSparkMLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, kv_heads, t, hd) -> (b, kv_heads * n_rep, t, hd)"""
    if n_rep == 1:
        return hidden_states
    b, kv_heads, t, hd = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv_heads, n_rep, t, hd).reshape(b, kv_heads * n_rep, t, hd)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling  # (b, h, q, k)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()  # (b, q, h, hd)
    return attn_output, attn_weights


class DSparkAttention(nn.Module):
    """GQA attention with KV injection: keys/values are [W c_context ; W u_block] with shared projections.

    Context rows are fused target states (not passed through `input_layernorm`); block rows are. The per-head
    `k_norm` applies to both; values are not normalized. Queries come from block rows only; attention is non-causal.
    """

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values (b, kv_heads, t, hd) of context or block rows at their own positions."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        keys = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        values = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        return apply_rotary_pos_emb(keys, cos, sin), values

    def forward(
        self,
        hidden_states: torch.Tensor,  # (b, q, d) normalized block rows
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # block rows' cos/sin (b, q, hd)
        context_kv: tuple[torch.Tensor, torch.Tensor],  # (b, kv_heads, t_ctx, hd) each, already rotated
        attention_mask: torch.Tensor | None = None,  # bool (b, 1, q, t_ctx + q); None = see everything
        cache=None,  # transformers' DFlashCache (speculation_type="dflash"): holds earlier context, block cropped later
    ) -> torch.Tensor:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)  # (b, h, q, hd)
        query = apply_rotary_pos_emb(query, *position_embeddings)
        block_keys, block_values = self.project_kv(hidden_states, position_embeddings)
        keys = torch.cat([context_kv[0], block_keys], dim=2)  # (b, kv_heads, t_ctx + q, hd)
        values = torch.cat([context_kv[1], block_values], dim=2)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            keys,
            values,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            is_causal=False,
        )
        return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))


class DSparkDecoderLayer(nn.Module):
    """Qwen3-style layer; the only new thing is that attention also reads the injected context K/V."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, context_kv, attention_mask, cache
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


# ------------------------------------------------------------------------------------------------------------------
# Markov head: the sequential stage. logits_n = U_n + bias_n, where bias_n depends on the previous token only (and,
# for gated/rnn, on the draft's own hidden row and a recurrent state), never on the token being drafted.


class DSparkVanillaMarkovHead(nn.Module):
    """bias = W2 · W1[prev]: a function of the previous token alone, so inference reuses the rows of recent tokens."""

    bias_depends_on_token_only = True
    bias_cache_bytes = 32 * 2**20  # each row costs a read of all of W2 (V_d·r) to compute, and V_d values to keep

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)  # indexed by target ids
        self.markov_w2 = nn.Linear(config.markov_rank, config.draft_vocab_size, bias=False)
        self._bias_rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # previous token id -> bias (1, V_d), LRU
        self._bias_rows_stamp: tuple | None = None

    def embed_previous(self, prev_ids: torch.LongTensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)  # (..., r)

    def anchor_state(self, anchor_hidden: torch.Tensor, anchor_embeds: torch.Tensor) -> torch.Tensor | None:
        """State before draft 1 under the DFlash slot convention (slot 0 = the anchor's row); stateless heads: None."""
        return None

    def step(
        self, hidden_states: torch.Tensor, prev_embeds: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias (..., V_d), next state) for one draft; vectorizes over any leading shape when stateless."""
        return self.markov_w2(prev_embeds), state

    def block_bias(
        self, hidden_states: torch.Tensor, prev_embeds: torch.Tensor, state: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced bias for all drafts at once: hidden (..., N, d), prev_embeds (..., N, r) -> (..., N, V_d)."""
        return self.step(hidden_states, prev_embeds, state)[0]

    def token_step(
        self, hidden_states: torch.Tensor, prev_id: int, prev_embeds: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`step` for one draft at inference. When the bias depends on the previous token alone, a token seen recently
        gets the very row computed then (bit-identical); the rows are dropped whenever W1 or W2 change."""
        stamp = self._weights_stamp() if self.bias_depends_on_token_only else None
        if stamp is None:
            return self.step(hidden_states, prev_embeds, state)
        if stamp != self._bias_rows_stamp:
            self._bias_rows.clear()
            self._bias_rows_stamp = stamp
        row = self._bias_rows.get(prev_id)
        if row is None:
            row = self.step(hidden_states, prev_embeds, state)[0]
            self._bias_rows[prev_id] = row
            if len(self._bias_rows) * row.numel() * row.element_size() > self.bias_cache_bytes:
                self._bias_rows.popitem(last=False)
        else:
            self._bias_rows.move_to_end(prev_id)
        return row, state

    def _weights_stamp(self) -> tuple | None:
        """Identity and in-place version of W1 and W2 (an optimizer step or a load bumps it); None where not tracked:
        inference-mode weights, or W1/W2 wrapped by an adapter (PEFT) whose own weights can change or switch."""
        if type(self.markov_w1) is not nn.Embedding or type(self.markov_w2) is not nn.Linear:
            return None
        try:
            return tuple((id(w), w.data_ptr(), w._version, w.dtype) for w in (self.markov_w1.weight, self.markov_w2.weight))
        except RuntimeError:  # inference-mode tensors keep no version counter: compute every row
            return None


class DSparkGatedMarkovHead(DSparkVanillaMarkovHead):
    """bias = W2 (σ(gate_proj([ĥ; W1[prev]])) ⊙ W1[prev])."""

    bias_depends_on_token_only = False

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size + config.markov_rank, config.markov_rank, bias=True)

    def step(self, hidden_states, prev_embeds, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden_states, prev_embeds], dim=-1)))
        return self.markov_w2(gate * prev_embeds), state


class DSparkRNNMarkovHead(DSparkVanillaMarkovHead):
    """GRU-like state over the block: [g, c, o] = joint_proj([s; W1[prev]; ĥ]); s' = σ(g)s + (1-σ(g))tanh(c); bias = W2 tanh(o).

    The state starts at zero on slot 0 of the block: under the DFlash slot convention slot 0 (the anchor's row, which
    drafts nothing) takes one step with W1[anchor] before draft 1, as in speculators.
    """

    bias_depends_on_token_only = False

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.joint_proj = nn.Linear(2 * config.markov_rank + config.hidden_size, 3 * config.markov_rank, bias=True)

    def anchor_state(self, anchor_hidden, anchor_embeds):
        """As speculators does: slot 0 predicts nothing but steps the recurrence with its row and W1[anchor]."""
        return self.step(anchor_hidden, anchor_embeds, None)[1]

    def step(self, hidden_states, prev_embeds, state):
        if state is None:
            state = hidden_states.new_zeros(*hidden_states.shape[:-1], self.markov_rank)
        gate, candidate, output = self.joint_proj(torch.cat([state, prev_embeds, hidden_states], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state

    def block_bias(self, hidden_states, prev_embeds, state=None):
        biases = []
        for n in range(hidden_states.shape[-2]):
            bias, state = self.step(hidden_states[..., n, :], prev_embeds[..., n, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


MARKOV_HEAD_CLASSES = {
    "vanilla": DSparkVanillaMarkovHead,
    "gated": DSparkGatedMarkovHead,
    "rnn": DSparkRNNMarkovHead,
}


class DSparkConfidenceHead(nn.Module):
    """c_n = σ(w·[ĥ_n ; W1[prev_n]] + b): probability that draft n survives given all earlier drafts did."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.with_markov = config.confidence_head_with_markov and config.markov_rank > 0
        self.proj = nn.Linear(config.hidden_size + (config.markov_rank if self.with_markov else 0), 1, bias=True)

    def forward(self, hidden_states: torch.Tensor, prev_embeds: torch.Tensor | None) -> torch.Tensor:
        features = torch.cat([hidden_states, prev_embeds], dim=-1) if self.with_markov else hidden_states
        return self.proj(features).squeeze(-1)  # logits (...,)


# ------------------------------------------------------------------------------------------------------------------
# Draft schedules: decide, left to right, whether draft n of a block is proposed for verification. They see only the
# calibrated confidence c_n, which depends on the tokens before n, so every schedule is lossless (a schedule may also
# cut the block back after drafting it, `finish`, which only greedy decoding allows: see DSparkHardwareAwareSchedule).


class DSparkDraftSchedule:
    """Base schedule: admits every draft (fixed block length). `survival` is a_n = Π_{i≤n} c_i of the drafts seen."""

    def start(self) -> None:
        """Called once at the start of each block."""
        self.survival = 1.0

    def admit(self, confidence: float) -> bool:
        """Draft n's calibrated c_n -> True: propose draft n; False: end the block before it."""
        self.survival *= confidence
        return True

    def finish(self, num_drafted: int) -> int:
        """After the block: how many of its drafts to propose (all of them; a lookahead schedule may cut back)."""
        return num_drafted


class DSparkThresholdSchedule(DSparkDraftSchedule):
    """Admit draft n while its survival a_n stays at or above `threshold` (None: no threshold)."""

    def __init__(self, threshold: float | None):
        self.threshold = threshold

    def admit(self, confidence: float) -> bool:
        super().admit(confidence)
        return self.threshold is None or self.survival >= self.threshold


class DSparkVerifyCostSchedule(DSparkThresholdSchedule):
    """Admit draft n only while it raises the expected committed tokens per unit of verify cost.

    With E = 1 + Σ a_i over the admitted drafts (the bonus token counts) and C = 1 + verify_cost · (drafts admitted),
    draft n is admitted when (E + a_n) / (C + verify_cost) > E / C. `verify_cost` is the cost of one more verified
    token relative to a whole verify pass; an optional survival `threshold` is applied first.
    """

    def __init__(self, verify_cost: float, threshold: float | None = None):
        super().__init__(threshold)
        self.verify_cost = verify_cost

    def start(self) -> None:
        super().start()
        self.expected, self.cost = 1.0, 1.0

    def admit(self, confidence: float) -> bool:
        if not super().admit(confidence):
            return False
        if (self.expected + self.survival) / (self.cost + self.verify_cost) <= self.expected / self.cost:
            return False
        self.expected, self.cost = self.expected + self.survival, self.cost + self.verify_cost
        return True


def draft_schedule(confidence_threshold: float | None = None, verify_cost: float | None = None) -> DSparkDraftSchedule:
    """The schedule that the `confidence_threshold` / `verify_cost` settings describe (fixed length if neither)."""
    if verify_cost is not None:
        return DSparkVerifyCostSchedule(verify_cost, confidence_threshold)
    if confidence_threshold is not None:
        return DSparkThresholdSchedule(confidence_threshold)
    return DSparkDraftSchedule()


# ------------------------------------------------------------------------------------------------------------------
# Token choice: each draft is chosen the way the target will judge it.


def _sampling_warpers(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


# Warpers that read nothing but the scores' probabilities: on the draft vocabulary they keep and rescale exactly the
# tokens they would keep among the same logits scattered to the target vocabulary (-inf elsewhere has probability 0).
_VOCAB_AGNOSTIC_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One draw from probs (1, V) by the inverse CDF in float64: one uniform number, where `torch.multinomial` draws V
    exponentials (0.35 ms for V = 16k on one CPU core, ~10x this). Zero-probability ids are never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand((1, 1), dtype=torch.float64, device=probs.device, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).reshape(1)


class DSparkTokenChooser:
    """Chooses draft tokens from their Markov-corrected logits (1, V_d), one draft at a time.

    Greedy without processors: the argmax over the draft vocabulary. Sampling with only probability warpers
    (temperature, top-k, top-p, min-p): warped and drawn on the draft vocabulary, V_d wide rather than V_t. Any other
    processor reads target ids and the drafts so far, so the logits are scattered to the target vocabulary (-inf
    outside the draft vocab) and processed there. Either way the processed scores are the q that rejection sampling
    needs; `target_scores` gives them on the target vocabulary.
    """

    def __init__(
        self,
        draft_to_target: torch.LongTensor,  # (V_d,) target id of each draft id
        vocab_size: int,
        sequence: torch.LongTensor,  # (1, t) the committed tokens the processors read
        do_sample: bool = False,
        logits_processor: LogitsProcessorList | None = None,
        generator: torch.Generator | None = None,
    ):
        self.draft_to_target, self.vocab_size, self.sequence = draft_to_target, vocab_size, sequence
        self.do_sample, self.logits_processor, self.generator = do_sample, logits_processor, generator
        self.on_draft_vocab = all(isinstance(p, _VOCAB_AGNOSTIC_WARPERS) for p in logits_processor or ())

    def choose(self, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft logits (1, V_d) -> target id (1,) and the processed scores (1, V_d or V_t), or None if greedy."""
        if not (self.do_sample or self.logits_processor):
            return self.draft_to_target[logits.argmax(dim=-1)], None
        if self.on_draft_vocab:
            scores = self.logits_processor(self.sequence, logits) if self.logits_processor else logits
            return self.draft_to_target[self._pick(scores)], scores
        scores = logits.new_full((1, self.vocab_size), float("-inf"))
        scores[:, self.draft_to_target] = logits
        if self.logits_processor:
            scores = self.logits_processor(self.sequence, scores)
        token = self._pick(scores)
        if self.logits_processor:  # processors such as repetition penalty read the drafts so far
            self.sequence = torch.cat([self.sequence, token.reshape(1, 1)], dim=-1)
        return token, scores

    def _pick(self, scores: torch.Tensor) -> torch.LongTensor:
        if self.do_sample:
            return sample_from(F.softmax(scores, dim=-1), self.generator)
        return scores.argmax(dim=-1)

    def target_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Stacked scores of `choose` (1, n, V_d or V_t) on the target vocabulary (1, n, V_t), -inf outside V_d."""
        if not self.on_draft_vocab:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = scores
        return full


# ------------------------------------------------------------------------------------------------------------------
# Context cache and model outputs


class DSparkContextCache:
    """Per-layer K/V of the committed context, computed once per position. The drafted block is never stored."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        if layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=2)

    def crop(self, max_length: int):
        """Keep the first `max_length` context positions (e.g. to reuse a prefix)."""
        self.keys = [k[:, :, :max_length] for k in self.keys]
        self.values = [v[:, :, :max_length] for v in self.values]

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    def __iter__(self):
        """Per-layer (keys, values), the form the block pass reads context K/V in."""
        return zip(self.keys, self.values)


@dataclass
class DSparkTrainingOutput(ModelOutput):
    """Training forward over (anchor, block) pairs; every tensor is indexed (batch, anchor, draft n)."""

    logits: torch.Tensor | None = None  # (b, J, N, V_d) Markov-corrected, teacher-forced
    base_logits: torch.Tensor | None = None  # (b, J, N, V_d) U_n without the Markov bias
    confidence_logits: torch.Tensor | None = None  # (b, J, N)
    label_positions: torch.LongTensor | None = None  # (b, J, N) position p+n each draft predicts
    hidden_states: torch.Tensor | None = None  # (b, J, N, d) the drafts' hidden rows


@dataclass
class DSparkDraftOutput(ModelOutput):
    """One drafted block (batch 1). `draft_logits` are what the drafts were chosen from (Markov-corrected, processed)."""

    token_ids: torch.LongTensor | None = None  # (1, n) target ids
    draft_logits: torch.Tensor | None = None  # (1, n, V_d) Markov-corrected logits, before processors
    target_logits: torch.Tensor | None = None  # (1, n, V_t) processed, -inf outside the draft vocab (sampling q)
    confidences: torch.Tensor | None = None  # (1, n) calibrated c_n
    survival: torch.Tensor | None = None  # (1, n) a_n = prod_{i<=n} c_i


# ------------------------------------------------------------------------------------------------------------------
# Checkpoint and target checks: one clear line per way a drafter cannot load or serve a target.


def expected_tensor_shapes(config: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint layout and its shape, from the model itself (built on the meta device)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in DSparkForDrafting(config).state_dict().items()}


def check_checkpoint_shapes(directory: str, config: DSparkConfig):
    """Refuse, in one line, a checkpoint whose tensor shapes disagree with its config (names the first mismatch)."""
    expected = expected_tensor_shapes(config)
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                shape = tuple(checkpoint.get_slice(name).get_shape())
                if name in expected and shape != expected[name]:
                    raise ValueError(
                        f"{os.path.basename(file)}: {name} has shape {shape} in the checkpoint but {expected[name]} "
                        "from config.json; fix the config (or re-export the checkpoint) so they agree."
                    )


def check_target_compatibility(config: DSparkConfig, target: PreTrainedModel):
    """One clear error per way a drafter cannot serve this target (DESIGN §9)."""
    text_config = target.config.get_text_config()
    if text_config.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"DSpark drafter expects target hidden size {config.target_hidden_size} but the target has "
            f"{text_config.hidden_size}; use a drafter trained for this target."
        )
    if text_config.vocab_size != config.vocab_size:
        raise ValueError(
            f"DSpark drafter vocab_size={config.vocab_size} differs from the target's {text_config.vocab_size}; "
            "use a drafter trained for this target's tokenizer."
        )
    depth = text_config.num_hidden_layers
    if max(config.aux_hidden_state_layer_ids) > depth:
        raise ValueError(
            f"DSpark aux layer id {max(config.aux_hidden_state_layer_ids)} is beyond the target's {depth} layers; "
            f"use aux_hidden_state_layer_ids within [0, {depth}]."
        )
    if config.target_num_hidden_layers is not None and config.target_num_hidden_layers != depth:
        raise ValueError(
            f"DSpark drafter was trained for a target of {config.target_num_hidden_layers} layers but this target has "
            f"{depth}; use a drafter trained for this target (target_num_hidden_layers={depth})."
        )


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    config: DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "aux_hidden_states"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DSparkRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, DSparkRotaryEmbedding):
            inv_freq, _ = module.compute_inv_freq(module.config, device=module.inv_freq.device)
            module.inv_freq.copy_(inv_freq)
        if isinstance(module, DSparkVanillaMarkovHead):
            nn.init.normal_(module.markov_w1.weight, mean=0.0, std=0.01)
        if isinstance(module, DSparkForDrafting):
            # Identity draft vocabulary until `set_draft_vocab` installs a real one.
            module.d2t.zero_()
            module.t2d.zero_()
            module.t2d[: self.config.draft_vocab_size] = True


class DSparkForDrafting(DSparkPreTrainedModel):
    """A DSpark drafter.

    Tensors (names are the checkpoint format): `layers.{i}.*`, `fc`, `hidden_norm`, `norm`, `embed_tokens` (frozen copy
    of the target's input embeddings, [V_t, d]), `lm_head` (frozen target LM-head rows where `t2d`, [V_d, d]), `d2t`,
    `t2d`, `markov_head.*`, `confidence_head.*`.

    `embed_tokens` and `lm_head` may be absent from a checkpoint (`config.bind_target_embeddings`): they are then bound
    from the target with `bind_target(target)`, which the candidate generator calls on first use.
    """

    _keys_to_ignore_on_load_missing = [r"^embed_tokens\.weight$", r"^lm_head\.weight$"]

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        num_aux = len(config.aux_hidden_state_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DSparkRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.markov_head = MARKOV_HEAD_CLASSES[config.markov_head_type](config) if config.markov_rank > 0 else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        self.d2t = nn.Buffer(torch.zeros(config.draft_vocab_size, dtype=torch.long))  # draft id j -> target j + d2t[j]
        self.t2d = nn.Buffer(torch.zeros(config.vocab_size, dtype=torch.bool))  # target id in draft vocab?
        # Drafting settings read by the candidate generator: `num_assistant_tokens` (max drafts per round),
        # `dspark_confidence_threshold` and `dspark_verify_cost` (confidence-scheduled block length, off by default).
        self.generation_config = GenerationConfig(num_assistant_tokens=config.num_draft_tokens)
        # The hardware schedule's online confidence bias per decoding setting, kept across generate calls (clear it
        # to start over, e.g. after switching to another kind of prompt).
        self.dspark_confidence_bias: dict[tuple, float] = {}
        # ... and the acceptance counts of prompt-lookup drafts per decoding setting (`DSparkPromptLookup`).
        self.dspark_lookup_counts: dict[tuple, dict[int, list[float]]] = {}
        self.post_init()
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    # --------------------------------------------------------------------------------------------------------------
    # Vocabulary and target binding

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor):
        """Install a draft vocabulary: d2t (int64 [V_d]) offsets and t2d (bool [V_t]) membership, ascending ids."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape or int(t2d.sum()) != d2t.numel():
            raise ValueError(
                f"draft vocabulary shapes d2t{tuple(d2t.shape)}/t2d{tuple(t2d.shape)} (with {int(t2d.sum())} members) "
                f"do not fit this drafter (V_d={self.d2t.numel()}, V_t={self.t2d.numel()}); rebuild it with "
                "`dspark-hf vocab --draft-vocab-size` equal to config.draft_vocab_size."
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target_ids(self) -> torch.LongTensor:
        """Target id of each draft id (V_d,)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def bind_target(self, target: PreTrainedModel):
        """Copy the frozen embedding table and the draft-vocab rows of the LM head from the target model."""
        check_target_compatibility(self.config, target)
        embeddings = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        device = self.fc.weight.device
        self.embed_tokens.weight.copy_(embeddings.to(device=device, dtype=self.embed_tokens.weight.dtype))
        rows = self.draft_to_target_ids.to(head.device)
        self.lm_head.weight.copy_(head[rows].to(device=device, dtype=self.lm_head.weight.dtype))
        self._bound_target = target.config.name_or_path

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        """Also writes the drafting settings (`generation_config.json`); checkpoints with `bind_target_embeddings`
        omit the frozen target copies (they come from the target at attach time)."""
        if self.config.bind_target_embeddings:
            state_dict = dict(state_dict if state_dict is not None else self.state_dict())
            state_dict.pop("embed_tokens.weight", None)
            state_dict.pop("lm_head.weight", None)
        result = super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        if kwargs.get("is_main_process", True):
            self.generation_config.save_pretrained(save_directory)
        return result

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if os.path.isdir(pretrained_model_name_or_path):
            config = kwargs.get("config")
            check_checkpoint_shapes(
                pretrained_model_name_or_path,
                config if isinstance(config, DSparkConfig) else DSparkConfig.from_pretrained(pretrained_model_name_or_path),
            )
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        hub_kwargs = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
        try:
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        except OSError:  # no generation_config.json: keep the defaults from the config
            pass
        return model

    # --------------------------------------------------------------------------------------------------------------
    # Shared pieces of training and inference
    def fuse_context(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """c_t = hidden_norm(fc([h_s1; ...; h_sm])) : (b, t, m·d) -> (b, t, d)."""
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    @property
    def num_draft_tokens(self) -> int:
        return self.config.num_draft_tokens

    def _draft_rows(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows that produce drafts 1..N: slots 1..B-1, or 0..B-1 with `sample_from_anchor`."""
        return block_hidden if self.config.sample_from_anchor else block_hidden[..., 1:, :]

    def _block_embeddings(self, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """[x_p, MASK × (B-1)] embeddings: anchor_ids (...,) -> (..., B, d)."""
        mask = torch.full_like(anchor_ids, self.config.mask_token_id)
        ids = torch.stack([anchor_ids] + [mask] * (self.config.block_size - 1), dim=-1)
        return self.embed_tokens(ids)

    def _context_kv(self, context: torch.Tensor, positions: torch.LongTensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer rotated keys and values (b, kv_heads, t, hd) of fused context rows (b, t, d) at their positions."""
        rope = self.rotary_emb(context, positions)
        return [layer.self_attn.project_kv(context, rope) for layer in self.layers]

    def _run_block(
        self,
        hidden: torch.Tensor,  # (b, q, d) block row embeddings
        positions: torch.LongTensor,  # (b, q) their positions
        context_kv,  # per-layer (keys, values) of the context, e.g. a list from `_context_kv` or a DSparkContextCache
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Block rows through every layer, each reading its context K/V -> normalized rows (b, q, d)."""
        rope = self.rotary_emb(hidden, positions)
        for layer, layer_context_kv in zip(self.layers, context_kv):
            hidden = layer(hidden, rope, layer_context_kv, attention_mask, cache)
        return self.norm(hidden)

    def _markov_start_state(self, block_hidden: torch.Tensor, anchor_ids: torch.LongTensor) -> torch.Tensor | None:
        """Markov state before draft 1 from the block rows (..., B, d): slot 0 steps it unless it drafts itself."""
        if self.markov_head is None or self.config.sample_from_anchor:
            return None
        return self.markov_head.anchor_state(block_hidden[..., 0, :], self.markov_head.embed_previous(anchor_ids))

    def _markov_and_confidence(
        self, draft_hidden: torch.Tensor, prev_ids: torch.LongTensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Teacher-forced Markov bias (..., N, V_d) and confidence logits (..., N) given each draft's previous token."""
        prev_embeds = self.markov_head.embed_previous(prev_ids) if self.markov_head is not None else None
        bias = self.markov_head.block_bias(draft_hidden, prev_embeds, state) if self.markov_head is not None else None
        confidence = self.confidence_head(draft_hidden, prev_embeds) if self.confidence_head is not None else None
        return bias, confidence

    # --------------------------------------------------------------------------------------------------------------
    # Training forward: many (anchor, block) pairs of one sequence per batch row, with the exact inference mask.

    def _block_attention_mask(
        self, anchor_positions: torch.LongTensor, num_context: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Bool mask (b, 1, J·B, T + J·B) over [context ; blocks] for anchors (b, J) and T = `num_context` rows.

        The B rows of block j see context rows t < p_j that are real tokens (`attention_mask` (b, T), right padding)
        and the rows of block j itself, nothing else: exactly what a row sees at inference.
        """
        (b, J), B, device = anchor_positions.shape, self.config.block_size, anchor_positions.device
        sees_context = torch.arange(num_context, device=device)[None, None, :] < anchor_positions[..., None]  # (b, J, T)
        if attention_mask is not None:
            sees_context = sees_context & attention_mask.bool()[:, None, :]
        sees_context = sees_context[:, :, None, :].expand(b, J, B, num_context).reshape(b, J * B, num_context)
        block_of_row = torch.arange(J * B, device=device) // B
        sees_block = (block_of_row[:, None] == block_of_row[None, :]).expand(b, J * B, J * B)
        return torch.cat([sees_context, sees_block], dim=-1)[:, None]

    def _block_training_forward(
        self,
        aux_hidden_states: torch.Tensor,  # (b, T, m·d) target aux states of every position
        input_ids: torch.LongTensor,  # (b, T) the sequence (anchors and teacher-forced previous tokens)
        anchor_positions: torch.LongTensor,  # (b, J) anchor positions p_j
        attention_mask: torch.Tensor | None = None,  # (b, T) 1 = real token (right padding)
    ) -> DSparkTrainingOutput:
        """Block j sees the context rows t < p_j of its own sequence and its own B block rows, nothing else."""
        b, T = input_ids.shape
        J, B, N = anchor_positions.shape[1], self.config.block_size, self.num_draft_tokens
        device = input_ids.device
        context_kv = self._context_kv(self.fuse_context(aux_hidden_states), torch.arange(T, device=device).expand(b, T))
        anchor_ids = input_ids.gather(1, anchor_positions)  # (b, J)
        hidden = self._block_embeddings(anchor_ids).reshape(b, J * B, -1)  # (b, J·B, d)
        block_pos = (anchor_positions[..., None] + torch.arange(B, device=device)).reshape(b, J * B)
        mask = self._block_attention_mask(anchor_positions, T, attention_mask)
        hidden = self._run_block(hidden, block_pos, context_kv, mask).reshape(b, J, B, -1)

        draft_hidden = self._draft_rows(hidden)  # (b, J, N, d)
        base_logits = self.lm_head(draft_hidden)
        label_positions = anchor_positions[..., None] + torch.arange(1, N + 1, device=device)  # (b, J, N)
        prev_ids = input_ids.gather(1, (label_positions - 1).clamp(max=T - 1).reshape(b, J * N)).reshape(b, J, N)
        state = self._markov_start_state(hidden, anchor_ids)
        bias, confidence_logits = self._markov_and_confidence(draft_hidden, prev_ids, state)
        return DSparkTrainingOutput(
            logits=base_logits + bias if bias is not None else base_logits,
            base_logits=base_logits,
            confidence_logits=confidence_logits,
            label_positions=label_positions,
            hidden_states=draft_hidden,
        )

    @torch.no_grad()
    def _dflash_forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask, cache):
        """transformers' DFlash protocol: new context rows + the block in one call, K/V kept in its DFlashCache.

        That path drafts greedily from `last_hidden_state[:, 1:]` through the target's full LM head with no Markov
        bias, so it fits only a drafter trained that way: DFlash slot convention, no Markov head, full vocabulary.
        """
        if self.markov_head is not None or self.config.sample_from_anchor or self.config.draft_vocab_size != self.config.vocab_size:
            raise ValueError(
                "speculation_type='dflash' drafts with the target's full LM head and no Markov bias; this drafter has "
                f"markov_rank={self.config.markov_rank}, sample_from_anchor={self.config.sample_from_anchor}, "
                f"draft_vocab_size={self.config.draft_vocab_size}/{self.config.vocab_size}. Drop speculation_type to use DSpark drafting."
            )
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("DSpark drafting needs an unpadded prompt (attention_mask all ones); drop the padding.")
        num_context = context_hidden_states.shape[1]
        context = self.fuse_context(context_hidden_states)
        context_kv = self._context_kv(context, position_ids[:, :num_context])
        hidden = self._run_block(noise_embeds.to(context.dtype), position_ids[:, num_context:], context_kv, None, cache)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache)

    def forward(
        self,
        aux_hidden_states: torch.Tensor | None = None,  # (b, T, m·d) target aux states of every position
        input_ids: torch.LongTensor | None = None,  # (b, T) the sequence (anchors and teacher-forced previous tokens)
        anchor_positions: torch.LongTensor | None = None,  # (b, J) anchor positions p_j
        attention_mask: torch.Tensor | None = None,  # (b, T) 1 = real token (right padding)
        noise_embeds: torch.Tensor | None = None,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        **kwargs,
    ) -> DSparkTrainingOutput | BaseModelOutputWithPast:
        """The block-training forward over (anchor, block) pairs (see `_block_training_forward`).

        Called with `noise_embeds`/`context_hidden_states`/`cache` instead, it serves transformers' built-in
        `generate(..., speculation_type="dflash")` path (see `_dflash_forward`).
        """
        if noise_embeds is not None:
            return self._dflash_forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache)
        return self._block_training_forward(aux_hidden_states, input_ids, anchor_positions, attention_mask)

    # --------------------------------------------------------------------------------------------------------------
    # Inference

    @torch.no_grad()
    def extend_context(self, cache: DSparkContextCache, aux_hidden_states: torch.Tensor) -> DSparkContextCache:
        """Append committed positions (b, n, m·d) to the context cache; their K/V are computed exactly once."""
        start = cache.get_seq_length()
        context = self.fuse_context(aux_hidden_states)
        positions = torch.arange(start, start + context.shape[1], device=context.device).expand(context.shape[0], -1)
        for i, layer_kv in enumerate(self._context_kv(context, positions)):
            cache.update(i, *layer_kv)
        return cache

    @torch.no_grad()
    def block_rows(self, cache: DSparkContextCache, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """The one parallel pass: (b,) anchors at position = context length -> normalized block rows (b, B, d)."""
        hidden = self._block_embeddings(anchor_ids)  # (b, B, d)
        start = cache.get_seq_length()
        positions = torch.arange(start, start + self.config.block_size, device=hidden.device).expand(hidden.shape[0], -1)
        return self._run_block(hidden, positions, cache)

    @torch.no_grad()
    def block_hidden_states(self, cache: DSparkContextCache, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """Normalized draft rows (b, N, d) of the parallel pass."""
        return self._draft_rows(self.block_rows(cache, anchor_ids))

    def _markov_step(
        self,
        base_logits: torch.Tensor,
        hidden: torch.Tensor,
        prev: torch.LongTensor,
        prev_embeds: torch.Tensor | None,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft n's logits U_n + bias(prev, state) (1, V_d) from U_n (1, V_d), its row (1, d), the previous token
        (1,) and W1[prev] (1, r); also the next Markov state."""
        if self.markov_head is None:
            return base_logits, state
        bias, state = self.markov_head.token_step(hidden, int(prev), prev_embeds, state)
        return base_logits + bias.float(), state

    def _calibrated_confidence(self, hidden: torch.Tensor, prev_embeds: torch.Tensor | None, n: int) -> torch.Tensor:
        """c_n = σ(confidence logit / T_n) (1,), with draft n's calibrated temperature T_n."""
        logit = self.confidence_head(hidden, prev_embeds).float()
        return torch.sigmoid(logit / self.config.confidence_temperatures[n])

    def _draft_tokens(
        self,
        draft_hidden: torch.Tensor,  # (1, n, d) the drafts' rows
        anchor: torch.LongTensor,  # (1,)
        state: torch.Tensor | None,  # Markov state before draft 1
        schedule: DSparkDraftSchedule,
        chooser: DSparkTokenChooser,
    ) -> DSparkDraftOutput:
        """The sequential stage: draft n = choice(U_n + bias(x_{n-1})), while the schedule admits its c_n."""
        base_logits = None  # U (1, n, V_d), computed once draft 1 is admitted: a round that drafts nothing skips it
        tokens, draft_logits, target_logits, confidences = [], [], [], []
        prev = anchor
        schedule.start()
        for n in range(draft_hidden.shape[1]):
            # c_n needs only W1[prev]: the schedule decides before the V_d-wide products (LM head, Markov bias) run
            prev_embeds = self.markov_head.embed_previous(prev) if self.markov_head is not None else None
            if self.confidence_head is not None:
                confidence = self._calibrated_confidence(draft_hidden[:, n], prev_embeds, n)
                if not schedule.admit(float(confidence)):
                    break
                confidences.append(confidence)
            if base_logits is None:
                base_logits = self.lm_head(draft_hidden).float()
            logits, state = self._markov_step(base_logits[:, n], draft_hidden[:, n], prev, prev_embeds, state)
            prev, scores = chooser.choose(logits)
            tokens.append(prev)
            draft_logits.append(logits)
            if scores is not None:
                target_logits.append(scores)
        keep = len(tokens) if chooser.do_sample else schedule.finish(len(tokens))  # cutting back is for greedy only
        tokens, draft_logits, target_logits, confidences = tokens[:keep], draft_logits[:keep], target_logits[:keep], confidences[:keep]
        confidences = torch.cat(confidences)[None] if confidences else None  # (1, n)
        return DSparkDraftOutput(
            token_ids=torch.stack(tokens, dim=1) if tokens else anchor.new_zeros((1, 0)),
            draft_logits=torch.stack(draft_logits, dim=1) if draft_logits else None,
            target_logits=chooser.target_scores(torch.stack(target_logits, dim=1)) if target_logits else None,
            confidences=confidences,
            survival=torch.cumprod(confidences.double(), dim=-1).to(confidences.dtype) if confidences is not None else None,
        )

    @torch.no_grad()
    def draft_block(
        self,
        cache: DSparkContextCache,
        anchor_id: torch.LongTensor | int,
        num_drafts: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        logits_processor: LogitsProcessorList | None = None,
        input_ids: torch.LongTensor | None = None,
        confidence_threshold: float | None = None,
        verify_cost: float | None = None,
        generator: torch.Generator | None = None,
        schedule: DSparkDraftSchedule | None = None,
    ) -> DSparkDraftOutput:
        """Draft one block after the cached context: one parallel pass, then the Markov head left to right.

        Sampling draws each x_n from q_n = softmax(processed(U_n + bias(prev))), scattered to the target vocab; the
        processed target-vocab logits are returned so rejection sampling uses exactly that q. A `schedule` may end
        the block early from the calibrated confidences; `confidence_threshold` / `verify_cost` build the threshold
        and verify-cost schedules (see `draft_schedule`).
        """
        num_drafts = self.num_draft_tokens if num_drafts is None else min(num_drafts, self.num_draft_tokens)
        anchor = torch.as_tensor(anchor_id, device=self.fc.weight.device).reshape(1)
        block_hidden = self.block_rows(cache, anchor)  # (1, B, d)
        if logits_processor is None and do_sample:
            logits_processor = _sampling_warpers(temperature, top_k, top_p)
        sequence = input_ids if input_ids is not None else anchor.reshape(1, 1)
        chooser = DSparkTokenChooser(self.draft_to_target_ids, self.config.vocab_size, sequence, do_sample, logits_processor, generator)
        schedule = schedule if schedule is not None else draft_schedule(confidence_threshold, verify_cost)
        state = self._markov_start_state(block_hidden, anchor)
        return self._draft_tokens(self._draft_rows(block_hidden)[:, :num_drafts], anchor, state, schedule, chooser)

    # --------------------------------------------------------------------------------------------------------------
    # transformers integration: the routing hook (end of this file) calls this, bound to the drafter, to serve
    # `target.generate(..., assistant_model=drafter)`; its name is DSPARK_FACTORY_ATTRIBUTE.

    def _dspark_candidate_generator_factory(
        self,
        target: PreTrainedModel,
        generation_config: GenerationConfig,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        model_kwargs: dict[str, Any],
    ) -> DSparkCandidateGenerator:
        stopping_criteria = getattr(self, DSPARK_STOPPING_ATTRIBUTE, None)  # set for this call by the routing hook
        return DSparkCandidateGenerator(
            self, target, input_ids, generation_config, logits_processor, model_kwargs, stopping_criteria
        )


# ------------------------------------------------------------------------------------------------------------------
# Hardware-aware draft length (the DSpark paper's scheduler at batch 1): the target's measured verify cost t(k) for
# k drafts, stored per target/device/dtype/torch under the Hugging Face cache home, and a schedule that drafts the k
# maximising expected committed tokens per second, deciding draft n from c_1..c_n only when sampling (greedy: after
# seeing the whole block), and prompt-lookup drafts priced by the same schedule.

PROFILE_FORMAT = "dspark-verify-profile/2"  # /2: every k measured, no envelope (older files are re-measured)
PROFILE_CONTEXT_LENGTHS = (128, 512)  # context lengths measured; others are interpolated
PROFILE_REPEATS = 4  # timed repetitions per (context, k), after one warm-up pass
PROFILE_MAX_SPREAD = 0.25  # a timing whose interquartile spread exceeds this fraction of its median is noise
PROFILE_TYPICAL_SPREAD = 0.10  # ... and a profile whose median spread exceeds this fraction cannot rank k


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def _device_description(device: torch.device) -> str:
    """What the timings belong to: the accelerator's name, or the CPU model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    return f"{_cpu_name()}, {torch.get_num_threads()} thread(s)"


def verify_profile_key(target: PreTrainedModel) -> dict[str, str]:
    """Everything a verify timing depends on; a profile whose key differs is never used."""
    config = target.config.to_dict()
    for volatile in ("_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"):
        config.pop(volatile, None)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    device = target.device
    return {
        "target": str(target.config.name_or_path or type(target).__name__),
        "revision": str(getattr(target.config, "_commit_hash", None) or ""),
        "config_sha256": config_hash,
        "device": device.type,
        "device_name": _device_description(device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


def verify_profile_path(key: dict[str, str]) -> str:
    """`<HF_HOME>/dspark/profiles/<target>-<hash of the key>.json` (HF_HOME read at call time)."""
    from huggingface_hub import constants  # ships with transformers

    home = os.path.expanduser(os.environ.get("HF_HOME") or constants.HF_HOME)
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in key["target"].split("/")[-1])[:64]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(home, "dspark", "profiles", f"{slug}-{digest}.json")


@dataclass
class DSparkVerifyProfile:
    """t(k): seconds of one verify pass over k drafts (a forward of k+1 tokens on a cached context), per context."""

    key: dict[str, str]
    context_lengths: list[int]
    verify_time_s: list[list[float]]  # [context][k] median over repeats
    spread_s: list[list[float]]  # [context][k] interquartile range over repeats
    noisy: bool = False
    measured_in_s: float = 0.0

    @property
    def max_drafts(self) -> int:
        return len(self.verify_time_s[0]) - 1

    def verify_time(self, num_drafts: int, context_length: int) -> float:
        """t(k) at this context length: linear between measured lengths, the nearest one outside them."""
        lengths, times = self.context_lengths, [row[num_drafts] for row in self.verify_time_s]
        if context_length <= lengths[0]:
            return times[0]
        for i in range(1, len(lengths)):
            if context_length <= lengths[i]:
                w = (context_length - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
                return times[i - 1] + w * (times[i] - times[i - 1])
        return times[-1]

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, **{name: getattr(self, name) for name in self.__dataclass_fields__}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DSparkVerifyProfile":
        """Raises ValueError on anything that is not a well-formed profile."""
        if not isinstance(data, dict) or not str(data.get("format", "")).startswith(PROFILE_FORMAT.split("/")[0]):
            raise ValueError("not a DSpark verify profile")
        if data["format"] != PROFILE_FORMAT:
            raise ValueError(f"format {data['format']}, this DSpark reads {PROFILE_FORMAT}")
        profile = cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})
        rows = profile.verify_time_s + profile.spread_s
        if (
            not profile.context_lengths
            or len(profile.verify_time_s) != len(profile.context_lengths)
            or len(profile.spread_s) != len(profile.context_lengths)
            or len({len(row) for row in rows}) != 1
            or not all(isinstance(t, (int, float)) and t >= 0 for row in rows for t in row)
        ):
            raise ValueError("malformed timings")
        return profile


def _is_noisy(times: list[float], spreads: list[float]) -> bool:
    """Too noisy to rank k: one timing's spread wider than PROFILE_MAX_SPREAD of its median, or the typical (median)
    spread wider than PROFILE_TYPICAL_SPREAD. A consistent inversion, t(k+1) < t(k) with tight spreads, is no noise:
    a CPU picks another matmul kernel for 3 rows than for 4 (fp32 on a 2-core EPYC: 3 tokens verify slower than 4),
    and the schedule should know it."""
    relative = sorted(s / t for t, s in zip(times, spreads))
    return relative[-1] > PROFILE_MAX_SPREAD or relative[len(relative) // 2] > PROFILE_TYPICAL_SPREAD


def _synchronize(device: torch.device):
    if device.type != "cpu" and hasattr(torch, device.type):
        getattr(torch, device.type).synchronize()


@torch.no_grad()
def _time_verify_passes(target, tokens: torch.Tensor, length: int, counts: list[int], repeats: int) -> list[list[float]]:
    """Seconds of each forward of k+1 tokens after `length` cached ones, `repeats` times per k in `counts`, as a
    verify pass runs (aux hidden states requested, cache cropped back). The k order rotates each repetition so a
    slow moment of a shared machine lands on every k alike; repetition 0 warms up and is dropped."""
    device = target.device
    prefill = target(input_ids=tokens[:, :length], use_cache=True)
    cache = getattr(prefill, "cache", None) or prefill.past_key_values
    samples: list[list[float]] = [[] for _ in counts]
    for repeat in range(repeats + 1):
        shift = repeat % len(counts)
        for i in list(range(len(counts)))[shift:] + list(range(len(counts)))[:shift]:
            k = counts[i]
            _synchronize(device)
            start = time.perf_counter()
            target(input_ids=tokens[:, length : length + k + 1], cache=cache, use_cache=True, output_hidden_states=True)
            _synchronize(device)
            if repeat:
                samples[i].append(time.perf_counter() - start)
            cache.crop(-(k + 1))
    return samples


def measure_verify_profile(
    target: PreTrainedModel,
    max_drafts: int,
    context_lengths: tuple[int, ...] = PROFILE_CONTEXT_LENGTHS,
    repeats: int = PROFILE_REPEATS,
) -> DSparkVerifyProfile:
    """t(k) for every k = 0..max_drafts at each context length, on random tokens: the median of `repeats` timings
    and their interquartile spread; marked noisy when the timings cannot rank k (see `_is_noisy`). Every k is timed,
    none interpolated: on CPUs t(k) is not even monotone (small-matrix kernels change with the row count)."""
    started = time.perf_counter()
    text_config = target.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None) or max(context_lengths) + max_drafts + 1
    lengths = sorted({max(1, min(length, limit - max_drafts - 1)) for length in context_lengths})
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, text_config.vocab_size, (1, lengths[-1] + max_drafts + 1), generator=generator)
    tokens = tokens.to(target.device)
    counts = list(range(max_drafts + 1))
    medians, spreads, noisy = [], [], False
    for length in lengths:
        ordered = [sorted(s) for s in _time_verify_passes(target, tokens, length, counts, repeats)]
        times = [s[(len(s) - 1) // 2] for s in ordered]
        spread = [s[(3 * len(s) - 1) // 4] - s[len(s) // 4] for s in ordered]  # robust to one outlier in four
        noisy = noisy or _is_noisy(times, spread)
        medians.append(times)
        spreads.append(spread)
    return DSparkVerifyProfile(verify_profile_key(target), lengths, medians, spreads, noisy, time.perf_counter() - started)


_PROFILES_IN_MEMORY: dict[str, DSparkVerifyProfile] = {}


def load_or_measure_verify_profile(target: PreTrainedModel, max_drafts: int, remeasure: bool = False) -> DSparkVerifyProfile:
    """The stored profile for this target, device, dtype and torch version; measured (and stored) when missing,
    foreign, corrupt or covering fewer drafts. A bad file costs one warning line, never an error."""
    key = verify_profile_key(target)
    path = verify_profile_path(key)
    cached = _PROFILES_IN_MEMORY.get(path)
    if cached is not None and not remeasure and cached.key == key and cached.max_drafts >= max_drafts:
        return cached
    profile = None
    if os.path.isfile(path) and not remeasure:
        try:
            with open(path) as file:
                profile = DSparkVerifyProfile.from_dict(json.load(file))
            if profile.key != key:
                logger.warning(f"DSpark verify profile {path} belongs to another target/device/dtype/torch; re-measuring.")
                profile = None
        except (OSError, ValueError, TypeError, KeyError) as error:
            logger.warning(f"DSpark verify profile {path} is unreadable ({error}); re-measuring.")
            profile = None
    if profile is None or profile.max_drafts < max_drafts:
        profile = measure_verify_profile(target, max_drafts)
        logger.warning(
            f"DSpark measured the target's verify cost for 0..{max_drafts} drafts in {profile.measured_in_s:.1f} s"
            f"{' (too noisy to rank draft lengths: falling back to the confidence threshold)' if profile.noisy else ''};"
            f" stored in {path}."
        )
        store_verify_profile(profile, path)
    _PROFILES_IN_MEMORY[path] = profile
    return profile


def store_verify_profile(profile: DSparkVerifyProfile, path: str):
    """Write atomically; an unwritable cache home only loses the reuse, not the profile."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staging = f"{path}.{os.getpid()}.tmp"
        with open(staging, "w") as file:
            json.dump(profile.to_dict(), file, indent=1)
        os.replace(staging, path)
    except OSError as error:
        logger.warning(f"DSpark could not store the verify profile at {path} ({error}); it will be measured again.")


class DSparkHardwareAwareSchedule(DSparkDraftSchedule):
    """Drafts the k maximising expected committed tokens per second, (1 + Σ_{n≤k} a_n) / (t(k) + draft time).

    Lossless by construction: draft n is admitted from c_1..c_n alone. At draft n the later survivals are projected
    geometrically from the newest conditional confidence, â_m = a_n · c_n^(m-n) (the drafter's confidences are
    strongly correlated along a block, so the last one is the best guess for the next), and draft n is admitted iff
    the best ratio over every k ≥ n beats stopping at n-1. Stopping at 0 is a plain target step, costed t(0) without
    the draft time (the back-off then skips the drafter), so drafting must beat plain decoding, and by `min_gain`: a
    drafted round's cost counts `min_gain` times over, so it must promise that multiple of a plain step's rate (its
    outcome is a gamble on a few probabilities, and a short generation never earns a lost round back; among drafted
    lengths the comparison is unchanged). t(k) comes from the profile at the current context length, rescaled by how
    fast verify passes actually run now (a shared machine drifts); the draft time is a running mean of the drafter's own time per round. On a noisy profile the schedule
    falls back to the calibrated threshold rule (admit while a_n ≥ `fallback_threshold`).

    Greedy decoding (`lookahead`) lifts the left-to-right restriction: greedy verification commits the target's own
    argmax whatever is proposed, so any k is lossless, and the schedule drafts on while even certain later drafts
    (c = 1) could beat the best stop so far, then proposes the k with the best expected rate given every c_n it saw
    (`finish`). The geometric projection errs both ways (the conditionals usually fall along a block, and a dip is
    often followed by confident drafts); when sampling, choosing k from later drafts would bias which drafts get
    verified, so it stays left to right.

    The confidences were calibrated offline on greedy drafts of the training domains; sampling (a draft survives
    with probability Σ min(p, q), not 1[argmax match]) and unseen domains shift them. So each confidence gets a logit
    bias learned online (Platt scaling by SGD; the candidate generator carries it from one generate call to the next
    of the same decoding settings): every draft that verification reached (all before it accepted) is one Bernoulli
    outcome of its c_n. The bias only uses finished rounds, so it stays lossless.
    """

    fallback_threshold = 0.5
    smoothing = 0.2  # weight of the newest observation in the running draft time and verify-speed scale
    recalibration_rate = 0.1  # SGD step of the online logit bias per verified draft
    max_bias = 4.0  # |bias| bound: a run of misses can lower confidences, never pin them at 0 or 1

    def __init__(
        self,
        profile: DSparkVerifyProfile,
        max_drafts: int | None = None,
        draft_time_s: float | None = None,
        min_gain: float = 1.0,
        lookahead: bool = False,
    ):
        self.profile = profile
        self.min_gain = min_gain
        self.lookahead = lookahead
        self.max_drafts = profile.max_drafts if max_drafts is None else min(max_drafts, profile.max_drafts)
        self.draft_time_s = draft_time_s
        self.verify_scale = 1.0
        self.context_length = profile.context_lengths[0]
        self.bias = 0.0
        self.start()

    def observe_draft_time(self, seconds: float):
        self.draft_time_s = seconds if self.draft_time_s is None else self._smooth(self.draft_time_s, seconds)

    def observe_verify_time(self, num_drafts: int, context_length: int, seconds: float):
        """A live verify round of k drafts: track the ratio of real to profiled time."""
        profiled = self.profile.verify_time(min(num_drafts, self.profile.max_drafts), context_length)
        if profiled > 0:
            self.verify_scale = self._smooth(self.verify_scale, seconds / profiled)

    def observe_outcome(self, num_drafted: int, num_accepted: int) -> tuple[float, int, int]:
        """After verification of this round's `num_drafted` drafts: nudge the bias toward the outcomes of the drafts
        verification reached. Returns (Σ predicted c_n, accepted, reached) over them, for live calibration stats."""
        reached = self._admitted[: min(num_drafted, num_accepted + 1)]
        for n, predicted in enumerate(reached, start=1):
            self.bias += self.recalibration_rate * (float(n <= num_accepted) - predicted)
        self.bias = min(max(self.bias, -self.max_bias), self.max_bias)
        return sum(reached), min(num_accepted, len(reached)), len(reached)

    def _smooth(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    def _recalibrated(self, confidence: float) -> float:
        confidence = min(max(confidence, 1e-6), 1 - 1e-6)
        return 1.0 / (1.0 + math.exp(-(math.log(confidence / (1 - confidence)) + self.bias)))

    def round_cost(self, num_drafts: int, draft_s: float) -> float:
        """Seconds a round verifying `num_drafts` drafts is charged: its verify pass plus `draft_s`, times `min_gain`.
        k = 0 is a plain step: with the back-off the drafter then stops running too."""
        verify = self.verify_scale * self.profile.verify_time(num_drafts, self.context_length)
        return verify if num_drafts == 0 else self.min_gain * (verify + draft_s)

    def start(self):
        self._costs = [self.round_cost(k, self.draft_time_s or 0.0) for k in range(self.max_drafts + 1)]
        self._drafted, self.survival, self._expected = 0, 1.0, 1.0
        self._admitted: list[float] = []  # recalibrated c_n of the drafts admitted this round
        self._ratios = [1.0 / self._costs[0]]  # expected tokens per second of stopping after k = 0, 1, ... drafts

    def admit(self, confidence: float) -> bool:
        n = self._drafted + 1
        if n > self.max_drafts:
            return False
        confidence = self._recalibrated(confidence)
        survival = self.survival * confidence
        if self.profile.noisy:
            admitted = survival >= self.fallback_threshold
        elif self.lookahead:  # draft on while even certain later drafts (c = 1) could beat the best stop so far
            admitted = self._best_ratio_from(n, survival, 1.0) > max(self._ratios)
        else:
            admitted = self._best_ratio_from(n, survival, confidence) > self._expected / self._costs[n - 1]
        if admitted:
            self._drafted, self.survival, self._expected = n, survival, self._expected + survival
            self._admitted.append(confidence)
            self._ratios.append(self._expected / self._costs[n])
        return admitted

    def admitted_survivals(self) -> list[float]:
        """a_1..a_k of the drafts this round proposes (recalibrated)."""
        survivals, survival = [], 1.0
        for confidence in self._admitted:
            survival *= confidence
            survivals.append(survival)
        return survivals

    def best_plan(self, survivals: list[float], drafter_ran: bool) -> tuple[int, float]:
        """(k, expected tokens per second) of the best stop for drafts with these survivals a_1, a_2, ...: the
        rate of a plain step for k = 0; the drafter's time counts when it ran this round, whoever drafted."""
        draft = (self.draft_time_s or 0.0) if drafter_ran else 0.0
        best, expected = (0, 1.0 / self.round_cost(0, draft)), 1.0
        for k, survival in enumerate(survivals[: self.max_drafts], start=1):
            expected += survival
            rate = expected / self.round_cost(k, draft)
            if rate > best[1]:
                best = (k, rate)
        return best

    def finish(self, num_drafted: int) -> int:
        """With lookahead, propose the k ≤ `num_drafted` whose expected rate is best, knowing every c_n drafted."""
        if not self.lookahead or self.profile.noisy:
            return num_drafted
        best = max(range(num_drafted + 1), key=lambda k: self._ratios[k])
        self._drafted, self._admitted = best, self._admitted[:best]
        return best

    def _best_ratio_from(self, n: int, survival: float, confidence: float) -> float:
        best, expected, projected = 0.0, self._expected, survival
        for k in range(n, self.max_drafts + 1):
            expected += projected
            best = max(best, expected / self._costs[k])
            projected *= confidence
        return best


class DSparkDrafterBackoff:
    """Skips the drafter after rounds that drafted nothing, for 1, 2, 4, ... up to `max_skip` rounds, each skip
    followed by one probe round; a probe that drafts resets it. When drafting does not pay, the drafter's own cost
    then vanishes too (a k = 0 round with a drafter pass costs more than a plain step)."""

    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip
        self.skip_next = 0  # rounds to skip before the next probe
        self.remaining = 0

    def should_skip(self) -> bool:
        if self.remaining > 0:
            self.remaining -= 1
            return True
        return False

    def record(self, num_drafts: int):
        """After a round in which the drafter ran and the schedule chose `num_drafts`."""
        self.skip_next = 0 if num_drafts else min(max(1, 2 * self.skip_next), self.max_skip)
        self.remaining = self.skip_next


class DSparkPromptLookup:
    """Drafts copied from the context (prompt lookup): the tokens that followed the latest earlier occurrence of the
    sequence's last n-gram, the longest of `max_ngram`..1 that occurs. Free to draft, and often right exactly where
    the drafter is unsure: code restating its signature, a long chat quoting itself, a model repeating a phrase. The
    hardware schedule prices them like the drafter's own, from survivals ℓ^n, where ℓ, the chance a lookup draft is
    accepted once the ones before it were, is learned online per n-gram size: a Beta mean whose prior, worth
    `prior_weight` drafts, is n / (n + 3) (a longer match is a better bet: 1-grams start at 1 in 4, 3-grams at 1 in 2),
    so where verifying is dear (fp32 on a CPU) only long matches are tried until lookup has proven itself."""

    prior_weight = 4.0

    def __init__(self, max_ngram: int, max_tokens: int):
        self.max_ngram, self.max_tokens = max_ngram, max_tokens
        self.counts = {  # n-gram size -> [accepted, reached]
            n: [self.prior_weight * n / (n + 3), self.prior_weight] for n in range(1, max_ngram + 1)
        }

    def propose(self, input_ids: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, int]:
        """(up to `budget` drafts (k,), the n-gram size matched); no drafts and size 0 when nothing matches."""
        sequence = input_ids[0]
        for n in range(min(self.max_ngram, sequence.shape[0] - 1), 0, -1):
            earlier = sequence.unfold(0, n, 1)[:-1]  # every n-gram but the suffix itself
            hits = (earlier == sequence[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return sequence[start : start + min(budget, self.max_tokens)], n
        return sequence[:0], 0

    def survivals(self, ngram: int, num_drafts: int) -> list[float]:
        accepted, reached = self.counts[ngram]
        return [(accepted / reached) ** n for n in range(1, num_drafts + 1)]

    def observe(self, ngram: int, num_drafted: int, num_accepted: int):
        """Each draft verification reached is one outcome: accepted, or the one rejected."""
        self.counts[ngram][0] += num_accepted
        self.counts[ngram][1] += min(num_drafted, num_accepted + 1)


def make_hardware_schedule(drafter: "DSparkForDrafting", target: PreTrainedModel, max_drafts: int, lookahead: bool = False):
    """The schedule `dspark_schedule: "hardware"` asks for, or None (fixed-length drafting) without a confidence
    head. Measures the verify profile on first use for this target, device, dtype and torch version. `lookahead`
    (greedy decoding only) lets the schedule choose k after seeing the whole block's confidences."""
    if drafter.confidence_head is None:
        return None
    profile = getattr(drafter, "dspark_verify_profile", None)  # injected (tests, benchmarks) or measured
    if profile is None or profile.key != verify_profile_key(target):
        profile = load_or_measure_verify_profile(target, max_drafts)
    return DSparkHardwareAwareSchedule(profile, max_drafts, min_gain=_min_gain(drafter.generation_config), lookahead=lookahead)


def _min_gain(drafting: GenerationConfig) -> float:
    """`dspark_min_gain` of the drafter's generation_config (1.0 when unset): how many times a plain step's rate a
    drafted round must promise."""
    value = getattr(drafting, "dspark_min_gain", None)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"dspark_min_gain={value!r} is not a positive number; use e.g. 1.1 (draft only when a round "
                         "promises 10% more than a plain step) or unset it.")
    return float(value)


# ------------------------------------------------------------------------------------------------------------------
# transformers integration: `target.generate(**inputs, assistant_model=drafter)` with no extra flags.


@dataclass
class DSparkGenerationStats:
    """What happened in the last `generate` call: one entry per verify round."""

    num_draft_tokens: int
    drafted: list[int] = field(default_factory=list)  # drafts proposed per round
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round (bonus token not included)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    confidence_predicted: float = 0.0  # Σ recalibrated c_n over drafts verification reached (hardware schedule)
    confidence_observed: int = 0  # ... and how many of them were accepted
    confidence_verified: int = 0  # ... of how many drafts
    lookup_rounds: int = 0  # rounds whose drafts came from prompt lookup (included in drafted/accepted)
    lookup_drafted: int = 0
    lookup_accepted: int = 0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify round, bonus included (τ measured live)."""
        return 1.0 + sum(self.accepted) / max(self.rounds, 1)

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "drafted_tokens": sum(self.drafted),
            "accepted_tokens": sum(self.accepted),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_cumulative": self.acceptance_cumulative(),
            "acceptance_conditional": self.acceptance_conditional(),
            "accepted_histogram": self.accepted_histogram(),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "confidence_predicted": self.confidence_predicted,
            "confidence_observed": self.confidence_observed,
            "confidence_verified": self.confidence_verified,
            "lookup_rounds": self.lookup_rounds,
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
        }


def _stops_inside_a_round(stopping_criteria: StoppingCriteriaList | None) -> StoppingCriteriaList | None:
    """The criteria a round must check draft by draft: transformers itself cuts rounds at max length and EOS."""
    kept = [c for c in stopping_criteria or () if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    return StoppingCriteriaList(kept) if kept else None


def _check_generation_limits(generation_config: GenerationConfig, batch_size: int | None = None):
    """The limits of assisted generation, each as one clear error (transformers would silently beam-search)."""
    if generation_config.num_beams > 1:
        raise ValueError(
            f"DSpark speculative decoding does not support beam search (num_beams={generation_config.num_beams}); use num_beams=1."
        )
    if generation_config.num_return_sequences > 1:
        raise ValueError(
            f"DSpark speculative decoding returns one sequence (num_return_sequences={generation_config.num_return_sequences}); "
            "call generate repeatedly instead."
        )
    if batch_size is not None and batch_size != 1:
        raise ValueError(f"DSpark speculative decoding supports batch size 1, got {batch_size}; call generate once per prompt.")


def _decoding_key(target: PreTrainedModel, generation_config: GenerationConfig) -> tuple:
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

    def __init__(
        self,
        drafter: DSparkForDrafting,
        target: PreTrainedModel,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        model_kwargs: dict[str, Any] | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
    ):
        _check_generation_limits(generation_config, batch_size=input_ids.shape[0])
        check_target_compatibility(drafter.config, target)
        if drafter.config.bind_target_embeddings and getattr(drafter, "_bound_target", None) != target.config.name_or_path:
            drafter.bind_target(target)
        self.drafter = drafter
        self.aux_layer_ids = list(drafter.config.aux_hidden_state_layer_ids)
        # Ask the verify pass for exactly the aux layers; a user asking for all hidden states gets them all.
        wants_all = generation_config.output_hidden_states and generation_config.return_dict_in_generate
        self.model_kwargs_overrides = {"output_hidden_states": True if wants_all else self.aux_layer_ids}
        self.num_drafts = int(getattr(drafter.generation_config, "num_assistant_tokens", None) or drafter.num_draft_tokens)
        self.schedule = self._make_schedule(target, do_sample=bool(generation_config.do_sample))
        # Hardware-aware drafting: after rounds that draft nothing the drafter itself rests (back-off), and the aux
        # rows of the rounds it skipped wait in `_pending_aux` until it runs again.
        self.backoff = DSparkDrafterBackoff() if isinstance(self.schedule, DSparkHardwareAwareSchedule) else None
        self._pending_aux: list[torch.Tensor] = []
        self.bias_key = _decoding_key(target, generation_config)
        self._resume_confidence_bias()
        self.lookup = self._make_lookup()
        self._lookup_ngram = 0  # n-gram size matched when this round's drafts came from prompt lookup, else 0
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor else None
        self.stopping_criteria = _stops_inside_a_round(stopping_criteria)
        self.generation_config = generation_config  # the one `_assisted_decoding` reads each round
        self.max_length = generation_config.max_length
        self.cache = DSparkContextCache()
        self.stats = DSparkGenerationStats(num_draft_tokens=drafter.num_draft_tokens)
        drafter.last_generation_stats = self.stats
        self._last_drafted = 0
        self._verify_started = None
        self._prefilled = False

    def _make_schedule(self, target: PreTrainedModel, do_sample: bool) -> DSparkDraftSchedule:
        """The draft schedule the drafter's generation_config asks for: `dspark_confidence_threshold` /
        `dspark_verify_cost` when set; else `dspark_schedule: "hardware"` (verify-cost profiled); else fixed length."""
        drafting = self.drafter.generation_config
        threshold = getattr(drafting, "dspark_confidence_threshold", None)
        verify_cost = getattr(drafting, "dspark_verify_cost", None)
        mode = getattr(drafting, "dspark_schedule", None)
        if mode not in (None, "fixed", "hardware"):
            raise ValueError(f"dspark_schedule={mode!r} is not a DSpark schedule; use \"hardware\" or \"fixed\".")
        if (threshold is not None or verify_cost is not None) and self.drafter.confidence_head is None:
            raise ValueError(
                "confidence-scheduled drafting needs a confidence head; set enable_confidence_head or unset "
                "dspark_confidence_threshold / dspark_verify_cost on the drafter's generation_config."
            )
        if mode == "hardware" and threshold is None and verify_cost is None and self.drafter.confidence_head is not None:
            # greedy verification is exact for any proposal, so the schedule may choose k after seeing the block
            lookahead = not do_sample and getattr(drafting, "dspark_lookahead", True) is not False
            return make_hardware_schedule(self.drafter, target, self.num_drafts, lookahead)
        return draft_schedule(threshold, verify_cost)

    def _make_lookup(self) -> DSparkPromptLookup | None:
        """Prompt-lookup drafts (`dspark_lookup_ngram_size`: the longest n-gram matched; 0 or unset: off). The hardware
        schedule prices them against the drafter's, so they need it; what they learned carries over between calls of
        the same decoding settings, like the confidence bias."""
        size = getattr(self.drafter.generation_config, "dspark_lookup_ngram_size", None)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(f"dspark_lookup_ngram_size={size!r} is not an n-gram size; use e.g. 3, or 0 to turn prompt lookup off.")
        if not size or not isinstance(self.schedule, DSparkHardwareAwareSchedule):
            return None
        lookup = DSparkPromptLookup(size, self.num_drafts)
        lookup.counts = self.drafter.dspark_lookup_counts.setdefault(self.bias_key, lookup.counts)
        return lookup

    def _resume_confidence_bias(self):
        """The hardware schedule's online confidence bias carries over between generate calls with the same decoding
        settings (see `DSparkHardwareAwareSchedule`): each call starts from what the previous ones learned."""
        if isinstance(self.schedule, DSparkHardwareAwareSchedule):
            self.schedule.bias = self.drafter.dspark_confidence_bias.get(self.bias_key, 0.0)

    def _commit_context(self, input_ids: torch.LongTensor, model_outputs: ModelOutput | None) -> bool:
        """Append every position before the anchor that the drafter has not seen yet (aux states of the last verify).

        Returns False, keeping the rows for later, when the back-off rests the drafter this round (a plain step)."""
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DSpark drafting needs the target's hidden states from the verify pass; none were returned.")
        waiting = sum(rows.shape[1] for rows in self._pending_aux)
        num_new = input_ids.shape[1] - 1 - self.cache.get_seq_length() - waiting
        aux = torch.cat([model_outputs.hidden_states[i][:, :num_new] for i in self.aux_layer_ids], dim=-1)
        if self.backoff is not None and self.backoff.should_skip():
            self._pending_aux.append(aux)
            return False
        if self._pending_aux:  # extend lazily, in one call, with the rounds the drafter skipped
            aux, self._pending_aux = torch.cat(self._pending_aux + [aux], dim=1), []
        self.drafter.extend_context(self.cache, aux.to(self.drafter.fc.weight.device))
        return True

    def _cut_at_stop(self, input_ids: torch.LongTensor, tokens: torch.LongTensor) -> torch.LongTensor:
        """Drafts up to the first on which a stopping criterion fires, and a round that ends on it if it is accepted.

        Whether draft n is proposed depends only on the tokens before it (lossless, as for EOS). transformers commits
        the accepted drafts plus a bonus token, cropped to `generation_config.max_length`, which it reads each round:
        lowering it for this round keeps the bonus from stepping past the stop (restored in
        `update_candidate_strategy`).
        """
        if self.stopping_criteria is None:
            return tokens
        for n in range(tokens.shape[1]):
            if bool(self.stopping_criteria(torch.cat([input_ids, tokens[:, : n + 1]], dim=-1), None).any()):
                self.generation_config.max_length = input_ids.shape[1] + n + 1
                return tokens[:, : n + 1]
        return tokens

    def _draft(self, input_ids: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Candidates (the sequence plus up to `budget` drafts) and, when sampling, the q they were drawn from."""
        device = self.drafter.fc.weight.device
        if isinstance(self.schedule, DSparkHardwareAwareSchedule):
            self.schedule.context_length = input_ids.shape[1]
        draft = self.drafter.draft_block(
            self.cache,
            input_ids[0, -1].to(device),
            num_drafts=budget,
            do_sample=self.do_sample,
            logits_processor=self.logits_processor,
            input_ids=input_ids.to(device),
            schedule=self.schedule,
        )
        tokens = self._cut_at_stop(input_ids, draft.token_ids.to(input_ids.device))
        self._last_drafted = tokens.shape[1]
        candidates = torch.cat([input_ids, tokens], dim=-1)
        return candidates, draft.target_logits[:, : tokens.shape[1]] if self.do_sample and self._last_drafted else None

    def _observe_round(self, drafter_ran: bool, first_round: bool, seconds: float):
        """Feed the back-off and the hardware schedule's running draft time (the first round's prompt-sized context
        extension is no measure of a round)."""
        if self.backoff is None or not drafter_ran:
            return
        self.backoff.record(self._last_drafted)
        if not first_round:
            self.schedule.observe_draft_time(seconds)

    def _prefer_lookup(self, input_ids, budget: int, drafter_ran: bool, candidates, candidate_logits):
        """Prompt-lookup drafts instead of the drafter's when they promise more tokens per second (both priced by the
        hardware schedule; the drafter's time this round is spent either way). When sampling their q is one-hot, so
        speculative sampling accepts a lookup draft x with probability p(x): still lossless."""
        tokens, ngram = self.lookup.propose(input_ids, budget)
        if not ngram:
            return candidates, candidate_logits
        self.schedule.context_length = input_ids.shape[1]
        k, rate = self.schedule.best_plan(self.lookup.survivals(ngram, tokens.shape[0]), drafter_ran)
        own = self.schedule.best_plan(self.schedule.admitted_survivals()[: self._last_drafted] if drafter_ran else [], drafter_ran)
        if k == 0 or rate <= own[1]:
            return candidates, candidate_logits
        self.generation_config.max_length = self.max_length  # undo a stop cut of the drafter's block
        tokens = self._cut_at_stop(input_ids, tokens[None, :k].to(input_ids.device))
        self._last_drafted, self._lookup_ngram = tokens.shape[1], ngram
        if not self.do_sample or not self._last_drafted:
            return torch.cat([input_ids, tokens], dim=-1), None
        one_hot = torch.full((1, tokens.shape[1], self.drafter.config.vocab_size), -math.inf, device=input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), one_hot.scatter_(-1, tokens[..., None], 0.0)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: ModelOutput | None = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        start = time.perf_counter()
        self._last_drafted = 0
        if is_first_iteration:
            self._verify_started = time.perf_counter()
            return input_ids, None
        first_round = self.cache.get_seq_length() == 0
        candidates, candidate_logits = input_ids, None
        self._lookup_ngram = 0
        drafter_runs = self._commit_context(input_ids, model_outputs)
        budget = min(self.num_drafts, self.max_length - input_ids.shape[1] - 1)
        if drafter_runs and budget > 0:
            candidates, candidate_logits = self._draft(input_ids, budget)
        self._observe_round(drafter_runs and budget > 0, first_round, time.perf_counter() - start)
        if self.lookup is not None and budget > 0:
            candidates, candidate_logits = self._prefer_lookup(input_ids, budget, drafter_runs, candidates, candidate_logits)
        self.stats.draft_time_s += time.perf_counter() - start
        self._verify_started = time.perf_counter()
        return candidates, candidate_logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.generation_config.max_length = self.max_length  # undo a stop's round cut (see `_cut_at_stop`)
        if self._verify_started is not None:
            elapsed = time.perf_counter() - self._verify_started
            self.stats.verify_time_s += elapsed
            if isinstance(self.schedule, DSparkHardwareAwareSchedule) and self._prefilled:
                self.schedule.observe_verify_time(self._last_drafted, input_ids.shape[1], elapsed)
        if self._prefilled:  # every verify round after the prefill, including rounds with no room left to draft
            self.stats.drafted.append(self._last_drafted)
            self.stats.accepted.append(int(num_matches))
            if self._lookup_ngram:
                self._learn_lookup(int(num_matches))
            else:
                self._learn_confidence_bias(int(num_matches))
        self._prefilled = True

    def _learn_lookup(self, num_accepted: int):
        self.lookup.observe(self._lookup_ngram, self._last_drafted, num_accepted)
        self.stats.lookup_rounds += 1
        self.stats.lookup_drafted += self._last_drafted
        self.stats.lookup_accepted += min(num_accepted, self._last_drafted)

    def _learn_confidence_bias(self, num_accepted: int):
        """Feed this round's verified drafts to the schedule's online bias, count them in the stats, and keep the
        bias on the drafter for the next call (see `_resume_confidence_bias`)."""
        if not isinstance(self.schedule, DSparkHardwareAwareSchedule) or not self._last_drafted:
            return
        predicted, observed, verified = self.schedule.observe_outcome(self._last_drafted, num_accepted)
        self.stats.confidence_predicted += predicted
        self.stats.confidence_observed += observed
        self.stats.confidence_verified += verified
        self.drafter.dspark_confidence_bias[self.bias_key] = self.schedule.bias


# ------------------------------------------------------------------------------------------------------------------
# Routing hook: installed once per process, whichever copy of this file (library or a checkpoint's remote code) is
# imported first; each wrapper dispatches on the assistant's own factory, so the assistant's copy builds its generator.

# The namespaced method the hooks look for on an assistant model (DSparkForDrafting defines it), and the attribute
# through which one generate call hands its stopping criteria to that factory.
DSPARK_FACTORY_ATTRIBUTE = "_dspark_candidate_generator_factory"
DSPARK_STOPPING_ATTRIBUTE = "_dspark_stopping_criteria"


def _route_candidate_generator(original: Callable) -> Callable:
    """DSpark assistants get their own generator; small-LM assistants, prompt lookup and `speculation_type="dflash"`
    take transformers' path untouched."""

    @functools.wraps(original)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        factory = getattr(assistant_model, DSPARK_FACTORY_ATTRIBUTE, None)
        if (
            factory is not None
            and generation_config.speculation_type != "dflash"
            and generation_config.prompt_lookup_num_tokens is None
            and generation_config.assistant_early_exit is None
        ):
            return factory(self, generation_config, input_ids, logits_processor, model_kwargs)  # bound to the assistant
        return original(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                        assistant_model=assistant_model, target_tokenizer=target_tokenizer,
                        assistant_tokenizer=assistant_tokenizer)

    return _get_candidate_generator


def _guard_generation_mode(original: Callable) -> Callable:
    """Our one-line errors come first: the modes a drafter cannot serve (transformers would silently ignore beam
    search) and a target it does not fit (transformers would advise passing tokenizers for another vocabulary)."""

    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant_model = generation_mode_kwargs.get("assistant_model")
        if getattr(assistant_model, DSPARK_FACTORY_ATTRIBUTE, None) is not None:
            _check_generation_limits(generation_config)
            check_target_compatibility(assistant_model.config, self)
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _share_stopping_criteria(original: Callable) -> Callable:
    """Hand the stopping criteria generate() built to a DSpark assistant for this call (`_get_candidate_generator`
    does not receive them), so that drafts never run past a stop string or a custom criterion."""

    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        assistant_model = kwargs.get("assistant_model")
        if getattr(assistant_model, DSPARK_FACTORY_ATTRIBUTE, None) is None:
            return original(self, *args, **kwargs)
        setattr(assistant_model, DSPARK_STOPPING_ATTRIBUTE, kwargs.get("stopping_criteria"))
        try:
            return original(self, *args, **kwargs)
        finally:
            setattr(assistant_model, DSPARK_STOPPING_ATTRIBUTE, None)

    return _assisted_decoding


DSPARK_HOOKS = {
    "_get_candidate_generator": _route_candidate_generator,
    "_validate_generation_mode": _guard_generation_mode,
    "_assisted_decoding": _share_stopping_criteria,
}


def install_dspark_routing():
    """Wrap each `GenerationMixin` method in DSPARK_HOOKS once, so DSpark assistants get their own generator.

    Idempotent across every copy of this module: each wrapper is marked, and a method already wrapped (by this or
    another copy) is left alone.
    """
    for name, wrap in DSPARK_HOOKS.items():
        original = getattr(GenerationMixin, name)
        if not getattr(original, "_dspark_routing", False):
            wrapper = wrap(original)
            wrapper._dspark_routing = True
            setattr(GenerationMixin, name, wrapper)


install_dspark_routing()

# `save_pretrained`/`push_to_hub` write `auto_map` and copy both remote-code files next to the weights.
DSparkConfig.register_for_auto_class()
DSparkForDrafting.register_for_auto_class("AutoModel")


__all__ = [
    "DSparkCandidateGenerator",
    "DSparkContextCache",
    "DSparkDraftOutput",
    "DSparkDraftSchedule",
    "DSparkForDrafting",
    "DSparkDrafterBackoff",
    "DSparkGenerationStats",
    "DSparkHardwareAwareSchedule",
    "DSparkPreTrainedModel",
    "DSparkThresholdSchedule",
    "DSparkTrainingOutput",
    "DSparkVerifyCostSchedule",
    "draft_schedule",
    "DSparkVerifyProfile",
    "expected_tensor_shapes",
    "install_dspark_routing",
    "load_or_measure_verify_profile",
    "measure_verify_profile",
]
