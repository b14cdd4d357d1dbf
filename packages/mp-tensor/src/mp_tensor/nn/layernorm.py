"""``DistributedLayerNorm`` and layer normalization of a channel-sharded activation.

Layer normalization is element-wise once the mean and variance are known, so on an activation whose
channels are split over the TP ranks each rank computes the local first and second moments
(``sum x``, ``sum x^2`` per token), one all-reduce of those two numbers per token gives the global
mean and variance, and each rank normalizes its own channels with its slice of the affine weights.
In backward, one all-reduce of two per-token sums of the gradient does the same for the input's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import enter, leave
from mp_tensor.errors import DistTransformerConfigError
from mp_tensor.nn.base import DistributedModule, ParamSpec, set_param_spec

__all__ = ["DistributedLayerNorm", "LayerNormShard", "sharded_layer_norm"]


class _ShardedLayerNorm(torch.autograd.Function):
    """Layer norm over channels split across the TP group; saves only the input and the statistics."""

    @staticmethod
    def forward(  # noqa: PLR0917
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, n: int, group: Any
    ) -> Tensor:
        xf = x.float()
        moments = torch.stack((xf.sum(-1), (xf * xf).sum(-1)), dim=-1)
        col.all_reduce_(moments, group)  # MPI's where the group has a twin (faster than gloo's)
        mean = (moments[..., 0] / n).unsqueeze(-1)
        rstd = torch.rsqrt(((moments[..., 1] / n).unsqueeze(-1) - mean * mean).clamp_min(0.0) + eps)
        y = ((xf - mean) * rstd).to(x.dtype)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.n, ctx.group, ctx.has_bias = n, group, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x.float() - mean) * rstd
        dyf = dy.float()
        dxhat = dyf * weight.float() if weight is not None else dyf
        sums = torch.stack(((dxhat).sum(-1), (dxhat * xhat).sum(-1)), dim=-1)
        col.all_reduce_(sums, ctx.group)
        n = ctx.n
        dx = rstd * (dxhat - (sums[..., 0] / n).unsqueeze(-1) - xhat * (sums[..., 1] / n).unsqueeze(-1))
        reduce_dims = tuple(range(dy.dim() - 1))
        dweight = (dyf * xhat).sum(reduce_dims).to(weight.dtype) if weight is not None else None
        dbias = dyf.sum(reduce_dims).to(dy.dtype) if ctx.has_bias else None
        return dx.to(x.dtype), dweight, dbias, None, None, None


def sharded_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, *, eps: float, full_size: int, ctx: TPContext
) -> Tensor:
    """Layer-normalize the last dimension of ``x``, which holds this rank's ``full_size / tp`` channels.

    One all-reduce of the per-token moments forward, one of the per-token gradient sums backward; only
    the input and the per-token statistics are kept for backward.
    """
    if not ctx.distributed:
        return F.layer_norm(x, (full_size,), weight, bias, eps)
    assert ctx.group is not None
    out: Tensor = _ShardedLayerNorm.apply(x, weight, bias, eps, full_size, ctx.group)  # type: ignore[no-untyped-call]
    return out


class LayerNormShard(nn.Module):
    """The affine weights of a layer norm over ``size`` channels: this rank's slice (``sharded``) or all."""

    def __init__(
        self, tp: TPContext, size: int, eps: float, *, sharded: bool, scaled_batch: bool = True
    ) -> None:
        super().__init__()
        local = size // tp.size if sharded else size
        self.full_size, self.eps, self.sharded = size, eps, sharded
        self.weight = nn.Parameter(torch.ones(local, dtype=tp.dtype))
        self.bias = nn.Parameter(torch.zeros(local, dtype=tp.dtype))
        for p in (self.weight, self.bias):
            set_param_spec(p, ParamSpec(0 if sharded else None, scaled_batch))

    def apply_to(self, x: Tensor, ctx: TPContext) -> Tensor:
        """Normalize ``x`` (sharded channels when ``sharded``, else every channel)."""
        if self.sharded:
            return sharded_layer_norm(
                x, self.weight, self.bias, eps=self.eps, full_size=self.full_size, ctx=ctx
            )
        return F.layer_norm(x, (self.full_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.full_size}, eps={self.eps}, sharded={self.sharded}"


class DistributedLayerNorm(DistributedModule):
    """Tensor-parallel ``nn.LayerNorm`` over the last dimension; its full state dict is ``nn.LayerNorm``'s.

    The input is moved to the ``sharded`` layout (an all-to-all, or a slice with ``prescaled_batch``),
    normalized with one all-reduce of the moments, and moved back.
    """

    def __init__(
        self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, *, tp: TPContext | None = None
    ) -> None:
        super().__init__(tp=tp)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise DistTransformerConfigError(
                f"DistributedLayerNorm got normalized_shape={shape}; only the last dimension can be "
                "distributed. Pass a single int."
            )
        if shape[0] % self.tp_size:
            raise DistTransformerConfigError(
                f"DistributedLayerNorm got normalized_shape={shape[0]}, which the tensor-parallel degree "
                f"{self.tp_size} does not divide; use a multiple of {self.tp_size}."
            )
        self.normalized_shape, self.eps = shape, eps
        norm = LayerNormShard(self.tp, shape[0], eps, sharded=True)
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: Tensor) -> Tensor:
        xs = enter(x, self.tp, "sharded", "DistributedLayerNorm")
        y = sharded_layer_norm(
            xs, self.weight, self.bias, eps=self.eps, full_size=self.normalized_shape[0], ctx=self.tp
        )
        return leave(y, self.tp, "sharded")

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, " + super().extra_repr()
