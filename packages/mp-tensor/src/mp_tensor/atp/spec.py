"""Sharding specs (ATP §3.1): one placement per mesh axis, ``Shard(dim)``, ``Replicate()`` or ``Partial(op)``.

A spec ``[P1, ..., Pn]`` binds placements to the axes of ``DeviceMesh(d1, ..., dn)``, not to tensor dims
(the paper's choice, after PyTorch's distributed tensor): axis 1 places the global tensor over its
``d1`` coordinates, then axis 2 places each of those pieces over ``d2``, and so on. ``[Shard(1),
Shard(0)]`` on ``DeviceMesh(2, 2)`` cuts the columns in two for ranks {0, 1} and {2, 3}, then each half's
rows in two. ``Partial(op)`` means the global tensor is the ``op``-reduction of the pieces over that axis.

:func:`shard_tensor` and :func:`unshard_tensors` are pure (a global tensor to one coordinate's piece, and
every coordinate's piece back to the global tensor); :func:`distribute` and :func:`to_global` do the same
on a live mesh, the second collectively and differentiably.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from mp_comm.collectives import all_gather, all_reduce
from mp_comm.waits import collective_wait
from mp_tensor.atp.errors import ShardingError
from mp_tensor.atp.mesh import DeviceMesh, mesh_coords

__all__ = [
    "REDUCE_OPS",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute",
    "local_shape",
    "normalize_spec",
    "shard_tensor",
    "to_global",
    "unshard_tensors",
]

#: The reduction ops a ``Partial`` may name, with their ``torch.distributed.ReduceOp``.
REDUCE_OPS: Mapping[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}


@dataclass(frozen=True)
class Shard:
    """Split the tensor along ``dim`` (negative counts from the end) over the mesh axis."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh axis holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """The global tensor is the ``op``-reduction of the pieces along the mesh axis (an all-reduce away)."""

    op: str = field(default="sum")
    """``"sum"``, ``"product"``, ``"max"``, ``"min"`` or ``"avg"`` (a ``dist.ReduceOp`` is accepted too)."""

    def __post_init__(self) -> None:
        op: object = self.op
        name = op.lower() if isinstance(op, str) else str(op).rsplit(".", 1)[-1].lower()
        if name not in REDUCE_OPS:
            raise ShardingError(f"Partial(op={op!r}) is not one of {sorted(REDUCE_OPS)}; pass one of them.")
        object.__setattr__(self, "op", name)

    def __repr__(self) -> str:
        return f"Partial({self.op})"


Placement = Shard | Replicate | Partial


def normalize_spec(spec: Sequence[Placement], mesh_ndim: int, tensor_ndim: int) -> tuple[Placement, ...]:
    """``spec`` checked against the mesh and tensor ranks, with every ``Shard`` dim made non-negative."""
    placements = tuple(spec)
    if len(placements) != mesh_ndim:
        raise ShardingError(
            f"sharding spec {list(placements)} has {len(placements)} placements but the mesh has "
            f"{mesh_ndim} axes; give one placement per mesh axis."
        )
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, Shard):
            if not -tensor_ndim <= p.dim < tensor_ndim:
                raise ShardingError(
                    f"{p} is out of range for a {tensor_ndim}-d tensor; pass a dim in "
                    f"[{-tensor_ndim}, {tensor_ndim - 1}]."
                )
            out.append(Shard(p.dim % tensor_ndim))
        elif isinstance(p, Replicate | Partial):
            out.append(p)
        else:
            raise ShardingError(f"{p!r} is not a placement; use Shard(dim), Replicate() or Partial(op).")
    return tuple(out)


def _split_size(size: int, parts: int, dim: int, axis: int, shape: Sequence[int]) -> int:
    if size % parts:
        raise ShardingError(
            f"tensor dim {dim} has size {size} at mesh axis {axis}, which its {parts} ranks do not divide "
            f"(global shape {tuple(shape)}); pad dim {dim} to a multiple of {parts} or pick another mesh."
        )
    return size // parts


def local_shape(
    global_shape: Sequence[int], spec: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """The shape of each rank's piece of a tensor of ``global_shape``."""
    shape = list(global_shape)
    for axis, p in enumerate(normalize_spec(spec, len(mesh_shape), len(shape))):
        if isinstance(p, Shard):
            shape[p.dim] = _split_size(shape[p.dim], mesh_shape[axis], p.dim, axis, global_shape)
    return tuple(shape)


def _partial_piece(t: Tensor, op: str, first: bool) -> Tensor:
    """The piece at one coordinate when ``t`` is split into pieces whose ``op``-reduction is ``t``."""
    if op == "sum":
        return t if first else torch.zeros_like(t)
    if op == "product":
        return t if first else torch.ones_like(t)
    return t  # max, min and avg of copies are the tensor itself


def shard_tensor(
    t: Tensor, spec: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int]
) -> Tensor:
    """The piece of the global tensor ``t`` that the rank at ``coord`` holds (pure; a view where possible)."""
    placements = normalize_spec(spec, len(mesh_shape), t.dim())
    local_shape(t.shape, placements, mesh_shape)  # checks divisibility with the full message
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            t = t.chunk(mesh_shape[axis], p.dim)[coord[axis]]
        elif isinstance(p, Partial):
            t = _partial_piece(t, p.op, coord[axis] == 0)
    return t


def _reduce(pieces: list[Tensor], op: str) -> Tensor:
    stacked = torch.stack(pieces)
    if op == "sum":
        return stacked.sum(0)
    if op == "product":
        return stacked.prod(0)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    return stacked.mean(0)


def unshard_tensors(
    pieces: Mapping[tuple[int, ...], Tensor], spec: Sequence[Placement], mesh_shape: Sequence[int]
) -> Tensor:
    """The global tensor from every coordinate's piece (pure; the inverse of :func:`shard_tensor`).

    Replicated axes take the piece at coordinate 0.
    """
    dims = tuple(mesh_shape)
    coords = [mesh_coords(dims, p) for p in range(math.prod(dims))]
    missing = [c for c in coords if c not in pieces]
    if missing:
        raise ShardingError(f"unshard_tensors is missing the pieces at {missing}; pass one per coordinate.")
    placements = normalize_spec(spec, len(dims), pieces[coords[0]].dim())
    current = {c: pieces[c] for c in coords}
    for axis in reversed(range(len(dims))):
        merged: dict[tuple[int, ...], Tensor] = {}
        for c in current:
            if c[axis] != 0:
                continue
            row = [current[(*c[:axis], k, *c[axis + 1 :])] for k in range(dims[axis])]
            p = placements[axis]
            if isinstance(p, Shard):
                merged[c] = torch.cat(row, dim=p.dim)
            elif isinstance(p, Partial):
                merged[c] = _reduce(row, p.op)
            else:
                merged[c] = row[0]
        current = merged
    return current[(0,) * len(dims)]


def distribute(t: Tensor, spec: Sequence[Placement], mesh: DeviceMesh) -> Tensor:
    """This rank's piece of the global tensor ``t`` (every rank passes the same ``t``); no communication."""
    return shard_tensor(t, spec, mesh.shape, mesh.coord)


def to_global(local: Tensor, spec: Sequence[Placement], mesh: DeviceMesh) -> Tensor:
    """The global tensor from this rank's piece; collective over the mesh, differentiable.

    Axes are undone last to first: a ``Shard`` by an all-gather on that axis's group, a ``Partial`` by an
    all-reduce. The result is replicated on every rank, so its gradient flows back as a slice; a
    ``Partial`` other than ``sum`` is reduced without autograd.
    """
    placements = normalize_spec(spec, mesh.ndim, local.dim())
    t = local
    for axis in reversed(range(mesh.ndim)):
        p = placements[axis]
        group = mesh.group(axis)
        if isinstance(p, Shard):
            t = all_gather(t, p.dim, group)
        elif isinstance(p, Partial) and mesh.axis_size(axis) > 1:
            if p.op == "sum":
                t = all_reduce(t, group)
            else:
                t = t.detach().clone()
                with collective_wait("all_reduce", group):
                    dist.all_reduce(t, op=REDUCE_OPS[p.op], group=group)
    return t
