# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""DSpark drafter network: a DFlash-style parallel block drafter with a Markov logit-bias head and a confidence head.

Remote-code file: copied next to every checkpoint, imports only torch and transformers (siblings as `from .x`), and
of its siblings only the model's own parts (config, heads, context cache): the engine and the drivers import this
file, never the other way round.

The draft layers are Qwen3's (as `transformer_layer_config` declares): its RMSNorm, MLP, RoPE, eager attention and
`rotate_half` are imported from transformers. Reading order (as in `modeling_llama.py`): rotary → attention with KV
injection → draft layer → model outputs → checkpoint checks → PreTrainedModel → DSparkDraftModel (training forward;
the drafting primitives, one loop for one row or many: `block_rows`, `draft`). `drafting_dspark` builds the class
users load on it, and its docstring maps the rest of the remote code.

Notation: d hidden size, m aux layers, B block size, N drafts per block (B-1, or B with `sample_from_anchor`),
V_t target vocab, V_d draft vocab, r Markov rank. Draft n (1..N) always predicts the token at position p+n, where
p is the anchor's position; its hidden row is slot n (DFlash/Kimi convention) or slot n-1 (`sample_from_anchor`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import ModelOutput

from .configuration_dspark import DSparkConfig
from .context_cache_dspark import DSparkContextCache
from .heads_dspark import MARKOV_HEAD_CLASSES, DSparkConfidenceHead, DSparkVanillaMarkovHead

# A block of at most this many (row, position) pairs runs the LM head over every position at once (see `_base_logits`):
# on the CPUs measured, one pass over 64 rows costs what two or three passes over 8 rows cost, bf16 or fp32.
LM_HEAD_AT_ONCE = 64


class DSparkRotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's RoPE with the drafter's own theta/scaling; context keys and block rows use their own positions."""

    def _apply(self, fn, recurse=True):
        # Casting the model to bf16 must not round the frequencies: keep them fp32, only follow the device.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (b, heads, t, hd) by cos/sin (b, t, hd). Queries and keys differ in length here, so one at a time."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


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
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, hidden_states: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                               eager_attention_forward)
        attn_output, _ = attention_interface(self, query, keys, values, attention_mask, is_causal=False, scaling=self.scaling,
                                             dropout=0.0 if not self.training else self.attention_dropout)
        return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))


class DSparkDecoderLayer(nn.Module):
    """Qwen3-style layer; the only new thing is that attention also reads the injected context K/V."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                context_kv: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, context_kv, attention_mask,
                                       cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


# ------------------------------------------------------------------------------------------------------------------
# Model outputs


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
        return {name: tuple(t.shape) for name, t in DSparkDraftModel(config).state_dict().items()}


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
        super()._init_weights(module)  # linear, embedding and norm weights, RoPE frequencies
        if isinstance(module, DSparkVanillaMarkovHead):
            nn.init.normal_(module.markov_w1.weight, mean=0.0, std=0.01)
        if isinstance(module, DSparkDraftModel):
            # Identity draft vocabulary until `set_draft_vocab` installs a real one.
            module.d2t.zero_()
            module.t2d.zero_()
            module.t2d[: self.config.draft_vocab_size] = True


class DSparkDraftModel(DSparkPreTrainedModel):
    """The DSpark drafter's network and its drafting primitives (`DSparkForDrafting` in `drafting_dspark` is the
    class users load).

    Tensors (names are the checkpoint format): `layers.{i}.*`, `fc`, `hidden_norm`, `norm`, `embed_tokens` (frozen copy
    of the target's input embeddings, [V_t, d]), `lm_head` (frozen target LM-head rows where `t2d`, [V_d, d]), `d2t`,
    `t2d`, `markov_head.*`, `confidence_head.*`.

    `embed_tokens` and `lm_head` may be absent from a checkpoint (`config.bind_target_embeddings`): they are then bound
    from the target (`DSparkForDrafting.bind_target`), which the candidate generator does on first use.
    """

    _keys_to_ignore_on_load_missing = [r"^embed_tokens\.weight$", r"^lm_head\.weight$"]

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        num_aux = len(config.aux_hidden_state_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DSparkRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.markov_head = MARKOV_HEAD_CLASSES[config.markov_head_type](config) if config.markov_rank > 0 else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        self.d2t = nn.Buffer(torch.zeros(config.draft_vocab_size, dtype=torch.long))  # draft id j -> target j + d2t[j]
        self.t2d = nn.Buffer(torch.zeros(config.vocab_size, dtype=torch.bool))  # target id in draft vocab?
        self.post_init()
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    # --------------------------------------------------------------------------------------------------------------
    # Vocabulary

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

    def markov_rows(self, token_ids: torch.LongTensor) -> torch.LongTensor:
        """Rows of the Markov input table W1 for target ids: the ids (`markov_input_vocab="target"`), or their draft ids
        and V_d for every token outside the draft vocabulary (`"draft"`; draft ids ascend, so a binary search finds them)."""
        if self.config.markov_input_vocab == "target":
            return token_ids
        draft_ids = torch.searchsorted(self.draft_to_target_ids, token_ids)
        return torch.where(self.t2d[token_ids], draft_ids, self.d2t.numel())

    def _previous_embeds(self, prev_ids: torch.LongTensor) -> torch.Tensor:
        return self.markov_head.embed_previous(self.markov_rows(prev_ids))

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
        if attention_mask is not None and self.config._attn_implementation == "eager":  # eager adds its mask
            blocked = torch.full(attention_mask.shape, torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=hidden.device)
            attention_mask = blocked.masked_fill_(attention_mask, 0.0)
        for layer, layer_context_kv in zip(self.layers, context_kv):
            hidden = layer(hidden, rope, layer_context_kv, attention_mask, cache)
        return self.norm(hidden)

    def _markov_start_state(self, block_hidden: torch.Tensor, anchor_ids: torch.LongTensor) -> torch.Tensor | None:
        """Markov state before draft 1 from the block rows (..., B, d): slot 0 steps it unless it drafts itself."""
        if self.markov_head is None or self.config.sample_from_anchor:
            return None
        return self.markov_head.anchor_state(block_hidden[..., 0, :], self._previous_embeds(anchor_ids))

    def _markov_and_confidence(self, draft_hidden: torch.Tensor, prev_ids: torch.LongTensor,
                               state: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Teacher-forced Markov bias (..., N, V_d) and confidence logits (..., N) given each draft's previous token."""
        prev_embeds = self._previous_embeds(prev_ids) if self.markov_head is not None else None
        bias = self.markov_head.block_bias(draft_hidden, prev_embeds, state) if self.markov_head is not None else None
        confidence = self.confidence_head(draft_hidden, prev_embeds) if self.confidence_head is not None else None
        return bias, confidence

    # --------------------------------------------------------------------------------------------------------------
    # Training forward: many (anchor, block) pairs of one sequence per batch row, with the exact inference mask.

    def _block_attention_mask(self, anchor_positions: torch.LongTensor, num_context: int,
                              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
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
        logits = base_logits + bias if bias is not None else base_logits
        return DSparkTrainingOutput(logits=logits, base_logits=base_logits, confidence_logits=confidence_logits,
                                    label_positions=label_positions, hidden_states=draft_hidden)

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
    def extend_context(self, cache: DSparkContextCache, aux_hidden_states: torch.Tensor,
                       positions: torch.LongTensor | None = None) -> DSparkContextCache:
        """Append committed positions (b, n, m·d) to the context cache; their K/V are computed exactly once. Their
        positions (b, n) default to the next columns in order (a batch with padding passes each row's own)."""
        context = self.fuse_context(aux_hidden_states)
        if positions is None:
            start = cache.get_seq_length()
            positions = torch.arange(start, start + context.shape[1], device=context.device).expand(context.shape[0], -1)
        for i, layer_kv in enumerate(self._context_kv(context, positions)):
            cache.update(i, *layer_kv)
        return cache

    @torch.no_grad()
    def block_rows(
        self,
        cache: DSparkContextCache,
        anchor_ids: torch.LongTensor,  # (b,) each row's anchor
        positions: torch.LongTensor | None = None,  # (b,) each anchor's position; default: the cache's length
        context_mask: torch.Tensor | None = None,  # (b, t) bool: the cache columns that are each row's context
    ) -> torch.Tensor:
        """The one parallel pass: row b's block, at its anchor's position, sees its own context columns (every one
        without a mask) and its own block rows -> normalized block rows (b, B, d)."""
        hidden = self._block_embeddings(anchor_ids)  # (b, B, d)
        B = self.config.block_size
        if positions is None:
            positions = torch.full_like(anchor_ids, cache.get_seq_length())
        block_positions = positions[:, None] + torch.arange(B, device=positions.device)  # (b, B)
        sees = None
        if context_mask is not None:
            b, t = context_mask.shape
            sees = torch.cat([context_mask[:, None, None, :].expand(b, 1, B, t), context_mask.new_ones(b, 1, B, B)], -1)
        return self._run_block(hidden, block_positions, cache, sees)

    @torch.no_grad()
    def block_hidden_states(self, cache: DSparkContextCache, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """Normalized draft rows (b, N, d) of the parallel pass."""
        return self._draft_rows(self.block_rows(cache, anchor_ids))

    def _calibrated_confidence(self, hidden: torch.Tensor, prev_embeds: torch.Tensor | None, n: int) -> torch.Tensor:
        """c_n = σ(confidence logit / T_n) (b,), with draft n's calibrated temperature T_n."""
        logit = self.confidence_head(hidden, prev_embeds).float()
        return torch.sigmoid(logit / self.config.confidence_temperatures[n])

    def _base_logits(self, draft_hidden: torch.Tensor, n: int, block_logits: torch.Tensor | None):
        """U_n (b, V_d) and the block's logits where they were computed at once. A block of few rows runs the LM head
        once over every position (reading its V_d × d weight costs more than the products); more rows run it position
        by position, for what is drafted only."""
        if draft_hidden.shape[0] * draft_hidden.shape[1] > LM_HEAD_AT_ONCE:
            return self.lm_head(draft_hidden[:, n]).float(), None
        if block_logits is None:
            block_logits = self.lm_head(draft_hidden).float()
        return block_logits[:, n], block_logits

    @torch.no_grad()
    def draft(self, cache: DSparkContextCache, anchor_ids: torch.LongTensor, num_drafts: int, chooser, schedule,
              positions: torch.LongTensor | None = None, context_mask: torch.Tensor | None = None) -> DSparkDraftOutput:
        """One block per row (`anchor_ids` (b,), `positions` and `context_mask` as for `block_rows`): the parallel pass,
        then the sequential stage, draft n = choice(U_n + bias(x_{n-1})) by the `chooser` (`DSparkTokenChooser`), while
        the `schedule` admits position n from the rows' c_{·,n}. c_n needs only W1[prev], so the schedule decides
        before the V_d-wide products (LM head, Markov bias) run; a round that drafts nothing skips them."""
        block_hidden = self.block_rows(cache, anchor_ids, positions, context_mask)
        draft_hidden = self._draft_rows(block_hidden)[:, : min(num_drafts, self.num_draft_tokens)]  # (b, n, d)
        state = self._markov_start_state(block_hidden, anchor_ids)
        tokens, draft_logits, scores, confidences, block_logits = [], [], [], [], None
        prev = anchor_ids
        schedule.start()
        for n in range(draft_hidden.shape[1]):
            prev_embeds = self._previous_embeds(prev) if self.markov_head is not None else None
            if self.confidence_head is not None:
                confidence = self._calibrated_confidence(draft_hidden[:, n], prev_embeds, n)  # (b,)
                if not schedule.admit(confidence):
                    break
                confidences.append(confidence)
            logits, block_logits = self._base_logits(draft_hidden, n, block_logits)
            if self.markov_head is not None:
                bias, state = self.markov_head.token_step(draft_hidden[:, n], prev, prev_embeds, state)
                logits = logits + bias.float()
            prev, score = chooser.choose(logits)
            tokens.append(prev)
            draft_logits.append(logits)
            scores.append(score)
        return self._draft_output(tokens, draft_logits, scores, confidences, schedule.finish(len(tokens)), chooser, anchor_ids)

    def _draft_output(self, tokens, draft_logits, scores, confidences, keep: int, chooser, anchor_ids) -> DSparkDraftOutput:
        """The first `keep` drafts of every row, stacked."""
        tokens, draft_logits, scores, confidences = tokens[:keep], draft_logits[:keep], scores[:keep], confidences[:keep]
        confidences = torch.stack(confidences, dim=1) if confidences else None  # (b, n)
        return DSparkDraftOutput(
            token_ids=torch.stack(tokens, dim=1) if tokens else anchor_ids.new_zeros((anchor_ids.shape[0], 0)),
            draft_logits=torch.stack(draft_logits, dim=1) if draft_logits else None,
            target_logits=chooser.target_scores(torch.stack(scores, dim=1)) if scores and scores[0] is not None else None,
            confidences=confidences,
            survival=torch.cumprod(confidences.double(), dim=-1).to(confidences.dtype) if confidences is not None else None,
        )

    def new_context_cache(self) -> DSparkContextCache:
        """An empty context cache for one generation (the candidate generator's)."""
        return DSparkContextCache()


__all__ = ["DSparkContextCache", "DSparkDraftModel", "DSparkDraftOutput", "DSparkPreTrainedModel",
           "DSparkTrainingOutput", "check_checkpoint_shapes", "expected_tensor_shapes"]
