"""Hugging Face ``GPT2Block`` -> ``DistributedTransformerLayer`` (pre-layernorm, causal, GPT-2's gelu).

The block's ``Conv1D`` weights are stored ``[in, out]``; the reference layout is ``nn.Linear``'s
``[out, in]``, and ``c_attn`` holds query, key and value side by side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.errors import TPInputError
from mp_tensor.hf.common import ACTIVATION_MAP, additive, first, sizes_reason
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.transformer import DistributedTransformerLayer
from mp_tensor.registry import Registration

__all__ = ["BLOCK", "block_from_reference", "block_to_reference", "layer_kwargs", "registrations"]

BLOCK = "transformers.models.gpt2.modeling_gpt2.GPT2Block"


def _config(block: nn.Module) -> Any:
    return cast(Any, block).attn.config


def layer_kwargs(config: Any) -> dict[str, Any]:
    """The DistributedTransformerLayer arguments equivalent to a GPT2Block of ``config``."""
    hidden = config.hidden_size
    return {
        "num_attention_heads": config.num_attention_heads,
        "attention_head_size": hidden // config.num_attention_heads,
        "hidden_size": hidden,
        "intermediate_size": config.n_inner if config.n_inner is not None else 4 * hidden,
        "attention_dropout_prob": config.attn_pdrop,
        "hidden_dropout_prob": config.resid_pdrop,
        "activation": ACTIVATION_MAP.get(config.activation_function, config.activation_function),
        "layernorm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "causal_mask_size": config.n_positions,
        "pre_layernorm": True,
        "post_layernorm": False,
    }


def check(block: nn.Module, tp_size: int) -> str | None:
    config = _config(block)
    if getattr(config, "add_cross_attention", False):
        return "GPT-2 blocks with cross attention are not mapped"
    if not getattr(config, "scale_attn_weights", True) or getattr(
        config, "scale_attn_by_inverse_layer_idx", False
    ):
        return "GPT-2 attention scaling other than 1/sqrt(head_dim) is not mapped"
    if config.activation_function not in ACTIVATION_MAP:
        return f"activation_function={config.activation_function!r} is not supported"
    kw = layer_kwargs(config)
    return sizes_reason(
        tp_size,
        num_attention_heads=kw["num_attention_heads"],
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
    )


def block_to_reference(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A GPT2Block state dict -> the DistributedTransformerLayer reference layout."""
    out: dict[str, Tensor] = {}
    qkv_w, qkv_b = sd["attn.c_attn.weight"], sd["attn.c_attn.bias"]
    hidden = qkv_w.shape[0]
    for i, name in enumerate(("query", "key", "value")):
        out[f"attention.{name}.weight"] = qkv_w[:, i * hidden : (i + 1) * hidden].t().contiguous()
        out[f"attention.{name}.bias"] = qkv_b[i * hidden : (i + 1) * hidden].clone()
    out["attention.dense.weight"] = sd["attn.c_proj.weight"].t().contiguous()
    out["attention.dense.bias"] = sd["attn.c_proj.bias"].clone()
    out["output.dense1.weight"] = sd["mlp.c_fc.weight"].t().contiguous()
    out["output.dense1.bias"] = sd["mlp.c_fc.bias"].clone()
    out["output.dense2.weight"] = sd["mlp.c_proj.weight"].t().contiguous()
    out["output.dense2.bias"] = sd["mlp.c_proj.bias"].clone()
    for src, dst in (("ln_1", "attention.pre_layernorm"), ("ln_2", "output.pre_layernorm")):
        out[f"{dst}.weight"] = sd[f"{src}.weight"].clone()
        out[f"{dst}.bias"] = sd[f"{src}.bias"].clone()
    return out


def block_from_reference(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The reference layout -> a GPT2Block state dict."""
    out: dict[str, Tensor] = {
        "attn.c_attn.weight": torch.cat(
            [sd[f"attention.{n}.weight"].t() for n in ("query", "key", "value")], 1
        ),
        "attn.c_attn.bias": torch.cat([sd[f"attention.{n}.bias"] for n in ("query", "key", "value")]),
        "attn.c_proj.weight": sd["attention.dense.weight"].t().contiguous(),
        "attn.c_proj.bias": sd["attention.dense.bias"],
        "mlp.c_fc.weight": sd["output.dense1.weight"].t().contiguous(),
        "mlp.c_fc.bias": sd["output.dense1.bias"],
        "mlp.c_proj.weight": sd["output.dense2.weight"].t().contiguous(),
        "mlp.c_proj.bias": sd["output.dense2.bias"],
    }
    for dst, src in (("ln_1", "attention.pre_layernorm"), ("ln_2", "output.pre_layernorm")):
        out[f"{dst}.weight"] = sd[f"{src}.weight"]
        out[f"{dst}.bias"] = sd[f"{src}.bias"]
    return out


def forward_hook(  # noqa: PLR0917
    hidden_states: Tensor,
    past_key_values: Any = None,
    attention_mask: Tensor | None = None,
    encoder_hidden_states: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    use_cache: bool | None = False,
    **kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """GPT2Block's call -> ``((hidden_states, additive_mask),)``."""
    if encoder_hidden_states is not None:
        raise TPInputError(
            "the distributed GPT-2 block got encoder_hidden_states; cross attention is not mapped."
        )
    length = getattr(past_key_values, "get_seq_length", None)
    if callable(length) and length() > 0:
        raise TPInputError(
            "the distributed GPT-2 block got a non-empty key/value cache; incremental decoding is not "
            "supported by tensor-parallel blocks. Call the model with use_cache=False."
        )
    return ((hidden_states, additive(attention_mask, hidden_states)),), {}


def build(block: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    kwargs = {**layer_kwargs(_config(block)), **overrides}
    new = DistributedTransformerLayer(tp=ctx, **kwargs)
    new.load_full_state_dict(block_to_reference(block.state_dict()))
    new.set_call_hooks(forward_hook, first)
    return new


def registrations() -> list[Registration]:
    """The GPT2Block entry, and the whole GPT2LMHeadModel's (mp_tensor.hf.stack, which imports this)."""
    from mp_tensor.hf import stack

    return [
        *stack.registrations(),
        Registration(
            BLOCK,
            DistributedTransformerLayer,
            builder=build,
            check=check,
            to_original=block_from_reference,
            from_original=block_to_reference,
        ),
    ]
