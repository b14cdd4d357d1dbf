"""Hugging Face ``BertLayer``/``RobertaLayer`` -> ``DistributedTransformerLayer`` (post-layernorm)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.errors import TPInputError
from mp_tensor.hf.common import ACTIVATION_MAP, additive, first, sizes_reason
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.transformer import DistributedTransformerLayer
from mp_tensor.registry import Registration

__all__ = ["BLOCKS", "block_from_reference", "block_to_reference", "layer_kwargs", "registrations"]

BLOCKS = (
    "transformers.models.bert.modeling_bert.BertLayer",
    "transformers.models.roberta.modeling_roberta.RobertaLayer",
)

#: BertLayer state-dict names -> the reference layout's.
_NAMES = {
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention.layernorm",
    "intermediate.dense": "output.dense1",
    "output.dense": "output.dense2",
    "output.LayerNorm": "output.layernorm",
}


def _config(layer: nn.Module) -> Any:
    return cast(Any, layer).attention.self.config


def layer_kwargs(config: Any) -> dict[str, Any]:
    """The DistributedTransformerLayer arguments equivalent to a BertLayer of ``config``."""
    heads = config.num_attention_heads
    return {
        "num_attention_heads": heads,
        "attention_head_size": config.hidden_size // heads,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "attention_dropout_prob": config.attention_probs_dropout_prob,
        "hidden_dropout_prob": config.hidden_dropout_prob,
        "activation": ACTIVATION_MAP.get(str(config.hidden_act), str(config.hidden_act)),
        "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range,
        "causal_mask_size": config.max_position_embeddings if config.is_decoder else None,
        "pre_layernorm": False,
        "post_layernorm": True,
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    config = _config(layer)
    if getattr(config, "add_cross_attention", False):
        return "BERT/RoBERTa layers with cross attention are not mapped"
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACTIVATION_MAP:
        return f"hidden_act={config.hidden_act!r} is not supported"
    if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        return f"position_embedding_type={config.position_embedding_type!r} is not supported"
    kw = layer_kwargs(config)
    return sizes_reason(
        tp_size,
        num_attention_heads=kw["num_attention_heads"],
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
    )


def block_to_reference(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A BertLayer state dict -> the DistributedTransformerLayer reference layout."""
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        module, _, leaf = key.rpartition(".")
        if module in _NAMES:
            out[f"{_NAMES[module]}.{leaf}"] = value
    return out


def block_from_reference(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The reference layout -> a BertLayer state dict."""
    back = {v: k for k, v in _NAMES.items()}
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        module, _, leaf = key.rpartition(".")
        out[f"{back[module]}.{leaf}"] = value
    return out


def forward_hook(
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    encoder_hidden_states: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """BertLayer's call -> ``((hidden_states, additive_mask),)``."""
    if encoder_hidden_states is not None:
        raise TPInputError(
            "the distributed BERT layer got encoder_hidden_states; cross attention is not mapped."
        )
    return ((hidden_states, additive(attention_mask, hidden_states)),), {}


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    kwargs = {**layer_kwargs(_config(layer)), **overrides}
    new = DistributedTransformerLayer(tp=ctx, **kwargs)
    new.load_full_state_dict(block_to_reference(layer.state_dict()))
    new.set_call_hooks(forward_hook, first)
    return new


def registrations() -> list[Registration]:
    """The BertLayer/RobertaLayer entries, and the whole encoders' (mp_tensor.hf.stack_bert)."""
    from mp_tensor.hf import stack_bert

    blocks = [
        Registration(
            name,
            DistributedTransformerLayer,
            builder=build,
            check=check,
            to_original=block_from_reference,
            from_original=block_to_reference,
        )
        for name in BLOCKS
    ]
    return [*stack_bert.registrations(), *blocks]
