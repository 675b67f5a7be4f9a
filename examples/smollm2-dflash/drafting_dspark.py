# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""The DSpark drafter as users load it: `AutoModel.from_pretrained(..., trust_remote_code=True)` names this class
(`auto_map`), and `target.generate(**inputs, assistant_model=drafter)` reaches it through the routing hooks.

Remote-code file (imports only torch and transformers), the top of the remote code's imports, which run one way,
one concern per file: the drivers (`generation_dspark`, one row inside transformers' assisted loop, which
`routing_dspark` hands it; `batching_dspark`, a batch, with `batch_rows_dspark` and `packing_dspark`) → the engine
(`scheduling_dspark`: draft schedules, back-off, prompt lookup; `settings_dspark`: drafting settings and the state
kept between calls; `live_profiling_dspark` → `profiling_dspark`: what rounds cost; `token_choice_dspark`: how a
draft is chosen) → the model (`modeling_dspark`: the network and its one drafting loop; `heads_dspark`,
`context_cache_dspark`, `configuration_dspark`). The drivers reach the drafting loop only through the drafter.
What a drafter keeps between generate calls is one object apart from the module (`drafting_state`,
`settings_dspark.DSparkDraftingState`); its drafting settings are its `generation_config`.

Reading order: the class → target binding and checkpoints (the settings travel in `generation_config.json`) → one
block for one row (`draft_block`) → the methods the routing hooks call (names frozen: older checkpoints' hooks
look for them) → registration.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList

from .batching_dspark import DSparkBatchGeneration, check_batch_limits
from .configuration_dspark import DSparkConfig, adopt_special_tokens, check_target_compatibility
from .context_cache_dspark import DSparkContextCache
from .generation_dspark import DSparkCandidateGenerator, DSparkGenerationStats
from .modeling_dspark import DSparkDraftModel, DSparkDraftOutput, check_checkpoint_shapes
from .routing_dspark import DSPARK_STOPPING_ATTRIBUTE, install_dspark_routing
from .scheduling_dspark import DSparkDraftSchedule
from .settings_dspark import DSparkDraftingState, default_drafting_config, with_default_drafting
from .token_choice_dspark import DSparkTokenChooser, sampling_warpers


class DSparkForDrafting(DSparkDraftModel):
    """A DSpark drafter: the network (`DSparkDraftModel`, whose docstring lists the checkpoint's tensors), its
    drafting settings (`generation_config`: `num_assistant_tokens`, `dspark_*`; by default the hardware schedule with
    prompt lookup, read through `DSparkDraftingSettings`) and what it learns from one generate call to the next
    (`drafting_state`)."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.generation_config = default_drafting_config(config.num_draft_tokens)
        self.drafting_state = DSparkDraftingState()

    # --------------------------------------------------------------------------------------------------------------
    # Target binding and checkpoints

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
        self.drafting_state.bound_target = target.config.name_or_path

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
            loaded = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
            model.generation_config = with_default_drafting(loaded)  # what the file sets, defaults for the rest
        except OSError:  # no generation_config.json: keep the defaults
            pass
        return model

    @torch.no_grad()
    def draft_block(self, cache: DSparkContextCache, anchor_id: torch.LongTensor | int, num_drafts: int | None = None,
                    do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    logits_processor: LogitsProcessorList | None = None, input_ids: torch.LongTensor | None = None,
                    confidence_threshold: float | None = None, verify_cost: float | None = None,
                    generator: torch.Generator | None = None,
                    schedule: DSparkDraftSchedule | None = None) -> DSparkDraftOutput:
        """Draft one block for one row after the cached context (`draft` for a batch of one).

        Sampling draws each x_n from q_n = softmax(processed(U_n + bias(prev))), scattered to the target vocab; the
        processed target-vocab logits are returned so rejection sampling uses exactly that q. A `schedule` may end
        the block early from the calibrated confidences; `confidence_threshold` / `verify_cost` build the threshold
        and verify-cost schedules (see `DSparkDraftSchedule`).
        """
        anchor = torch.as_tensor(anchor_id, device=self.fc.weight.device).reshape(1)
        if logits_processor is None and do_sample:
            logits_processor = sampling_warpers(temperature, top_k, top_p)
        sequence = input_ids if input_ids is not None else anchor.reshape(1, 1)
        chooser = DSparkTokenChooser(self.draft_to_target_ids, self.config.vocab_size, do_sample, logits_processor,
                                     sequence, generator)
        schedule = schedule if schedule is not None else DSparkDraftSchedule(confidence_threshold, verify_cost)
        return self.draft(cache, anchor, self.num_draft_tokens if num_drafts is None else num_drafts, chooser, schedule)

    # --------------------------------------------------------------------------------------------------------------
    # transformers integration: the routing hooks (`routing_dspark.py`) call this, bound to the drafter, to serve
    # `target.generate(..., assistant_model=drafter)`; its name is DSPARK_FACTORY_ATTRIBUTE.

    def _dspark_candidate_generator_for_call(self, target: PreTrainedModel, generation_config: GenerationConfig,
                                             input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                                             model_kwargs: dict[str, Any], stopping_criteria=None) -> DSparkCandidateGenerator:
        """The generator of one call, handed that call's stopping criteria (DSPARK_CALL_FACTORY_ATTRIBUTE)."""
        return DSparkCandidateGenerator(self, target, input_ids, generation_config, logits_processor, model_kwargs,
                                        stopping_criteria)

    def _dspark_candidate_generator_factory(self, target, generation_config, input_ids, logits_processor, model_kwargs):
        """The same for older hooks (an older checkpoint's code imported first), which set the criteria on the drafter
        for the call (DSPARK_FACTORY_ATTRIBUTE)."""
        return self._dspark_candidate_generator_for_call(target, generation_config, input_ids, logits_processor,
                                                         model_kwargs, getattr(self, DSPARK_STOPPING_ATTRIBUTE, None))

    def _dspark_batched_decoding(self, target: PreTrainedModel, input_ids: torch.LongTensor, logits_processor,
                                 stopping_criteria, generation_config: GenerationConfig, streamer=None, **model_kwargs):
        """`target.generate(..., assistant_model=drafter)` on a batch of more than one row (the routing hook calls
        this, bound to the drafter; its name is DSPARK_BATCH_ATTRIBUTE): the package's batched loop."""
        check_batch_limits(target, generation_config, model_kwargs.get("attention_mask"), streamer)
        generation = DSparkBatchGeneration(self, target, generation_config, logits_processor, stopping_criteria, model_kwargs)
        return generation.generate(input_ids)

    def attach_to(self, target: PreTrainedModel):
        """Check that this drafter fits the target, copy the target's embeddings where the checkpoint omits them, and
        its special token ids where an older checkpoint has none (`pipeline` compares them)."""
        if self.config.bind_target_embeddings and self.drafting_state.bound_target != target.config.name_or_path:
            self.bind_target(target)  # checks the target first
        else:
            check_target_compatibility(self.config, target)
        adopt_special_tokens(self.config, target)

    @property
    def last_generation_stats(self) -> DSparkGenerationStats | None:
        """What the last `generate` call with this drafter did (rounds, drafts, acceptance, times)."""
        return self.drafting_state.last_stats


install_dspark_routing()

# `save_pretrained`/`push_to_hub` write `auto_map` and copy the remote-code files next to the weights (every file
# imported from these two, transitively).
DSparkConfig.register_for_auto_class()
DSparkForDrafting.register_for_auto_class("AutoModel")


__all__ = ["DSparkContextCache", "DSparkDraftOutput", "DSparkForDrafting"]
