# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""The DSpark heads on top of the drafter's rows: the Markov logit-bias head (the sequential stage that makes a block
semi-autoregressive) and the confidence head (the probability that a draft survives verification).

Remote-code file (imports only torch and transformers); `modeling_dspark.py` builds them. Reading order: the vanilla
Markov head (and its bias rows kept per previous token) → the gated and RNN variants → the confidence head.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

from .configuration_dspark import DSparkConfig

# Markov head: the sequential stage. logits_n = U_n + bias_n, where bias_n depends on the previous token only (and,
# for gated/rnn, on the draft's own hidden row and a recurrent state), never on the token being drafted.


class DSparkVanillaMarkovHead(nn.Module):
    """bias = W2 · W1[prev]: a function of the previous token alone, so inference reuses the rows of recent tokens."""

    bias_depends_on_token_only = True
    bias_cache_bytes = 32 * 2**20  # each row costs a read of all of W2 (V_d·r) to compute, and V_d values to keep

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_rank = config.markov_rank
        rows = config.vocab_size if config.markov_input_vocab == "target" else config.draft_vocab_size + 1
        self.markov_w1 = nn.Embedding(rows, config.markov_rank)  # "draft": the last row serves every other token
        self.markov_w2 = nn.Linear(config.markov_rank, config.draft_vocab_size, bias=False)
        self._bias_rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # previous token id -> bias (V_d,), LRU
        self._bias_rows_stamp: tuple | None = None

    def embed_previous(self, prev_rows: torch.LongTensor) -> torch.Tensor:
        """W1 rows (..., r) of the previous tokens: their target ids, or their draft rows (`DSparkDraftModel.markov_rows`)."""
        return self.markov_w1(prev_rows)

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
        self, hidden_states: torch.Tensor, prev_ids: torch.LongTensor, prev_embeds: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`step` for one position of drafting, rows (b,). When the bias depends on the previous token alone, a token
        seen recently gets the very row computed then; the rows are dropped whenever W1 or W2 change."""
        stamp = self._weights_stamp() if self.bias_depends_on_token_only else None
        if stamp is None:
            return self.step(hidden_states, prev_embeds, state)
        if stamp != self._bias_rows_stamp:
            self._bias_rows.clear()
            self._bias_rows_stamp = stamp
        ids = prev_ids.tolist()
        missing = [i for i, token in enumerate(ids) if token not in self._bias_rows]
        if missing:
            index = torch.tensor(missing, device=prev_embeds.device)
            for i, row in zip(missing, self.step(hidden_states[index], prev_embeds[index], state)[0]):
                self._bias_rows[ids[i]] = row
        rows = []
        for token in ids:
            self._bias_rows.move_to_end(token)
            rows.append(self._bias_rows[token])
        while len(self._bias_rows) * rows[0].numel() * rows[0].element_size() > self.bias_cache_bytes:
            self._bias_rows.popitem(last=False)
        return torch.stack(rows), state

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


__all__ = ["DSparkConfidenceHead", "DSparkGatedMarkovHead", "DSparkRNNMarkovHead", "DSparkVanillaMarkovHead", "MARKOV_HEAD_CLASSES"]
