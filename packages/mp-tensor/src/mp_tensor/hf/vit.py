"""Hugging Face ``ViTLayer`` -> :class:`DistributedViTLayer`: the whole pre-LayerNorm encoder block of
a Vision Transformer distributed in either layout of :mod:`mp_tensor.hf.block`.

q/k/v (with or without ``qkv_bias``) are split by whole heads and ``o_proj`` by its input channels, the
MLP's ``fc1`` by output and ``fc2`` by input channels: in speed mode a block costs one all-reduce after
attention and one after the MLP, and their two mirrors backward. Dropout (``hidden_dropout_prob``,
``attention_probs_dropout_prob``) goes through :func:`mp_tensor.dist_ops.tp_dropout`. The distributed
layer keeps Hugging Face's parameter names: its full state dict is the block's.

Refused (the block stays Hugging Face's and its Linears are distributed one by one, with a log line):
heads or ``intermediate_size`` not divisible by the TP degree, a ``hidden_act`` other than gelu,
gelu_new, relu or silu. An attention mask is refused at call time (ViT's model passes none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.dist_ops import Layout, enter, leave, tp_dropout
from mp_tensor.errors import TPInputError
from mp_tensor.hf.block import MegatronBlock
from mp_tensor.hf.common import sizes_reason
from mp_tensor.hf.t5 import ACTIVATIONS, activate
from mp_tensor.nn.base import DistributedModule
from mp_tensor.registry import Registration

__all__ = ["BLOCK", "DistributedViTLayer", "registrations"]

BLOCK = "transformers.models.vit.modeling_vit.ViTLayer"


class DistributedViTLayer(MegatronBlock):
    """A tensor-parallel ViT encoder layer; ``forward(hidden [N, S, H])`` returns the new hidden states."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        head_dim: int,
        intermediate_size: int,
        *,
        qkv_bias: bool = True,
        hidden_act: str = "gelu",
        layer_norm_eps: float = 1e-12,
        hidden_dropout_prob: float = 0.0,
        attention_probs_dropout_prob: float = 0.0,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__(
            tp=tp,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            intermediate_size=intermediate_size,
        )
        self.heads, self.head_dim, self.act = num_attention_heads // self.tp_size, head_dim, hidden_act
        self.p_hidden, self.p_attn = hidden_dropout_prob, attention_probs_dropout_prob
        h, inner = hidden_size, num_attention_heads * head_dim
        self.attention = nn.Module()
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(self.attention, proj, self.linear_in(inner, h, qkv_bias))
        self.attention.o_proj = self.linear_out(h, inner, True)
        self.layernorm_before = self.norm(h, layer_norm_eps, rms=False)
        self.layernorm_after = self.norm(h, layer_norm_eps, rms=False)
        self.mlp = nn.Module()
        self.mlp.fc1 = self.linear_in(intermediate_size, h, True)
        self.mlp.fc2 = self.linear_out(h, intermediate_size, True)

    def _drop(self, x: Tensor, p: float, kind: Layout) -> Tensor:
        return tp_dropout(x, p, self.training, self.tp, kind)

    def _attention(self, x: Tensor) -> Tensor:
        attn = cast(Any, self.attention)
        n, s, d = x.shape[0], x.shape[1], self.head_dim
        q, k, v = (
            t.view(n, s, self.heads, d).transpose(1, 2)
            for t in self.project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        )
        if self.training and self.p_attn > 0:
            probs = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, dim=-1)
            out = self._drop(probs, self.p_attn, "sharded") @ v  # heads differ per rank
        else:
            out = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)
        return self.fan_in(out.transpose(1, 2).reshape(n, s, self.heads * d), attn.o_proj)

    def _body(self, h: Tensor) -> Tensor:
        mlp = cast(Any, self.mlp)
        kind: Layout = "sharded" if self.memory else "replicated"
        h = h + self._drop(self._attention(self.layernorm_before(h)), self.p_hidden, kind)
        (inner,) = self.project(self.layernorm_after(h), [mlp.fc1])
        return h + self._drop(self.fan_in(activate(inner, self.act), mlp.fc2), self.p_hidden, kind)

    def forward(self, hidden: Tensor) -> Tensor:
        layout: Layout = "sharded" if self.memory else "replicated"
        return leave(self._body(enter(hidden, self.tp, layout, type(self).__name__)), self.tp, layout)


def forward_hook(
    hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A ViTLayer's call -> ``(hidden,)``."""
    if attention_mask is not None:
        raise TPInputError(
            f"a tensor-parallel ViT layer got an attention mask of shape {tuple(attention_mask.shape)}; "
            "ViT attends over every patch and the distributed layer takes no mask. Pass None."
        )
    return (hidden_states,), {}


def _kwargs(layer: nn.Module) -> dict[str, Any]:
    block = cast(Any, layer)
    attn, config = block.attention, block.attention.config
    return {
        "hidden_size": config.hidden_size,
        "num_attention_heads": attn.num_attention_heads,
        "head_dim": attn.head_dim,
        "intermediate_size": block.mlp.fc1.out_features,
        "qkv_bias": attn.q_proj.bias is not None,
        "hidden_act": config.hidden_act if isinstance(config.hidden_act, str) else repr(config.hidden_act),
        "layer_norm_eps": block.layernorm_before.eps,
        "hidden_dropout_prob": float(config.hidden_dropout_prob),
        "attention_probs_dropout_prob": float(config.attention_probs_dropout_prob),
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    kw = _kwargs(layer)
    if kw["hidden_act"] not in ACTIVATIONS:
        return f"hidden_act={kw['hidden_act']!r} is not mapped (use one of {', '.join(ACTIVATIONS)})"
    attn = cast(Any, layer).attention
    if abs(attn.scaling - attn.head_dim**-0.5) > 1e-12:
        return f"attention scaling {attn.scaling} other than 1/sqrt(head_dim) is not mapped"
    return sizes_reason(
        tp_size, num_attention_heads=kw["num_attention_heads"], intermediate_size=kw["intermediate_size"]
    )


def _identity(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return dict(sd)


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    new = DistributedViTLayer(**_kwargs(layer), tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    new.set_call_hooks(forward_hook, None)
    return new


def registrations() -> list[Registration]:
    return [
        Registration(
            BLOCK,
            DistributedViTLayer,
            builder=build,
            check=check,
            to_original=_identity,
            from_original=_identity,
        )
    ]
