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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import Layout, enter, gather_samples, leave
from mp_tensor.errors import DistTransformerConfigError, TPInputError
from mp_tensor.hf.common import sizes_reason
from mp_tensor.nn.base import DistributedModule, ParamSpec, set_param_spec
from mp_tensor.nn.linear import LinearShard
from mp_tensor.registry import Registration

__all__ = ["BLOCKS", "DistributedLlamaLayer", "registrations"]

BLOCKS = (
    "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
    "transformers.models.mistral.modeling_mistral.MistralDecoderLayer",
    "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer",
    "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer",
)


class _RMSNorm(nn.Module):
    """Hugging Face's ``LlamaRMSNorm`` (statistics in fp32): replicated, or with ``tp`` split over the
    channels (the sum of squares all-reduced over the group, one number per token)."""

    def __init__(
        self, hidden: int, eps: float, dtype: torch.dtype | None, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        self.tp, self.hidden, self.eps = tp, hidden, eps
        local = hidden // tp.size if tp is not None else hidden
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype))
        set_param_spec(self.weight, ParamSpec(None if tp is None else 0, scaled_batch=True))

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        """The norm with ``weight`` standing for this module's (a view with its own backward)."""
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.tp is not None and self.tp.group is not None:
            squares = col.all_reduce(squares, self.tp.group, grad="all_reduce")
        h = h * torch.rsqrt(squares / self.hidden + self.eps)
        return weight * h.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DistributedLlamaLayer(DistributedModule):
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
        super().__init__(tp=tp)
        n, name = self.tp_size, type(self).__name__
        reason = sizes_reason(
            n,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            intermediate_size=intermediate_size,
        )
        self.memory = self.tp.distributed and self.tp.optimize == "memory"
        if reason is None and self.memory:
            reason = sizes_reason(n, hidden_size=hidden_size)
        if reason is not None:
            raise DistTransformerConfigError(f"{name}: {reason}; use a multiple of {n}.")
        self.heads, self.kv_heads = num_attention_heads // n, num_key_value_heads // n
        self.head_dim = head_dim
        h, q_out, kv_out = hidden_size, num_attention_heads * head_dim, num_key_value_heads * head_dim
        # speed: q/k/v, gate/up split by outputs; memory: every projection split by its inputs and its
        # output reduce-scattered. o/down are split by inputs in both.
        in_split = 1 if self.memory else 0
        out_bias_split = 0 if self.memory else None

        def project_in(out: int, inp: int, bias: bool) -> LinearShard:
            return LinearShard(self.tp, out, inp, weight_split=in_split, bias=bias, bias_split=0)

        def project_out(out: int, inp: int, bias: bool) -> LinearShard:
            return LinearShard(self.tp, out, inp, weight_split=1, bias=bias, bias_split=out_bias_split)

        self.self_attn = nn.Module()
        self.self_attn.q_proj = project_in(q_out, h, attention_bias)
        self.self_attn.k_proj = project_in(kv_out, h, attention_bias)
        self.self_attn.v_proj = project_in(kv_out, h, attention_bias)
        self.self_attn.o_proj = project_out(h, q_out, attention_bias if o_proj_bias is None else o_proj_bias)
        self.qk_norm = qk_norm
        if qk_norm:  # replicated, but each rank normalizes only its heads: gradients summed over the group
            self.self_attn.q_norm = _RMSNorm(head_dim, rms_norm_eps, self.tp.dtype)
            self.self_attn.k_norm = _RMSNorm(head_dim, rms_norm_eps, self.tp.dtype)
        self.mlp = nn.Module()
        self.mlp.gate_proj = project_in(intermediate_size, h, mlp_bias)
        self.mlp.up_proj = project_in(intermediate_size, h, mlp_bias)
        self.mlp.down_proj = project_out(h, intermediate_size, mlp_bias)
        norm_tp = self.tp if self.memory else None
        self.input_layernorm = _RMSNorm(h, rms_norm_eps, self.tp.dtype, norm_tp)
        self.post_attention_layernorm = _RMSNorm(h, rms_norm_eps, self.tp.dtype, norm_tp)

    @property
    def _group(self) -> Any:
        return self.tp.group if self.tp.distributed else None

    def _fan_out(self, x: Tensor) -> Tensor:
        """Megatron's f: identity forward, gradient summed over the TP group backward."""
        return x if self._group is None else col.all_reduce_backward(x, self._group)

    def _project(self, x: Tensor, shards: list[LinearShard]) -> list[Tensor]:
        """``x`` through each of ``shards``: this rank's output channels of each (speed: the
        split-by-output weights; memory: partial sums over the input slices, reduce-scattered at once)."""
        group = self._group
        if not self.memory or group is None:
            x = self._fan_out(x)
            return [F.linear(x, p.weight, p.bias) for p in shards]
        n = self.tp_size
        parts = [F.linear(x, p.weight) for p in shards]
        widths = [p.shape[-1] // n for p in parts]
        # rank-major: rank j's slice of every output side by side, so one reduce-scatter serves them all
        packed = torch.cat([p.reshape(*p.shape[:-1], n, w) for p, w in zip(parts, widths, strict=True)], -1)
        out = col.reduce_scatter(packed.flatten(-2), -1, group)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        mine = [out.narrow(-1, at, w) for at, w in zip(starts, widths, strict=True)]
        return [m if p.bias is None else m + p.bias for m, p in zip(mine, shards, strict=True)]

    def _fan_in(self, x: Tensor, proj: LinearShard) -> Tensor:
        """Megatron's g: the partial outputs of ``proj`` summed over the group (reduce-scattered over the
        channels in memory mode), then its bias."""
        y, group = F.linear(x, proj.weight), self._group
        if group is not None:
            y = col.reduce_scatter(y, -1, group) if self.memory else col.all_reduce(y, group)
        return y if proj.bias is None else y + proj.bias

    def _attention(self, x: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        attn = cast(Any, self.self_attn)
        n, s, d = x.shape[0], x.shape[1], self.head_dim
        q, k, v = self._project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        q, k, v = q.view(n, s, self.heads, d), k.view(n, s, self.kv_heads, d), v.view(n, s, self.kv_heads, d)
        if self.qk_norm:
            q = attn.q_norm.normalize(q, self._fan_out(attn.q_norm.weight))
            k = attn.k_norm.normalize(k, self._fan_out(attn.k_norm.weight))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * c + _rotate_half(q) * sn, k * c + _rotate_half(k) * sn
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)
        return self._fan_in(out.transpose(1, 2).reshape(n, s, self.heads * d), attn.o_proj)

    def _mlp(self, x: Tensor) -> Tensor:
        mlp = cast(Any, self.mlp)
        gate, up = self._project(x, [mlp.gate_proj, mlp.up_proj])
        return self._fan_in(F.silu(gate) * up, mlp.down_proj)

    def forward(self, inputs: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        hidden, mask, cos, sin = inputs
        ctx, batch = self.tp, hidden.shape[0]
        layout: Layout = "sharded" if self.memory else "replicated"
        h = enter(hidden, ctx, layout, type(self).__name__)
        m, c, s = (gather_samples(t, ctx, batch) for t in (mask, cos, sin))
        h = h + self._attention(self.input_layernorm(h), m, c, s)
        h = h + self._mlp(self.post_attention_layernorm(h))
        return leave(h, ctx, layout)


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


def _causal(n: int, s: int, like: Tensor) -> Tensor:
    keep = torch.ones(s, s, dtype=torch.bool, device=like.device).tril()
    return (
        torch.zeros(s, s, dtype=like.dtype, device=like.device)
        .masked_fill(~keep, torch.finfo(like.dtype).min)
        .expand(n, 1, s, s)
    )


def forward_hook(  # noqa: PLR0917
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """LlamaDecoderLayer's call -> ``((hidden, additive_mask, cos, sin),)``.

    Hugging Face passes None for a plain causal mask (SDPA, no padding), a bool mask (True = attend) or
    an additive one; each becomes an additive ``[N, 1, S, S]`` mask, the same on every rank.
    """
    for kv in (cache, past_key_values):
        length = getattr(kv, "get_seq_length", None)
        if callable(length) and length() > 0:
            raise TPInputError(
                "the distributed Llama layer got a non-empty key/value cache; incremental decoding is not "
                "supported by tensor-parallel blocks. Call the model with use_cache=False."
            )
    if position_embeddings is None:
        raise TPInputError("the distributed Llama layer needs position_embeddings (cos, sin) from the model.")
    n, s = hidden_states.shape[0], hidden_states.shape[1]
    mask = attention_mask
    if mask is None:
        mask = _causal(n, s, hidden_states)
    elif mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=hidden_states.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(hidden_states.dtype).min
        )
    mask = mask.to(hidden_states.dtype).expand(n, 1, s, mask.shape[-1]).contiguous()
    cos, sin = (t.expand(n, *t.shape[1:]).contiguous() for t in position_embeddings)
    return ((hidden_states, mask, cos, sin),), {}


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    new = DistributedLlamaLayer(**_kwargs(layer), tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    new.set_call_hooks(forward_hook, None)
    return new


def registrations() -> list[Registration]:
    return [Registration(name, DistributedLlamaLayer, builder=build, check=check) for name in BLOCKS]
