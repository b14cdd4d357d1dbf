"""Autograd-aware collectives over an explicit process group.

These are the communication primitives of smp's distributed modules (``smp.nn.utils``) and of tensor
parallelism in general; each is a ``torch.autograd.Function`` whose backward is the collective the
chain rule asks for. The group is always an argument, never a global:

============================  ====================================  =====================================
function                      forward                               backward
============================  ====================================  =====================================
``all_reduce``                sum over the group (Megatron's *g*)   identity, or all-reduce (``grad=``)
``all_reduce_backward``       identity (Megatron's *f*)             all-reduce
``all_gather(dim)``           concatenate every rank's tensor       slice, or reduce-scatter (``grad=``)
``reduce_scatter(dim)``       sum, keep this rank's slice           all-gather
``split(dim)``                keep this rank's slice                all-gather
``all_to_all(split, concat)`` chunk ``split`` out, concat received  the inverse all-to-all
============================  ====================================  =====================================

Which backward is right depends on who consumes the output. A *replicated* consumer (every rank runs
the same computation on the same tensor and the loss counts it once) hands back the full gradient on
every rank, so the all-reduce backward is the identity and the all-gather backward a slice. A *sharded*
consumer (each rank computes something different from it) hands back a partial gradient per rank,
so those backwards must sum: ``grad="all_reduce"`` and ``grad="reduce_scatter"``.

The ``*_async`` variants launch the forward collective with ``async_op=True`` and return a
:class:`CollectiveHandle`; ``handle.wait()`` gives the output (part of the autograd graph) once it has
arrived, so computation issued in between overlaps the communication.

How they run (MPI for CPU tensors where the group has an MPI twin, else torch.distributed; fallbacks
for operations a backend lacks; waits registered for hang reports): :mod:`mp_comm.collectives_raw`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from mp_comm.collectives_raw import (
    FALLBACK_OPS,
    CollectiveHandle,
    _raw_all_gather,
    _raw_all_reduce,
    _raw_all_to_all,
    _raw_reduce_scatter,
    _unsupported,  # noqa: F401  (re-exported: tests reset it)
    all_reduce_,
    broadcast_,
    group_rank,
    group_size,
    use_fallback,
)
from mp_comm.errors import CollectiveError
from mp_comm.waits import collective_wait

__all__ = [
    "FALLBACK_OPS",
    "CollectiveHandle",
    "all_gather",
    "all_gather_async",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async",
    "all_reduce_backward",
    "all_to_all",
    "all_to_all_async",
    "broadcast_",
    "collective_wait",
    "group_rank",
    "group_size",
    "reduce_scatter",
    "reduce_scatter_async",
    "split",
    "use_fallback",
]

# ------------------------------------------------------------------------------------------ checks


def _dim(x: Tensor, dim: int, op: str) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise CollectiveError(
            f"{op}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}; "
            f"pass a dim in [{-x.dim()}, {x.dim() - 1}]."
        )
    return dim % x.dim()


def _chunk(x: Tensor, dim: int, n: int, op: str) -> int:
    size = x.shape[dim]
    if size % n:
        raise CollectiveError(
            f"{op}: dim {dim} of the tensor of shape {tuple(x.shape)} has size {size}, which the group "
            f"size {n} does not divide; pad dim {dim} to a multiple of {n} or use a group whose size "
            "divides it."
        )
    return size // n


# ----------------------------------------------------------------------------- autograd Functions


@dataclass(eq=False)
class _Call:
    """The non-tensor arguments of one collective call; carries an async forward's handle back out."""

    group: dist.ProcessGroup
    dim: int = 0
    dim2: int = 0  # all_to_all: the concat dim
    grad: str = ""
    size: int = 0  # split: the slice length
    is_async: bool = False
    handle: CollectiveHandle | None = None

    def launch(self, handle: CollectiveHandle) -> Tensor:
        if not self.is_async:
            return handle.wait()
        self.handle = handle
        return handle.pending_result


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Call) -> Tensor:
        ctx.call = call
        return call.launch(_raw_all_reduce(x, call.group, call.is_async))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        if ctx.call.grad == "identity":
            return g, None
        return _raw_all_reduce(g, ctx.call.group, False).wait(), None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Call) -> Tensor:
        ctx.call = call
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        return _raw_all_reduce(g, ctx.call.group, False).wait(), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Call) -> Tensor:
        ctx.call, ctx.size = call, x.shape[call.dim]
        return call.launch(_raw_all_gather(x, call.dim, call.group, call.is_async))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        call: _Call = ctx.call
        if call.grad == "slice":
            return g.narrow(call.dim, group_rank(call.group) * ctx.size, ctx.size).contiguous(), None
        return _raw_reduce_scatter(g, call.dim, call.group, False).wait(), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Call) -> Tensor:
        ctx.call = call
        return call.launch(_raw_reduce_scatter(x, call.dim, call.group, call.is_async))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        return _raw_all_gather(g, ctx.call.dim, ctx.call.group, False).wait(), None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Call) -> Tensor:
        ctx.call = call
        start = group_rank(call.group) * call.size
        return x.narrow(call.dim, start, call.size).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        return _raw_all_gather(g, ctx.call.dim, ctx.call.group, False).wait(), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Call) -> Tensor:
        ctx.call = call
        return call.launch(_raw_all_to_all(x, call.dim, call.dim2, call.group, call.is_async))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        call: _Call = ctx.call
        return _raw_all_to_all(g, call.dim2, call.dim, call.group, False).wait(), None


def _apply(function: type[torch.autograd.Function], x: Tensor, call: _Call) -> Tensor:
    out: Tensor = function.apply(x, call)  # type: ignore[no-untyped-call]
    return out


# ------------------------------------------------------------------------------------- public API

AllReduceGrad = Literal["identity", "all_reduce"]
AllGatherGrad = Literal["slice", "reduce_scatter"]


def _mode(value: str, allowed: tuple[str, ...], op: str) -> str:
    if value not in allowed:
        raise CollectiveError(f"{op}: grad={value!r} is not one of {allowed}; pass one of them.")
    return value


def _all_reduce(x: Tensor, call: _Call) -> Tensor:
    _mode(call.grad, ("identity", "all_reduce"), "all_reduce")
    return x if group_size(call.group) == 1 else _apply(_AllReduce, x, call)


def all_reduce(x: Tensor, group: dist.ProcessGroup, *, grad: AllReduceGrad = "identity") -> Tensor:
    """Sum ``x`` over ``group``. Backward: identity (replicated consumers) or all-reduce (sharded ones)."""
    return _all_reduce(x, _Call(group, grad=grad))


def all_reduce_backward(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Identity in forward; sums the gradient over ``group`` in backward (smp's ``bwd_allreduce_for_tp``).

    The output is a view of ``x`` made inside a custom Function: clone it before modifying it in place.
    """
    return x if group_size(group) == 1 else _apply(_AllReduceBackward, x, _Call(group))


def _all_gather(x: Tensor, call: _Call) -> Tensor:
    call.dim = _dim(x, call.dim, "all_gather")
    _mode(call.grad, ("slice", "reduce_scatter"), "all_gather")
    return x if group_size(call.group) == 1 else _apply(_AllGather, x, call)


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup, *, grad: AllGatherGrad = "slice") -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order (smp's ``fused_allgather_for_tp``).

    Backward: this rank's slice of the gradient (replicated consumers) or the reduce-scatter of it
    (sharded consumers, as after a sequence-parallel gather).
    """
    return _all_gather(x, _Call(group, dim=dim, grad=grad))


def _reduce_scatter(x: Tensor, call: _Call) -> Tensor:
    call.dim = _dim(x, call.dim, "reduce_scatter")
    n = group_size(call.group)
    _chunk(x, call.dim, n, "reduce_scatter")
    return x if n == 1 else _apply(_ReduceScatter, x, call)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Sum ``x`` over ``group`` and keep this rank's slice along ``dim``; backward all-gathers."""
    return _reduce_scatter(x, _Call(group, dim=dim))


def split(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Keep this rank's slice of ``x`` along ``dim`` (no communication); backward all-gathers."""
    dim = _dim(x, dim, "split")
    n = group_size(group)
    size = _chunk(x, dim, n, "split")
    return x if n == 1 else _apply(_Split, x, _Call(group, dim=dim, size=size))


def _all_to_all(x: Tensor, call: _Call) -> Tensor:
    call.dim = _dim(x, call.dim, "all_to_all")
    call.dim2 = _dim(x, call.dim2, "all_to_all")
    n = group_size(call.group)
    _chunk(x, call.dim, n, "all_to_all")
    return x if n == 1 else _apply(_AllToAll, x, call)


def all_to_all(x: Tensor, split_dim: int, concat_dim: int, group: dist.ProcessGroup) -> Tensor:
    """Send slice k of ``x`` along ``split_dim`` to rank k; concatenate what arrives along ``concat_dim``.

    smp's ``scatter_and_merge_for_tp``. Backward is the inverse all-to-all (the dims swapped).
    """
    return _all_to_all(x, _Call(group, dim=split_dim, dim2=concat_dim))


def _async(run: Callable[[Tensor, _Call], Tensor], x: Tensor, call: _Call) -> CollectiveHandle:
    call.is_async = True
    out = run(x, call)
    if call.handle is None:  # a group of one: nothing to wait for
        return CollectiveHandle(out)
    return call.handle.with_result(out)


def all_reduce_async(
    x: Tensor, group: dist.ProcessGroup, *, grad: AllReduceGrad = "identity"
) -> CollectiveHandle:
    """:func:`all_reduce`, launched without waiting; ``handle.wait()`` returns its output."""
    return _async(_all_reduce, x, _Call(group, grad=grad))


def all_gather_async(
    x: Tensor, dim: int, group: dist.ProcessGroup, *, grad: AllGatherGrad = "slice"
) -> CollectiveHandle:
    """:func:`all_gather`, launched without waiting; ``handle.wait()`` returns its output."""
    return _async(_all_gather, x, _Call(group, dim=dim, grad=grad))


def reduce_scatter_async(x: Tensor, dim: int, group: dist.ProcessGroup) -> CollectiveHandle:
    """:func:`reduce_scatter`, launched without waiting; ``handle.wait()`` returns its output."""
    return _async(_reduce_scatter, x, _Call(group, dim=dim))


def all_to_all_async(
    x: Tensor, split_dim: int, concat_dim: int, group: dist.ProcessGroup
) -> CollectiveHandle:
    """:func:`all_to_all`, launched without waiting; ``handle.wait()`` returns its output."""
    return _async(_all_to_all, x, _Call(group, dim=split_dim, dim2=concat_dim))
