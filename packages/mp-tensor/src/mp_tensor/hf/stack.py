"""smp's whole-stack replacement: a Hugging Face ``GPT2LMHeadModel`` becomes a
:class:`~mp_tensor.nn.lm_head.DistributedTransformerLMHead`, at any tensor-parallel degree including 1.

smp swapped the whole GPT-2 model for its ``DistributedTransformerLMHead`` under tensor parallelism, and
its public scripts rely on that: ``model.transformer.seq_layers`` (the layers, to partition or to
checkpoint), the state dict in that module's layout (``smp.nn.huggingface.gpt2``'s translations). The
replacement here is :class:`GPT2DistributedLMHead`, a ``DistributedTransformerLMHead`` that keeps Hugging
Face's calling convention (``input_ids``, ``attention_mask``, ``position_ids``, ``labels`` -> an output
with ``.loss`` and ``.logits``), so training scripts and the Trainer keep working. Its gathered state dict
is translated back to Hugging Face's names (``mp_tensor.hf.translate``), so a full save loads into
``GPT2LMHeadModel``.

``smp.tensor_parallelism(whole_stack=False)`` (or ``smp.model_creation(..., whole_stack=False)``) keeps
the model and distributes its blocks one by one instead (mp's option; smp had none), and then nothing is
replaced at tp=1.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.enable import mark_of
from mp_tensor.errors import TPInputError
from mp_tensor.hf import gpt2
from mp_tensor.hf.translate import gpt2_from_smp, gpt2_lm_head_kwargs, gpt2_to_smp
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.lm_head import DistributedTransformerLMHead, split_lm_inputs
from mp_tensor.registry import Registration, Registry

__all__ = [
    "ENCODERS",
    "GPTJ_MODEL",
    "GPTNEOX_MODEL",
    "GPTNEO_MODEL",
    "MODEL",
    "WHOLE_STACK_MODELS",
    "GPT2DistributedLMHead",
    "HFDistributedLMHead",
    "registrations",
    "whole_stack_registry",
    "whole_stack_requested",
]

log = logging.getLogger(__name__)

MODEL = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"

# Calling options of GPT2LMHeadModel that have one meaning here: accepted at these values only.
_DEFAULTS: dict[str, Any] = {
    "past_key_values": None,
    "head_mask": None,
    "output_attentions": None,
    "output_hidden_states": None,
    "num_items_in_batch": None,
}


def whole_stack_requested(module: nn.Module) -> bool:
    """False when the module's tensor-parallelism mark asks for ``whole_stack=False``."""
    mark = mark_of(module)
    return mark is None or bool(mark.kwargs.get("whole_stack", True))


def check(module: nn.Module, tp_size: int) -> str | None:
    """Why this ``GPT2LMHeadModel`` cannot become a DistributedTransformerLMHead, or None."""
    if not whole_stack_requested(module):
        return "whole_stack=False was asked for (its blocks are distributed one by one instead)"
    model = cast(Any, module)
    config = model.config
    if not getattr(config, "tie_word_embeddings", True):
        return "tie_word_embeddings=False: the DistributedTransformerLMHead's LM head is the word embedding"
    if getattr(config, "reorder_and_upcast_attn", False):
        return "reorder_and_upcast_attn=True is not mapped"
    blocks = list(model.transformer.h)
    if not blocks:
        return "the model has no blocks"
    return gpt2.check(blocks[0], tp_size)


class HFDistributedLMHead(DistributedTransformerLMHead):
    """A ``DistributedTransformerLMHead`` standing in for a Hugging Face causal LM (see the module
    docstring): called with the model's arguments, returning its output type; ``config`` is the
    original model's. Subclasses name the family and build the LM head's arguments from the config."""

    main_input_name = "input_ids"
    accepts_loss_kwargs = False  # the Trainer passes no num_items_in_batch: the loss is a mean
    family = "GPT-2"
    output_class = "CausalLMOutputWithCrossAttentions"

    def __init__(self, config: Any, kwargs: Mapping[str, Any], *, tp: TPContext | None = None) -> None:
        kwargs = dict(kwargs)
        kwargs.pop("whole_stack", None)
        super().__init__(tp=tp, **kwargs)
        self.__dict__["config"] = config  # not a module: kept out of the state dict and of .children()

    def hf_forward(  # noqa: PLR0917
        self,
        input_ids: Tensor | None,
        cache: Any,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        inputs_embeds: Tensor | None,
        labels: Tensor | None,
        logits_to_keep: int | Tensor,
        return_dict: bool | None,
        kwargs: Mapping[str, Any],
        encoder_hidden_states: Tensor | None = None,
    ) -> Any:
        """The Hugging Face call, served by the LM head."""
        who = f"the distributed {self.family} (smp's DistributedTransformerLMHead)"
        _refuse(
            who,
            input_ids,
            cache,
            token_type_ids,
            inputs_embeds,
            encoder_hidden_states,
            logits_to_keep,
            kwargs,
        )
        assert input_ids is not None
        # Hugging Face's mask marks the positions to attend with 1; smp's marks the masked ones.
        masked = None if attention_mask is None else (attention_mask == 0).to(torch.long)
        if labels is not None and labels.shape[0] != input_ids.shape[0]:
            raise TPInputError(
                f"the distributed language model got labels for {labels.shape[0]} samples and input_ids "
                f"for {input_ids.shape[0]}; pass labels of the same batch."
            )
        # Hugging Face's causal LM loss: next-token cross entropy in fp32, -100 ignored, mean over tokens
        # (with prescaled_batch and labels, ``logits`` are this TP rank's share of the samples: see _head)
        f = split_lm_inputs((input_ids, masked, None, position_ids, None), cross=False)
        loss, logits = self.lm_forward(f, labels, shift=True)
        if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
            return (logits,) if loss is None else (loss, logits)
        from transformers import modeling_outputs

        return getattr(modeling_outputs, self.output_class)(loss=loss, logits=logits)


class GPT2DistributedLMHead(HFDistributedLMHead):
    """A ``DistributedTransformerLMHead`` standing in for a Hugging Face ``GPT2LMHeadModel``."""

    def __init__(self, config: Any, *, tp: TPContext | None = None, **overrides: Any) -> None:
        super().__init__(config, {**gpt2_lm_head_kwargs(config), **overrides}, tp=tp)

    def forward(  # type: ignore[override]  # noqa: PLR0917
        self,
        input_ids: Tensor | None = None,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """``GPT2LMHeadModel.forward``'s arguments; returns ``CausalLMOutputWithCrossAttentions``."""
        return self.hf_forward(
            input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds, labels,
            logits_to_keep, return_dict, kwargs, encoder_hidden_states,
        )  # fmt: skip


def _refuse(  # noqa: PLR0917
    who: str,
    input_ids: Tensor | None,
    cache: Any,
    token_type_ids: Tensor | None,
    inputs_embeds: Tensor | None,
    encoder_hidden_states: Tensor | None,
    logits_to_keep: int | Tensor,
    kwargs: Mapping[str, Any],
) -> None:
    """The calls the distributed model cannot serve, refused by name."""
    if input_ids is None or inputs_embeds is not None:
        raise TPInputError(
            f"{who} got input_ids=None (inputs_embeds given: {inputs_embeds is not None}); it embeds token "
            "ids itself. Pass input_ids."
        )
    length = getattr(cache if cache is not None else kwargs.get("past_key_values"), "get_seq_length", None)
    if callable(length) and length() > 0:
        raise TPInputError(
            f"{who} got a non-empty key/value cache; incremental decoding is not supported. Call it with "
            "use_cache=False, or build the model with whole_stack=False."
        )
    if token_type_ids is not None:
        raise TPInputError(f"{who} got token_type_ids; token types are not mapped. Pass None.")
    if encoder_hidden_states is not None:
        raise TPInputError(f"{who} got encoder_hidden_states; cross attention is not mapped. Pass None.")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise TPInputError(f"{who} got logits_to_keep={logits_to_keep!r}; only 0 (all logits) is supported.")
    for key, value in kwargs.items():
        if key not in _DEFAULTS:
            raise TPInputError(f"{who} got the unknown argument {key}={value!r}; drop it.")
        if key != "past_key_values" and value not in (None, False):
            raise TPInputError(f"{who} got {key}={value!r}; only {_DEFAULTS[key]!r} is supported. Drop it.")


def build(module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    new = GPT2DistributedLMHead(cast(Any, module).config, tp=ctx, **dict(overrides))
    state = module.state_dict()
    head = state.pop("lm_head.weight", None)
    if head is not None and head is not state["transformer.wte.weight"]:
        # Untied although the config ties them (train_gpt_simple.py skips init_weights, which ties):
        # Hugging Face's tie_weights would make the word embedding the LM head's weight, as here.
        log.info("GPT-2: lm_head.weight was not tied to transformer.wte.weight; the word embedding is used")
    new.load_full_state_dict(gpt2_to_smp(state))
    return new


def registrations() -> list[Registration]:
    return [
        Registration(
            MODEL,
            GPT2DistributedLMHead,
            builder=build,
            check=check,
            to_original=gpt2_from_smp,
            from_original=gpt2_to_smp,
        )
    ]


ENCODERS = (
    "transformers.models.bert.modeling_bert.BertEncoder",
    "transformers.models.roberta.modeling_roberta.RobertaEncoder",
)
"""Replaced whole by mp_tensor.hf.stack_bert (smp's ``encoder.seq_layers``)."""

GPTJ_MODEL = "transformers.models.gptj.modeling_gptj.GPTJForCausalLM"
GPTNEO_MODEL = "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoForCausalLM"
"""Replaced whole by mp_tensor.hf.stack_gpt (smp's GPT-J / GPT-Neo DistributedTransformerLMHead)."""

GPTNEOX_MODEL = "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM"
"""Replaced whole by mp_tensor.hf.stack_gpt (smp's GPT-NeoX DistributedTransformerLMHead)."""

WHOLE_STACK_MODELS = frozenset({MODEL, *ENCODERS, GPTJ_MODEL, GPTNEO_MODEL, GPTNEOX_MODEL})
"""The models replaced whole, also at tp=1."""


def whole_stack_registry(base: Registry) -> Registry:
    """The entries of ``base`` that replace a whole model: the only replacements made at tp=1."""
    out = Registry()
    for reg in base.entries():
        if reg.name in WHOLE_STACK_MODELS:
            out.add(reg)
    return out
