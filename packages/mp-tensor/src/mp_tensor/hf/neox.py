"""Hugging Face ``GPTNeoXLayer`` -> :class:`DistributedGPTNeoXLayer`: the whole block distributed in either
layout of :mod:`mp_tensor.hf.block` (LayerNorm, fused query/key/value, partial rotary, parallel or
sequential residual, GeLU MLP). With the parallel residual, attention and MLP outputs share one
reduction (one all-reduce forward per block in speed mode, two backward).

``query_key_value`` holds each head's query, key and value side by side, so a rank's heads are one
contiguous block of its rows: it is split like any output-split projection, and the distributed layer
keeps Hugging Face's parameter names (its full state dict is the block's).

Refused (the block stays Hugging Face's and its Linears are distributed one by one, with a log line
saying why): heads or intermediate size not divisible by the TP degree (and, in memory mode, the hidden
size), an activation other than gelu/gelu_new/relu, attention or hidden dropout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.hf.block import MegatronBlock, attend, forward_hook, rotate
from mp_tensor.hf.common import GELU_APPROXIMATION, sizes_reason
from mp_tensor.nn.base import DistributedModule
from mp_tensor.registry import Registration

__all__ = ["BLOCK", "DistributedGPTNeoXLayer", "registrations"]

BLOCK = "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXLayer"

_ACTIVATIONS = GELU_APPROXIMATION


class DistributedGPTNeoXLayer(MegatronBlock):
    """A tensor-parallel GPT-NeoX layer; ``forward((hidden [N,S,H], mask, cos, sin))`` with ``mask``
    additive ``[N,1,S,S]`` and ``cos``/``sin`` ``[N,S,rotary_dims]`` returns the new hidden states."""

    def __init__(  # noqa: PLR0917
        self,
        hidden_size: int,
        num_attention_heads: int,
        intermediate_size: int,
        layer_norm_eps: float = 1e-5,
        attention_bias: bool = True,
        use_parallel_residual: bool = True,
        hidden_act: str = "gelu",
        *,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__(
            tp=tp,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            intermediate_size=intermediate_size,
        )
        self.heads = num_attention_heads // self.tp_size
        self.head_dim = hidden_size // num_attention_heads
        self.parallel = use_parallel_residual
        self.act = _ACTIVATIONS[hidden_act]
        h = hidden_size
        self.attention = nn.Module()
        self.attention.query_key_value = self.linear_in(3 * h, h, attention_bias)
        self.attention.dense = self.linear_out(h, h, attention_bias)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = self.linear_in(intermediate_size, h, True)
        self.mlp.dense_4h_to_h = self.linear_out(h, intermediate_size, True)
        self.input_layernorm = self.norm(h, layer_norm_eps, rms=False)
        self.post_attention_layernorm = self.norm(h, layer_norm_eps, rms=False)

    def _context(self, x: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attention up to (not including) the dense projection: this rank's heads."""
        attn = cast(Any, self.attention)
        n, s, d = x.shape[0], x.shape[1], self.head_dim
        (qkv,) = self.project(x, [attn.query_key_value])
        q, k, v = qkv.view(n, s, self.heads, 3 * d).transpose(1, 2).chunk(3, dim=-1)
        out = attend(rotate(q, cos, sin), rotate(k, cos, sin), v, mask, d**-0.5)
        return out.transpose(1, 2).reshape(n, s, self.heads * d)

    def _inner(self, x: Tensor) -> Tensor:
        """The MLP up to (not including) its output projection: this rank's channels."""
        (y,) = self.project(x, [cast(Any, self.mlp).dense_h_to_4h])
        return F.relu(y) if self.act == "relu" else F.gelu(y, approximate=self.act)

    def _body(self, h: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        attn, mlp = cast(Any, self.attention), cast(Any, self.mlp)
        context = self._context(self.input_layernorm(h), mask, cos, sin)
        if self.parallel:  # both outputs are added: one reduction for the two
            inner = self._inner(self.post_attention_layernorm(h))
            return h + self.fan_in_sum([(context, attn.dense), (inner, mlp.dense_4h_to_h)])
        h = h + self.fan_in(context, attn.dense)
        return h + self.fan_in(self._inner(self.post_attention_layernorm(h)), mlp.dense_4h_to_h)

    def forward(self, inputs: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        return self.run(inputs, self._body)


def _config(layer: nn.Module) -> Any:
    return cast(Any, layer).attention.config


def _kwargs(layer: nn.Module) -> dict[str, Any]:
    block = cast(Any, layer)
    config = _config(layer)
    return {
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": block.mlp.dense_h_to_4h.out_features,
        "layer_norm_eps": block.input_layernorm.eps,
        "attention_bias": block.attention.query_key_value.bias is not None,
        "use_parallel_residual": bool(block.use_parallel_residual),
        "hidden_act": config.hidden_act,
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    config = _config(layer)
    if config.hidden_act not in _ACTIVATIONS:
        return f"hidden_act={config.hidden_act!r} is not mapped (expected one of {sorted(_ACTIVATIONS)})"
    for name in ("attention_dropout", "hidden_dropout"):
        if getattr(config, name, 0.0):
            return f"{name}={getattr(config, name)} is not mapped (pass 0.0)"
    if config.hidden_size % config.num_attention_heads:
        return f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads"
    kw = _kwargs(layer)
    return sizes_reason(
        tp_size, num_attention_heads=kw["num_attention_heads"], intermediate_size=kw["intermediate_size"]
    )


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    new = DistributedGPTNeoXLayer(**_kwargs(layer), tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    new.set_call_hooks(forward_hook, None)
    return new


def registrations() -> list[Registration]:
    """The block entry, and the whole model's (mp_tensor.hf.stack_gpt)."""
    from mp_tensor.hf import stack_gpt

    whole = [r for r in stack_gpt.registrations() if r.name.endswith("GPTNeoXForCausalLM")]
    return [*whole, Registration(BLOCK, DistributedGPTNeoXLayer, builder=build, check=check)]
