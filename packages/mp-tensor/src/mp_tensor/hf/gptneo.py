"""Hugging Face ``GPTNeoBlock`` -> :class:`DistributedGPTNeoLayer`: the whole block distributed in either
layout of :mod:`mp_tensor.hf.block` (LayerNorm, unscaled attention over global or local windows, GeLU
MLP). The distributed layer keeps Hugging Face's parameter names (its full state dict is the block's).

GPT-Neo alternates global (causal) and local attention (each token sees the ``window_size`` tokens up
to itself); the call hook folds the block's window into the model's mask. Refused (the block stays
Hugging Face's and its Linears are distributed one by one, with a log line): heads or intermediate size
not divisible by the TP degree (and, in memory mode, the hidden size), an attention implementation
other than eager, an activation other than gelu/gelu_new/relu, attention or residual dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.errors import TPInputError
from mp_tensor.hf.block import MegatronBlock, attend
from mp_tensor.hf.common import GELU_APPROXIMATION, sizes_reason
from mp_tensor.nn.base import DistributedModule
from mp_tensor.registry import Registration

__all__ = ["BLOCK", "DistributedGPTNeoLayer", "registrations"]

BLOCK = "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoBlock"

_ACTIVATIONS = GELU_APPROXIMATION


class DistributedGPTNeoLayer(MegatronBlock):
    """A tensor-parallel GPT-Neo block; ``forward((hidden [N,S,H], mask, None, None))`` with ``mask``
    additive ``[N,1,S,S]`` (the window included) returns the new hidden states."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        layer_norm_epsilon: float = 1e-5,
        activation_function: str = "gelu_new",
        *,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__(
            tp=tp, hidden_size=hidden_size, num_heads=num_heads, intermediate_size=intermediate_size
        )
        self.heads, self.head_dim = num_heads // self.tp_size, hidden_size // num_heads
        self.act = _ACTIVATIONS[activation_function]
        h = hidden_size
        self.attn = nn.Module()
        self.attn.attention = nn.Module()
        self.attn.attention.q_proj = self.linear_in(h, h, False)
        self.attn.attention.k_proj = self.linear_in(h, h, False)
        self.attn.attention.v_proj = self.linear_in(h, h, False)
        self.attn.attention.out_proj = self.linear_out(h, h, True)
        self.mlp = nn.Module()
        self.mlp.c_fc = self.linear_in(intermediate_size, h, True)
        self.mlp.c_proj = self.linear_out(h, intermediate_size, True)
        self.ln_1 = self.norm(h, layer_norm_epsilon, rms=False)
        self.ln_2 = self.norm(h, layer_norm_epsilon, rms=False)

    def _attention(self, x: Tensor, mask: Tensor) -> Tensor:
        attn = cast(Any, self.attn).attention
        n, s, d = x.shape[0], x.shape[1], self.head_dim
        q, k, v = (
            t.view(n, s, self.heads, d).transpose(1, 2)
            for t in self.project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        )
        out = attend(q, k, v, mask, 1.0)  # GPT-Neo does not scale the scores
        return self.fan_in(out.transpose(1, 2).reshape(n, s, self.heads * d), attn.out_proj)

    def _mlp(self, x: Tensor) -> Tensor:
        mlp = cast(Any, self.mlp)
        (y,) = self.project(x, [mlp.c_fc])
        y = F.relu(y) if self.act == "relu" else F.gelu(y, approximate=self.act)
        return self.fan_in(y, mlp.c_proj)

    def _body(self, h: Tensor, mask: Tensor, cos: Any, sin: Any) -> Tensor:
        h = h + self._attention(self.ln_1(h), mask)
        return h + self._mlp(self.ln_2(h))

    def forward(self, inputs: tuple[Tensor, Tensor, Any, Any]) -> Tensor:
        return self.run(inputs, self._body)


def _config(layer: nn.Module) -> Any:
    return cast(Any, layer).attn.attention.config


def _kwargs(layer: nn.Module) -> dict[str, Any]:
    block, config = cast(Any, layer), _config(layer)
    return {
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "intermediate_size": block.mlp.c_fc.out_features,
        "layer_norm_epsilon": block.ln_1.eps,
        "activation_function": config.activation_function,
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    config = _config(layer)
    if getattr(config, "_attn_implementation", "eager") != "eager":
        return f"attention implementation {config._attn_implementation!r} is not mapped (eager only)"
    if config.activation_function not in _ACTIVATIONS:
        return f"activation_function={config.activation_function!r} is not mapped"
    for name in ("attention_dropout", "resid_dropout"):
        if float(getattr(config, name, 0.0)):
            return f"{name}={getattr(config, name)} is not mapped (pass 0.0)"
    kw = _kwargs(layer)
    return sizes_reason(tp_size, num_heads=kw["num_heads"], intermediate_size=kw["intermediate_size"])


def _hook(window: int | None) -> Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]:
    """GPTNeoBlock's call -> ``((hidden, additive_mask, None, None),)``, the block's window folded in."""

    def forward_hook(
        hidden_states: Tensor,
        layer_past: Any = None,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        length = getattr(layer_past, "get_seq_length", None)
        if callable(length) and length() > 0:
            raise TPInputError(
                "the distributed GPT-Neo block got a non-empty key/value cache; incremental decoding is not "
                "supported by tensor-parallel blocks. Call the model with use_cache=False."
            )
        if output_attentions:
            raise TPInputError(
                "the distributed GPT-Neo block cannot return attention weights; pass output_attentions=False."
            )
        n, s, dtype = hidden_states.shape[0], hidden_states.shape[1], hidden_states.dtype
        rows = torch.arange(s, device=hidden_states.device)
        gap = rows[:, None] - rows[None, :]
        keep = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
        base = torch.zeros(n, 1, s, s, dtype=dtype, device=hidden_states.device)
        if attention_mask is not None:
            m = attention_mask
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            base = base + m.to(dtype)
        mask = torch.where(keep, base, torch.finfo(dtype).min)
        return ((hidden_states, mask, None, None),), {}

    return forward_hook


def _return(out: Tensor) -> tuple[Tensor, None]:
    return out, None  # GPTNeoBlock returns (hidden_states, attention weights)


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    attention = cast(Any, layer).attn.attention
    window = _config(layer).window_size if attention.attention_type == "local" else None
    new = DistributedGPTNeoLayer(**_kwargs(layer), tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    new.set_call_hooks(_hook(window), _return)
    return new


def registrations() -> list[Registration]:
    """The block entry, and the whole model's (mp_tensor.hf.stack_gpt)."""
    from mp_tensor.hf import stack_gpt

    whole = [r for r in stack_gpt.registrations() if r.name.endswith("GPTNeoForCausalLM")]
    return [*whole, Registration(BLOCK, DistributedGPTNeoLayer, builder=build, check=check)]
