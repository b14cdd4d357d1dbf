"""Hugging Face ``GPTJBlock`` -> :class:`DistributedGPTJLayer`: the whole block distributed in either
layout of :mod:`mp_tensor.hf.block` (one LayerNorm feeding attention and MLP in parallel, GPT-J's
interleaved partial rotary, GeLU MLP). Attention and MLP read the same normalized input and their
outputs are added, so q/k/v and ``fc_in`` share one input exchange and ``out_proj`` and ``fc_out`` one
reduction: a block costs one all-reduce forward and one backward in speed mode. The distributed layer
keeps Hugging Face's parameter names (its full state dict is the block's).

Refused (the block stays Hugging Face's and its Linears are distributed one by one, with a log line):
heads or inner size not divisible by the TP degree (and, in memory mode, the hidden size), an
activation other than gelu/gelu_new/relu, attention or residual dropout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.hf.block import MegatronBlock, attend, forward_hook
from mp_tensor.hf.common import GELU_APPROXIMATION, sizes_reason
from mp_tensor.nn.base import DistributedModule
from mp_tensor.registry import Registration

__all__ = ["BLOCK", "DistributedGPTJLayer", "registrations"]

BLOCK = "transformers.models.gptj.modeling_gptj.GPTJBlock"

_ACTIVATIONS = GELU_APPROXIMATION


def _rotate_every_two(x: Tensor) -> Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotary(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    """GPT-J's rotary embedding of ``x [N, S, heads, d]`` on its first ``2 * sin.shape[-1]`` channels."""
    s, c = (t[:, :, None, :].repeat_interleave(2, -1) for t in (sin, cos))
    dim = c.shape[-1]
    rot = x[..., :dim] * c + _rotate_every_two(x[..., :dim]) * s
    return rot if dim == x.shape[-1] else torch.cat((rot, x[..., dim:]), dim=-1)


class DistributedGPTJLayer(MegatronBlock):
    """A tensor-parallel GPT-J block; ``forward((hidden [N,S,H], mask, sin, cos))`` with ``mask`` additive
    ``[N,1,S,S]`` and ``sin``/``cos`` ``[N,S,rotary_dim/2]`` (the model's, in its order) returns the new
    hidden states."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        intermediate_size: int,
        layer_norm_epsilon: float = 1e-5,
        activation_function: str = "gelu_new",
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
        self.act = _ACTIVATIONS[activation_function]
        h = hidden_size
        self.ln_1 = self.norm(h, layer_norm_epsilon, rms=False)
        self.attn = nn.Module()
        self.attn.q_proj = self.linear_in(h, h, False)
        self.attn.k_proj = self.linear_in(h, h, False)
        self.attn.v_proj = self.linear_in(h, h, False)
        self.attn.out_proj = self.linear_out(h, h, False)
        self.mlp = nn.Module()
        self.mlp.fc_in = self.linear_in(intermediate_size, h, True)
        self.mlp.fc_out = self.linear_out(h, intermediate_size, True)

    def _body(self, h: Tensor, mask: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
        attn, mlp = cast(Any, self.attn), cast(Any, self.mlp)
        n, s, d = h.shape[0], h.shape[1], self.head_dim
        q, k, v, inner = self.project(self.ln_1(h), [attn.q_proj, attn.k_proj, attn.v_proj, mlp.fc_in])
        q, k, v = (t.view(n, s, self.heads, d) for t in (q, k, v))
        q, k = _rotary(q, sin, cos), _rotary(k, sin, cos)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, d**-0.5)
        inner = F.relu(inner) if self.act == "relu" else F.gelu(inner, approximate=self.act)
        context = out.transpose(1, 2).reshape(n, s, self.heads * d)
        return h + self.fan_in_sum([(context, attn.out_proj), (inner, mlp.fc_out)])

    def forward(self, inputs: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        return self.run(inputs, self._body)


def _config(layer: nn.Module) -> Any:
    return cast(Any, layer).attn.config


def _kwargs(layer: nn.Module) -> dict[str, Any]:
    block, config = cast(Any, layer), _config(layer)
    return {
        "hidden_size": config.n_embd,
        "num_attention_heads": config.n_head,
        "intermediate_size": block.mlp.fc_in.out_features,
        "layer_norm_epsilon": block.ln_1.eps,
        "activation_function": config.activation_function,
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    config = _config(layer)
    if config.activation_function not in _ACTIVATIONS:
        return f"activation_function={config.activation_function!r} is not mapped"
    for name in ("attn_pdrop", "resid_pdrop"):
        if float(getattr(config, name, 0.0)):
            return f"{name}={getattr(config, name)} is not mapped (pass 0.0)"
    kw = _kwargs(layer)
    return sizes_reason(
        tp_size, num_attention_heads=kw["num_attention_heads"], intermediate_size=kw["intermediate_size"]
    )


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    new = DistributedGPTJLayer(**_kwargs(layer), tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    new.set_call_hooks(forward_hook, None)  # position_embeddings is GPT-J's (sin, cos): passed in order
    return new


def registrations() -> list[Registration]:
    """The block entry, and the whole model's (mp_tensor.hf.stack_gpt)."""
    from mp_tensor.hf import stack_gpt

    whole = [r for r in stack_gpt.registrations() if r.name.endswith("GPTJForCausalLM")]
    return [*whole, Registration(BLOCK, DistributedGPTJLayer, builder=build, check=check)]
