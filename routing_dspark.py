# Copyright 2026 The dspark-hf authors. Licensed under the Apache License, Version 2.0.
"""How `target.generate(**inputs, assistant_model=drafter)` reaches the DSpark candidate generator.

Remote-code file (imports only torch and transformers). transformers builds an assistant's candidate generator in
private `GenerationMixin` methods; three small wrappers around them hand a DSpark assistant its own generator, check
first what it cannot serve, and pass it the call's stopping criteria. `install_dspark_routing` wraps them once per
process, whichever copy of this file (the library's or a checkpoint's remote code) is imported first; each wrapper
dispatches on the assistant's own factory method, so the assistant's copy of the code builds its generator.

transformers builds the candidate generator inside `_assisted_decoding` without handing it the stopping criteria, so
the `_assisted_decoding` wrapper holds them in a context variable for the `_get_candidate_generator` wrapper of the same
call: each thread (and each asyncio task) sees only its own call's, so concurrent calls on one drafter cannot mix.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

from transformers.generation import GenerationMixin

from .configuration_dspark import check_target_compatibility
from .generation_dspark import check_generation_limits

# The namespaced methods the hooks look for on an assistant model (DSparkForDrafting defines them). These names are a
# protocol between copies of this code: the hooks of whichever copy a process imports first serve the drafters of
# every copy (older checkpoints' included), so none may change. Older drafters have only the factory, and read the
# call's stopping criteria from the attribute DSPARK_STOPPING_ATTRIBUTE that older hooks set on them for the call;
# newer ones are handed the criteria by `DSPARK_CALL_FACTORY_ATTRIBUTE`, and the attribute is set only for older ones.
DSPARK_FACTORY_ATTRIBUTE = "_dspark_candidate_generator_factory"
DSPARK_CALL_FACTORY_ATTRIBUTE = "_dspark_candidate_generator_for_call"  # (..., stopping_criteria) -> generator
DSPARK_STOPPING_ATTRIBUTE = "_dspark_stopping_criteria"
DSPARK_BATCH_ATTRIBUTE = "_dspark_batched_decoding"  # the drafter's own loop for a batch of more than one row

# This call's stopping criteria, from the `_assisted_decoding` wrapper to the `_get_candidate_generator` wrapper.
_call_stopping_criteria: contextvars.ContextVar = contextvars.ContextVar("dspark_stopping_criteria", default=None)


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
            for_call = getattr(assistant_model, DSPARK_CALL_FACTORY_ATTRIBUTE, None)  # both bound to the assistant
            if for_call is not None:
                return for_call(self, generation_config, input_ids, logits_processor, model_kwargs,
                                stopping_criteria=_call_stopping_criteria.get())
            return factory(self, generation_config, input_ids, logits_processor, model_kwargs)
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
            check_generation_limits(generation_config)
            check_target_compatibility(assistant_model.config, self)
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _route_assisted_decoding(original: Callable) -> Callable:
    """A batch of more than one row goes to the DSpark assistant's own batched loop (transformers' assisted loop
    serves one row); one row keeps transformers' loop, with the stopping criteria generate() built held for this call
    (`_get_candidate_generator` does not receive them), so that drafts never run past a stop string or a custom
    criterion."""

    @functools.wraps(original)
    def _assisted_decoding(self, input_ids, *args, **kwargs):
        assistant_model = kwargs.get("assistant_model")
        if getattr(assistant_model, DSPARK_FACTORY_ATTRIBUTE, None) is None:
            return original(self, input_ids, *args, **kwargs)
        if input_ids.shape[0] > 1 and hasattr(assistant_model, DSPARK_BATCH_ATTRIBUTE):
            return getattr(assistant_model, DSPARK_BATCH_ATTRIBUTE)(self, input_ids, *args, **kwargs)
        criteria = kwargs.get("stopping_criteria")
        older = not hasattr(assistant_model, DSPARK_CALL_FACTORY_ATTRIBUTE)  # reads the criteria from the attribute
        token = _call_stopping_criteria.set(criteria)
        if older:
            setattr(assistant_model, DSPARK_STOPPING_ATTRIBUTE, criteria)
        try:
            return original(self, input_ids, *args, **kwargs)
        finally:
            _call_stopping_criteria.reset(token)
            if older:
                setattr(assistant_model, DSPARK_STOPPING_ATTRIBUTE, None)

    return _assisted_decoding


DSPARK_HOOKS = {
    "_get_candidate_generator": _route_candidate_generator,
    "_validate_generation_mode": _guard_generation_mode,
    "_assisted_decoding": _route_assisted_decoding,
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


__all__ = ["DSPARK_BATCH_ATTRIBUTE", "DSPARK_CALL_FACTORY_ATTRIBUTE", "DSPARK_FACTORY_ATTRIBUTE", "DSPARK_HOOKS",
           "DSPARK_STOPPING_ATTRIBUTE", "install_dspark_routing"]
