"""Primitives for writing a distributed module (smp's ``smp.nn.utils``; docs/tensor.md).

.. code-block:: python

    class MyColumnLinear(DistributedModule):
        def __init__(self, d_in, d_out):
            super().__init__()
            with parameter_creation_scope(self, scaled_batch=True):
                with initialize_with_output_partition(self):
                    self.lin = nn.Linear(d_in, d_out // self.tp_size)

Parameters created inside :func:`parameter_creation_scope` get a :class:`ParamSpec` (which drives the
data-parallel gradient reduction and the state-dict gather) and the context's dtype (fp16_params).
``nn.Linear`` modules created inside a partition scope are re-initialized as this rank's slice of the
full-size layer, so the distributed layer is initialized like the non-distributed one (same fan-in,
same random draws given the same seed on every TP rank). Other parameters created in a partition scope
are only marked: split along their last dimension (input partition, when they have 2 or more
dimensions) or their first (output partition).

smp's communication primitives are re-exported here from :mod:`mp_tensor.dist_ops`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from mp_tensor.dist_ops import (
    bwd_allreduce_for_tp,
    fused_allgather_for_tp,
    fwd_allreduce_for_tp,
    reduce_scatter_for_tp,
    scatter_and_merge_for_tp,
)
from mp_tensor.nn.base import (
    DistributedModule,
    ParamInit,
    ParamSpec,
    param_spec,
    set_param_init,
    set_param_spec,
)

__all__ = [
    "bwd_allreduce_for_tp",
    "full_linear_bias",
    "full_linear_weight",
    "fused_allgather_for_tp",
    "fwd_allreduce_for_tp",
    "initialize_with_input_partition",
    "initialize_with_output_partition",
    "parameter_creation_scope",
    "reduce_scatter_for_tp",
    "scatter_and_merge_for_tp",
]


@dataclass(frozen=True)
class _Creation:
    scaled_batch: bool
    dtype: torch.dtype | None
    use_normal: bool
    initializer_range: float


_creation: contextvars.ContextVar[_Creation | None] = contextvars.ContextVar(
    "mp_tensor_creation", default=None
)


def full_linear_weight(
    out_features: int, in_features: int, *, use_normal: bool = False, initializer_range: float = 0.02
) -> Tensor:
    """A full ``[out, in]`` weight initialized as ``nn.Linear`` does, or from N(0, initializer_range)."""
    w = torch.empty(out_features, in_features)
    if use_normal:
        return w.normal_(0.0, initializer_range)
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    return w.uniform_(-bound, bound)  # nn.Linear's kaiming_uniform_(a=sqrt(5)) has exactly this bound


def full_linear_bias(out_features: int, fan_in: int, *, use_normal: bool = False) -> Tensor:
    """A full ``[out]`` bias initialized as ``nn.Linear`` does (zeros under normal initialization)."""
    b = torch.empty(out_features)
    if use_normal:
        return b.zero_()
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return b.uniform_(-bound, bound)


@contextlib.contextmanager
def parameter_creation_scope(
    module: DistributedModule,
    scaled_batch: bool = True,
    dtype: torch.dtype | None = None,
    use_normal: bool = False,
    initializer_range: float = 0.02,
) -> Iterator[None]:
    """Create the parameters of ``module`` inside this block.

    ``scaled_batch``: the parameters touch the batch exchanged within the TP group (their gradients are
    reduced over the reduced-data-parallel group). ``dtype`` (default: the context's, i.e.
    fp16_params) is applied to the new parameters. ``use_normal`` re-initializes new weights with
    N(0, ``initializer_range``) and biases with zeros.
    """
    before = {id(p) for p in module.parameters()}
    token = _creation.set(_Creation(scaled_batch, dtype, use_normal, initializer_range))
    try:
        yield
    finally:
        _creation.reset(token)
    target = dtype if dtype is not None else module.tp.dtype
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in before:
                continue
            spec = param_spec(p)
            if spec is None and use_normal:
                if p.dim() >= 2:
                    p.normal_(0.0, initializer_range)
                    init = ParamInit(tuple(p.shape), "normal", initializer_range, None, 0, 1)
                    set_param_init(p, init)  # drawn again by delayed initialization
                elif name.endswith("bias"):
                    p.zero_()
                    set_param_init(p, ParamInit(tuple(p.shape), "zero", 0.0, None, 0, 1))
            split = None if spec is None else spec.split_dim
            set_param_spec(p, ParamSpec(split_dim=split, scaled_batch=scaled_batch))
            if target is not None and p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)


def _partition(
    module: DistributedModule, kind: Literal["input", "output"]
) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        before_params = {id(p) for p in module.parameters()}
        before_modules = {id(m) for m in module.modules()}
        yield
        creation = _creation.get()
        use_normal = creation.use_normal if creation else False
        init_range = creation.initializer_range if creation else 0.02
        scaled = creation.scaled_batch if creation else True
        n, r = module.tp.size, module.tp.rank
        with torch.no_grad():
            for sub in module.modules():
                if id(sub) in before_modules or not isinstance(sub, nn.Linear):
                    continue
                out_l, in_l = sub.weight.shape
                _remember_linear_init(sub, kind, n, r, use_normal=use_normal, init_range=init_range)
                if kind == "input":
                    w = full_linear_weight(
                        out_l, in_l * n, use_normal=use_normal, initializer_range=init_range
                    )
                    sub.weight.copy_(w.narrow(1, r * in_l, in_l))
                    set_param_spec(sub.weight, ParamSpec(1, scaled))
                    if sub.bias is not None:
                        sub.bias.copy_(full_linear_bias(out_l, in_l * n, use_normal=use_normal))
                        set_param_spec(sub.bias, ParamSpec(None, scaled))
                else:
                    w = full_linear_weight(
                        out_l * n, in_l, use_normal=use_normal, initializer_range=init_range
                    )
                    sub.weight.copy_(w.narrow(0, r * out_l, out_l))
                    set_param_spec(sub.weight, ParamSpec(0, scaled))
                    if sub.bias is not None:
                        b = full_linear_bias(out_l * n, in_l, use_normal=use_normal)
                        sub.bias.copy_(b.narrow(0, r * out_l, out_l))
                        set_param_spec(sub.bias, ParamSpec(0, scaled))
            for p in module.parameters():
                if id(p) in before_params or param_spec(p) is not None:
                    continue
                if kind == "input":
                    split = p.dim() - 1 if p.dim() >= 2 else None
                else:
                    split = 0 if p.dim() >= 1 else None
                set_param_spec(p, ParamSpec(split, scaled))

    return scope()


def _remember_linear_init(
    sub: nn.Linear, kind: str, n: int, r: int, *, use_normal: bool, init_range: float
) -> None:
    """The draws of a partitioned ``nn.Linear``'s slices (below), for delayed initialization."""
    out_l, in_l = sub.weight.shape
    out_f, in_f = (out_l, in_l * n) if kind == "input" else (out_l * n, in_l)
    bound = 1.0 / math.sqrt(in_f) if in_f > 0 else 0.0
    split = 1 if kind == "input" else 0
    w_kind, w_scale = ("normal", init_range) if use_normal else ("uniform", bound)
    set_param_init(sub.weight, ParamInit((out_f, in_f), w_kind, w_scale, split, r, n))
    if sub.bias is not None:
        b_kind = "zero" if use_normal else "uniform"
        set_param_init(sub.bias, ParamInit((out_f,), b_kind, bound, None if kind == "input" else 0, r, n))


def initialize_with_input_partition(module: DistributedModule) -> contextlib.AbstractContextManager[None]:
    """Parameters created inside are split over the TP ranks along their input channels."""
    return _partition(module, "input")


def initialize_with_output_partition(module: DistributedModule) -> contextlib.AbstractContextManager[None]:
    """Parameters created inside are split over the TP ranks along their output channels."""
    return _partition(module, "output")
