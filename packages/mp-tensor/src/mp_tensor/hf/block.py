"""What the rotary decoder-block mappings (Llama family, GPT-NeoX) share: a base class holding the two
distributions of a block's projections, its norms, rotary attention, and the HF call hook.

- optimize "speed" (Megatron): activations replicated over the TP group; input projections split by
  output channels (whole heads) behind a backward all-reduce, output projections split by input
  channels followed by a forward all-reduce.
- optimize "memory": activations split by channels (the ``sharded`` layout of the transformer modules);
  every projection split by its input channels, its outputs reduce-scattered (the projections reading
  one input share a reduce-scatter); norms all-reduce one or two numbers per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
from mp_tensor.nn.rank_major import linear_reduce_scatter

__all__ = ["MegatronBlock", "Norm", "forward_hook", "rotate"]


class Norm(nn.Module):
    """Hugging Face's RMSNorm (``rms=True``, statistics in fp32) or ``nn.LayerNorm``: replicated, or with
    ``tp`` split over the channels (the per-token sums all-reduced over the group)."""

    def __init__(
        self, hidden: int, eps: float, dtype: torch.dtype | None, rms: bool, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        self.tp, self.hidden, self.eps, self.rms = tp, hidden, eps, rms
        local = hidden // tp.size if tp is not None else hidden
        spec = ParamSpec(None if tp is None else 0, scaled_batch=True)
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype))
        set_param_spec(self.weight, spec)
        self.bias: nn.Parameter | None = None
        if not rms:
            self.bias = nn.Parameter(torch.zeros(local, dtype=dtype))
            set_param_spec(self.bias, spec)

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        """The norm with ``weight`` standing for this module's (a view with its own backward)."""
        group = self.tp.group if self.tp is not None else None
        if not self.rms and group is None:
            return F.layer_norm(x, (self.hidden,), weight, self.bias, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        sums = squares if self.rms else torch.cat((h.sum(-1, keepdim=True), squares), -1)
        if group is not None:
            sums = col.all_reduce(sums, group, grad="all_reduce")
        if self.rms:
            h = h * torch.rsqrt(sums / self.hidden + self.eps)
            return weight * h.to(dtype)
        mean, square = (sums / self.hidden).unbind(-1)
        h = (h - mean.unsqueeze(-1)) * torch.rsqrt(square - mean.pow(2) + self.eps).unsqueeze(-1)
        out = h.to(dtype) * weight
        return out if self.bias is None else out + self.bias


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Hugging Face's rotary embedding of ``x [N, heads, S, d]`` on its first ``cos.shape[-1]`` channels."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    dim = c.shape[-1]
    if dim == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * c + _rotate_half(rot) * s, rest), dim=-1)


class MegatronBlock(DistributedModule):
    """Base of the rotary decoder blocks: the two distributions (see the module doc) of projections
    built with :meth:`linear_in` / :meth:`linear_out`, applied with :meth:`project` / :meth:`fan_in`."""

    def __init__(self, *, tp: TPContext | None = None, **sizes: int) -> None:
        super().__init__(tp=tp)
        self.memory = self.tp.distributed and self.tp.optimize == "memory"
        hidden = sizes.pop("hidden_size")
        if self.memory:
            sizes["hidden_size"] = hidden
        reason = sizes_reason(self.tp_size, **sizes)
        if reason is not None:
            raise DistTransformerConfigError(
                f"{type(self).__name__}: {reason}; use a multiple of {self.tp_size}."
            )

    def linear_in(self, out: int, inp: int, bias: bool) -> LinearShard:
        """A projection reading the block's (normalized) activations: split by outputs (speed) or inputs."""
        return LinearShard(self.tp, out, inp, weight_split=1 if self.memory else 0, bias=bias, bias_split=0)

    def linear_out(self, out: int, inp: int, bias: bool) -> LinearShard:
        """A projection writing the block's activations: split by inputs."""
        return LinearShard(
            self.tp, out, inp, weight_split=1, bias=bias, bias_split=0 if self.memory else None
        )

    def norm(self, hidden: int, eps: float, rms: bool) -> Norm:
        return Norm(hidden, eps, self.tp.dtype, rms, self.tp if self.memory else None)

    @property
    def group(self) -> Any:
        return self.tp.group if self.tp.distributed else None

    def fan_out(self, x: Tensor) -> Tensor:
        """Megatron's f: identity forward, gradient summed over the TP group backward."""
        return x if self.group is None else col.all_reduce_backward(x, self.group)

    def project(self, x: Tensor, shards: list[LinearShard]) -> list[Tensor]:
        """``x`` through each of ``shards``: this rank's output channels of each (speed: the
        split-by-output weights; memory: partial sums over the input slices, reduce-scattered at once)."""
        group = self.group
        if not self.memory or group is None:
            x = self.fan_out(x)
            return [F.linear(x, p.weight, p.bias) for p in shards]
        # one reduce-scatter serves every output (mp_tensor.nn.rank_major)
        mine = linear_reduce_scatter([(x, p.weight) for p in shards], group)
        return [m if p.bias is None else m + p.bias for m, p in zip(mine, shards, strict=True)]

    def fan_in(self, x: Tensor, proj: LinearShard) -> Tensor:
        """Megatron's g: the partial outputs of ``proj`` summed over the group (reduce-scattered over the
        channels in memory mode), then its bias."""
        group = self.group
        if self.memory:
            (y,) = linear_reduce_scatter([(x, proj.weight)], group)
        else:
            y = F.linear(x, proj.weight)
            y = y if group is None else col.all_reduce(y, group)
        return y if proj.bias is None else y + proj.bias

    def fan_in_sum(self, pairs: list[tuple[Tensor, LinearShard]]) -> Tensor:
        """:meth:`fan_in` of several projections whose outputs are added (a parallel attention + MLP
        block): the partial sums are added first, so the block reduces once."""
        if self.memory:
            (y,) = linear_reduce_scatter([(x, p.weight) for x, p in pairs], self.group, [0] * len(pairs))
        else:
            y = sum((F.linear(x, p.weight) for x, p in pairs[1:]), F.linear(pairs[0][0], pairs[0][1].weight))
            y = y if self.group is None else col.all_reduce(y, self.group)
        for _, p in pairs:
            y = y if p.bias is None else y + p.bias
        return y

    def run(
        self, inputs: tuple[Tensor, Tensor, Tensor | None, Tensor | None], body: Callable[..., Tensor]
    ) -> Tensor:
        """``body(h, mask, cos, sin)`` on the working layout, from and back to this rank's samples
        (``cos``/``sin`` None for blocks without rotary embeddings)."""
        hidden, mask, cos, sin = inputs
        ctx, batch = self.tp, hidden.shape[0]
        layout: Layout = "sharded" if self.memory else "replicated"
        h = enter(hidden, ctx, layout, type(self).__name__)
        m, c, s = (gather_samples(t, ctx, batch) for t in (mask, cos, sin))
        return leave(body(h, m, c, s), ctx, layout)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA of ``q [N, H, S, d]`` over ``k, v [N, H_kv, S, d]`` (grouped-query heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _causal(n: int, s: int, like: Tensor) -> Tensor:
    keep = torch.ones(s, s, dtype=torch.bool, device=like.device).tril()
    zeros = torch.zeros(s, s, dtype=like.dtype, device=like.device)
    return zeros.masked_fill(~keep, torch.finfo(like.dtype).min).expand(n, 1, s, s)


def forward_hook(  # noqa: PLR0917
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    past_key_values: Any = None,
    layer_past: Any = None,
    **kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A rotary decoder layer's call -> ``((hidden, additive_mask, cos, sin),)``.

    Hugging Face passes None for a plain causal mask (SDPA, no padding), a bool mask (True = attend) or
    an additive one; each becomes an additive ``[N, 1, S, S]`` mask, the same on every rank.
    """
    for kv in (cache, past_key_values, layer_past):
        length = getattr(kv, "get_seq_length", None)
        if callable(length) and length() > 0:
            raise TPInputError(
                "a tensor-parallel decoder block got a non-empty key/value cache; incremental decoding is "
                "not supported by tensor-parallel blocks. Call the model with use_cache=False."
            )
    if position_embeddings is None:
        raise TPInputError(
            "a tensor-parallel rotary block needs position_embeddings (cos, sin) from the model."
        )
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
