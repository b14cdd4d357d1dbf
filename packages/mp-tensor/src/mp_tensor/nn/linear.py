"""``DistributedLinear`` (docs/tensor.md) and ``LinearShard``, the parameter holder of the other modules.

DistributedLinear splits the weight ``W = [W_1 ... W_T]`` along its input channels. By default each
tp_rank holds different samples: rank i slices its input by channels and sends slice j to rank j
(all-to-all), rank j applies ``W_j`` to the slices of every rank's samples, and a reduce-scatter over the
sample dimension sums the partial outputs and returns each rank its own samples. With
``prescaled_batch`` every rank holds the same batch: it slices its channels, applies ``W_j`` and an
all-reduce sums the partial outputs. The bias is added to the reduced output; every rank holds it.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import check_batch
from mp_tensor.errors import DistTransformerConfigError
from mp_tensor.nn.base import DistributedModule, ParamInit, ParamSpec, set_param_init, set_param_spec
from mp_tensor.nn.utils import full_linear_bias, full_linear_weight

__all__ = ["DistributedLinear", "LinearShard"]


class LinearShard(nn.Module):
    """This rank's shard of the ``weight [out, in]`` and ``bias [out]`` of a linear map.

    ``weight_split``/``bias_split``: the dimension split over the TP ranks (None: held whole). The
    shards are cut from a full tensor initialized like ``nn.Linear`` (or from N(0, initializer_range)),
    so all TP ranks must draw from the same random state. The owner applies them with ``F.linear``.
    """

    def __init__(
        self,
        tp: TPContext,
        out_features: int,
        in_features: int,
        *,
        weight_split: int | None,
        bias: bool = True,
        bias_split: int | None = None,
        use_normal: bool = False,
        initializer_range: float = 0.02,
        scaled_batch: bool = True,
        bias_scaled_batch: bool | None = None,
    ) -> None:
        super().__init__()
        n, r = tp.size, tp.rank
        full_w = full_linear_weight(
            out_features, in_features, use_normal=use_normal, initializer_range=initializer_range
        )
        if weight_split is not None:
            size = full_w.shape[weight_split] // n
            full_w = full_w.narrow(weight_split, r * size, size)
        self.weight = nn.Parameter(full_w.clone().to(tp.dtype or full_w.dtype))
        set_param_spec(self.weight, ParamSpec(weight_split, scaled_batch))
        # the same draws again, for delayed initialization (mp_memory.delayed_init materializes shards)
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        kind, scale = ("normal", initializer_range) if use_normal else ("uniform", bound)
        set_param_init(self.weight, ParamInit((out_features, in_features), kind, scale, weight_split, r, n))
        self.bias: nn.Parameter | None = None
        if bias:
            full_b = full_linear_bias(out_features, in_features, use_normal=use_normal)
            if bias_split is not None:
                size = out_features // n
                full_b = full_b.narrow(0, r * size, size)
            self.bias = nn.Parameter(full_b.clone().to(tp.dtype or full_b.dtype))
            set_param_spec(
                self.bias,
                ParamSpec(bias_split, scaled_batch if bias_scaled_batch is None else bias_scaled_batch),
            )
            kind = "zero" if use_normal else "uniform"
            set_param_init(self.bias, ParamInit((out_features,), kind, bound, bias_split, r, n))

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, bias={self.bias is not None}"


def _one_size(torch_name: str, torch_value: int | None, smp_name: str, smp_value: int | None) -> int:
    """One size given under torch's name or smp's (not both, unless equal)."""
    if torch_value is None and smp_value is None:
        raise TypeError(f"DistributedLinear needs {torch_name} (smp's name: {smp_name}); pass the size.")
    if torch_value is not None and smp_value is not None and torch_value != smp_value:
        raise TypeError(
            f"DistributedLinear got {torch_name}={torch_value} and {smp_name}={smp_value}, two names for "
            "one size; pass only one of them."
        )
    return int(torch_value if torch_value is not None else smp_value)  # type: ignore[arg-type]


class DistributedLinear(DistributedModule):
    """Tensor-parallel ``nn.Linear``: ``in_features`` and ``out_features`` are the global sizes.

    Its full state dict is that of ``nn.Linear(in_features, out_features, bias)``. smp's keyword names
    ``input_features``/``output_features`` are accepted for the same two sizes.
    """

    def __init__(
        self,
        in_features: int | None = None,
        out_features: int | None = None,
        bias: bool = True,
        *,
        input_features: int | None = None,
        output_features: int | None = None,
        tp: TPContext | None = None,
    ) -> None:
        in_features = _one_size("in_features", in_features, "input_features", input_features)
        out_features = _one_size("out_features", out_features, "output_features", output_features)
        super().__init__(tp=tp)
        if in_features % self.tp_size:
            raise DistTransformerConfigError(
                f"DistributedLinear got in_features={in_features}, which the tensor-parallel degree "
                f"{self.tp_size} does not divide; use a multiple of {self.tp_size} or leave this layer "
                "undistributed."
            )
        self.in_features, self.out_features = in_features, out_features
        shard = LinearShard(
            self.tp,
            out_features,
            in_features,
            weight_split=1,
            bias=bias,
            scaled_batch=True,
            bias_scaled_batch=False,
        )
        self.weight = shard.weight
        self.bias = shard.bias

    def forward(self, x: Tensor) -> Tensor:
        ctx = self.tp
        if not ctx.distributed:
            return F.linear(x, self.weight, self.bias)
        check_batch(x, "DistributedLinear")
        assert ctx.group is not None
        if ctx.prescaled_batch:
            y = col.all_reduce(F.linear(col.split(x, -1, ctx.group), self.weight), ctx.group)
        else:
            xs = col.all_to_all(x, -1, 0, ctx.group)
            y = col.reduce_scatter(F.linear(xs, self.weight), 0, ctx.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + super().extra_repr()
