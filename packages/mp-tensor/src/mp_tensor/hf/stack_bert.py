"""smp's whole-encoder replacement for BERT and RoBERTa: a Hugging Face ``BertEncoder`` /
``RobertaEncoder`` built inside ``tensor_parallelism()`` becomes :class:`BertDistributedEncoder`, a
``DistributedTransformer`` (``encoder.seq_layers``, smp's layout, which ``smp.nn.huggingface.bert``
translates), at any tensor-parallel degree including 1. It is called as the encoder it replaces and
returns its output type; its gathered state dict has Hugging Face's names. ``whole_stack=False``
keeps the encoder and distributes its layers one by one (see :mod:`mp_tensor.hf.stack`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.errors import TPInputError
from mp_tensor.hf import bert
from mp_tensor.hf.common import additive
from mp_tensor.hf.stack import ENCODERS, whole_stack_requested
from mp_tensor.hf.translate import bert_from_smp, bert_to_smp
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.transformer import DistributedTransformer
from mp_tensor.registry import Registration

__all__ = ["BertDistributedEncoder", "registrations"]


def check(module: nn.Module, tp_size: int) -> str | None:
    """Why this encoder cannot become a DistributedTransformer, or None."""
    if not whole_stack_requested(module):
        return "whole_stack=False was asked for (its layers are distributed one by one instead)"
    layers = list(cast(Any, module).layer)
    if not layers:
        return "the encoder has no layers"
    return bert.check(layers[0], tp_size)


class BertDistributedEncoder(DistributedTransformer):
    """A ``DistributedTransformer`` standing in for a Hugging Face BERT/RoBERTa encoder."""

    def __init__(self, config: Any, *, tp: TPContext | None = None, **overrides: Any) -> None:
        kwargs = {**bert.layer_kwargs(config), "num_layers": config.num_hidden_layers, **overrides}
        kwargs.pop("whole_stack", None)
        super().__init__(tp=tp, **kwargs)
        self.__dict__["config"] = config

    def forward(  # type: ignore[override]  # noqa: PLR0917
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The encoder's call (Hugging Face's extended mask: None, bool or additive) -> its output."""
        if encoder_hidden_states is not None:
            raise TPInputError(
                "the distributed BERT encoder got encoder_hidden_states; cross attention is not mapped."
            )
        for kv in (cache, kwargs.get("past_key_values")):
            length = getattr(kv, "get_seq_length", None)
            if callable(length) and length() > 0:
                raise TPInputError(
                    "the distributed BERT encoder got a non-empty key/value cache; call it with "
                    "use_cache=False."
                )
        for key in ("output_attentions", "output_hidden_states"):
            if kwargs.get(key):
                raise TPInputError(f"the distributed BERT encoder got {key}=True; only False is supported.")
        out = super().forward((hidden_states, additive(attention_mask, hidden_states)))[0]
        if return_dict is False:
            return (out,)
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=out)


def _to_original(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = bert_from_smp({f"encoder.{k}": v for k, v in sd.items()})
    return {k.removeprefix("encoder."): v for k, v in out.items()}


def _from_original(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = bert_to_smp({f"encoder.{k}": v for k, v in sd.items()})
    return {k.removeprefix("encoder."): v for k, v in out.items()}


def build(module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    config = cast(Any, module).layer[0].attention.self.config
    new = BertDistributedEncoder(config, tp=ctx, **dict(overrides))
    new.load_full_state_dict(_from_original(module.state_dict()))
    return new


def registrations() -> list[Registration]:
    return [
        Registration(
            name,
            BertDistributedEncoder,
            builder=build,
            check=check,
            to_original=_to_original,
            from_original=_from_original,
        )
        for name in ENCODERS
    ]
