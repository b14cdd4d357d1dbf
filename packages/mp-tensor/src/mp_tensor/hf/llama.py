"""Hugging Face Llama-style decoder layers (``LlamaDecoderLayer``, ``MistralDecoderLayer``,
``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``) -> :class:`DistributedLlamaLayer`: Megatron-style tensor
parallelism of a whole block (RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP; Qwen3's
per-head query/key RMSNorm).

With optimize "speed", activations are replicated over the TP group: query/key/value and gate/up are
split by output channels (whole heads, whole key/value groups per rank), the output and down projections
by input channels, so a block costs one all-reduce after attention and one after the MLP, and their two
mirrors in backward. With optimize "memory", activations are split by channels (the ``sharded`` layout
of the transformer modules): every projection is split by its input channels and its output
reduce-scattered (q/k/v in one, gate/up in one), RMSNorm all-reduces one number per token: 4
reduce-scatters and 2 scalar all-reduces per block forward, 4 all-gathers and 2 all-reduces backward.
The distributed layer keeps the Hugging Face parameter names, so its full state dict is the block's.
Rotary cos/sin come from the model (any ``rope_type``), as for the HF block.

Refused (the block stays Hugging Face's and its Linears are distributed one by one, with a log line
saying why): ``num_attention_heads``, ``num_key_value_heads`` or ``intermediate_size`` not divisible by
the TP degree (a key/value head is never split nor copied), ``hidden_act`` other than silu, attention
dropout, attention scaling other than ``1/sqrt(head_dim)``, and (memory mode) ``hidden_size`` not
divisible by the TP degree. Sliding-window attention (Mistral, Qwen) comes in through the model's mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.hf.block import MegatronBlock, Norm, attend, forward_hook, rotate
from mp_tensor.hf.common import sizes_reason
from mp_tensor.nn.base import DistributedModule
from mp_tensor.registry import Registration

__all__ = ["BLOCKS", "DistributedLlamaLayer", "registrations"]

BLOCKS = (
    "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
    "transformers.models.mistral.modeling_mistral.MistralDecoderLayer",
    "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer",
    "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer",
)


class DistributedLlamaLayer(MegatronBlock):
    """A tensor-parallel Llama decoder layer; ``forward((hidden [N,S,H], mask, cos, sin))`` with ``mask``
    additive ``[N,1,S,S]`` and ``cos``/``sin`` ``[N,S,head_dim]`` returns the new hidden states.

    ``attention_bias`` puts a bias on q/k/v and, unless ``o_proj_bias`` says otherwise, on o (Qwen2:
    q/k/v only); ``qk_norm`` adds Qwen3's RMSNorm over each query/key head."""

    def __init__(  # noqa: PLR0917
        self,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        intermediate_size: int,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        *,
        o_proj_bias: bool | None = None,
        qk_norm: bool = False,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__(
            tp=tp,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            intermediate_size=intermediate_size,
        )
        n = self.tp_size
        self.heads, self.kv_heads = num_attention_heads // n, num_key_value_heads // n
        self.head_dim = head_dim
        h, q_out, kv_out = hidden_size, num_attention_heads * head_dim, num_key_value_heads * head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = self.linear_in(q_out, h, attention_bias)
        self.self_attn.k_proj = self.linear_in(kv_out, h, attention_bias)
        self.self_attn.v_proj = self.linear_in(kv_out, h, attention_bias)
        self.self_attn.o_proj = self.linear_out(
            h, q_out, attention_bias if o_proj_bias is None else o_proj_bias
        )
        self.qk_norm = qk_norm
        if qk_norm:  # replicated, but each rank normalizes only its heads: gradients summed over the group
            self.self_attn.q_norm = Norm(head_dim, rms_norm_eps, self.tp.dtype, rms=True)
            self.self_attn.k_norm = Norm(head_dim, rms_norm_eps, self.tp.dtype, rms=True)
        self.mlp = nn.Module()
        self.mlp.gate_proj = self.linear_in(intermediate_size, h, mlp_bias)
        self.mlp.up_proj = self.linear_in(intermediate_size, h, mlp_bias)
        self.mlp.down_proj = self.linear_out(h, intermediate_size, mlp_bias)
        self.input_layernorm = self.norm(h, rms_norm_eps, rms=True)
        self.post_attention_layernorm = self.norm(h, rms_norm_eps, rms=True)

    def _attention(self, x: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        attn = cast(Any, self.self_attn)
        n, s, d = x.shape[0], x.shape[1], self.head_dim
        q, k, v = self.project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        q, k, v = q.view(n, s, self.heads, d), k.view(n, s, self.kv_heads, d), v.view(n, s, self.kv_heads, d)
        if self.qk_norm:
            q = attn.q_norm.normalize(q, self.fan_out(attn.q_norm.weight))
            k = attn.k_norm.normalize(k, self.fan_out(attn.k_norm.weight))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = attend(rotate(q, cos, sin), rotate(k, cos, sin), v, mask, d**-0.5)
        return self.fan_in(out.transpose(1, 2).reshape(n, s, self.heads * d), attn.o_proj)

    def _mlp(self, x: Tensor) -> Tensor:
        mlp = cast(Any, self.mlp)
        gate, up = self.project(x, [mlp.gate_proj, mlp.up_proj])
        return self.fan_in(F.silu(gate) * up, mlp.down_proj)

    def _body(self, h: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self._attention(self.input_layernorm(h), mask, cos, sin)
        return h + self._mlp(self.post_attention_layernorm(h))

    def forward(self, inputs: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        return self.run(inputs, self._body)


# ------------------------------------------------------------------------------ the HF mapping


def _config(layer: nn.Module) -> Any:
    return cast(Any, layer).self_attn.config


def _kwargs(layer: nn.Module) -> dict[str, Any]:
    """The DistributedLlamaLayer arguments of ``layer``, read from its modules (families differ in
    which projections carry a bias, and in Qwen3's query/key norms)."""
    block = cast(Any, layer)
    attn, mlp, config = block.self_attn, block.mlp, block.self_attn.config
    heads = config.num_attention_heads
    return {
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": attn.head_dim,
        "intermediate_size": mlp.gate_proj.out_features,
        "rms_norm_eps": block.input_layernorm.variance_epsilon,
        "attention_bias": attn.q_proj.bias is not None,
        "o_proj_bias": attn.o_proj.bias is not None,
        "mlp_bias": mlp.gate_proj.bias is not None,
        "qk_norm": hasattr(attn, "q_norm"),
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    block = cast(Any, layer)
    config = _config(layer)
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r} is not mapped (the SwiGLU MLP uses silu)"
    if getattr(config, "attention_dropout", 0.0):
        return f"attention_dropout={config.attention_dropout} is not mapped (pass 0.0)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"pretraining_tp={config.pretraining_tp} is not mapped (pass 1)"
    if abs(block.self_attn.scaling - block.self_attn.head_dim**-0.5) > 1e-12:
        return f"attention scaling {block.self_attn.scaling} other than 1/sqrt(head_dim) is not mapped"
    kw = _kwargs(layer)
    reason = sizes_reason(
        tp_size,
        num_attention_heads=kw["num_attention_heads"],
        num_key_value_heads=kw["num_key_value_heads"],
        intermediate_size=kw["intermediate_size"],
    )
    if reason is not None and "num_key_value_heads" in reason:
        reason += " (grouped-query attention keeps each key/value head whole on one rank)"
    return reason


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    new = DistributedLlamaLayer(**_kwargs(layer), tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    new.set_call_hooks(forward_hook, None)
    return new


def registrations() -> list[Registration]:
    return [Registration(name, DistributedLlamaLayer, builder=build, check=check) for name in BLOCKS]
