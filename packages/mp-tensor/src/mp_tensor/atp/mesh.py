"""Device meshes: a tensor-parallel group arranged as ``DeviceMesh(d1, ..., dn)``, one process group per axis.

A mesh lays its ranks out row-major (ATP §3.1, Figure 4): the last axis varies fastest, so on
``DeviceMesh(2, 2)`` over ranks ``[0, 1, 2, 3]`` rank 1 sits at ``(0, 1)`` and rank 2 at ``(1, 0)``. The
group of axis ``a`` holds the ranks that differ only in coordinate ``a``: on ``DeviceMesh(d1, d2)`` the
axis-0 groups have ``d1`` ranks (``d2`` of them run at once) and the axis-1 groups ``d2``. The layout is
pure (:func:`mesh_coords`, :func:`axis_groups`); :func:`create_mesh` builds the ``torch.distributed``
groups, collectively.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch.distributed as dist

from mp_tensor.atp.errors import MeshError

__all__ = ["DeviceMesh", "axis_groups", "create_mesh", "mesh_coords", "normalize_shape"]

log = logging.getLogger(__name__)


def normalize_shape(shape: Sequence[int] | int, size: int | None = None) -> tuple[int, ...]:
    """``shape`` as a tuple of positive ints; with ``size``, checks that it multiplies to ``size``."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise MeshError(
            f"mesh shape {shape!r} is not a non-empty sequence of positive ints; pass e.g. (2, 2)."
        )
    if size is not None and math.prod(dims) != size:
        raise MeshError(
            f"mesh shape {dims} holds {math.prod(dims)} devices but the group has {size} ranks; "
            f"pass a shape whose product is {size}."
        )
    return dims


def mesh_coords(shape: Sequence[int], position: int) -> tuple[int, ...]:
    """The mesh coordinate of the ``position``-th rank of the mesh (row-major, last axis fastest)."""
    coord = []
    for d in reversed(tuple(shape)):
        position, c = divmod(position, d)
        coord.append(c)
    return tuple(reversed(coord))


def axis_groups(shape: Sequence[int], ranks: Sequence[int], axis: int) -> list[tuple[int, ...]]:
    """Every group of mesh ``axis``: tuples of ``ranks`` entries that differ only in coordinate ``axis``.

    Groups are ordered by their first member's position, members by their coordinate on ``axis``.
    """
    dims = tuple(shape)
    if not 0 <= axis < len(dims):
        raise MeshError(f"axis={axis} is out of range for a mesh of shape {dims}; pass 0..{len(dims) - 1}.")
    stride = math.prod(dims[axis + 1 :])
    groups = []
    for position in range(len(ranks)):
        if mesh_coords(dims, position)[axis] == 0:
            groups.append(tuple(ranks[position + k * stride] for k in range(dims[axis])))
    return groups


class DeviceMesh:
    """This rank's view of a device mesh: its coordinate and the process group of each axis.

    Build it with :func:`create_mesh` (or ``atp.distributed.init_mesh``); :meth:`destroy` releases the
    groups it created.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        ranks: tuple[int, ...],
        rank: int,
        groups: tuple[dist.ProcessGroup, ...],
        owned: Sequence[dist.ProcessGroup] = (),
    ) -> None:
        self.shape = shape
        """The mesh shape ``(d1, ..., dn)``."""
        self.ranks = ranks
        """The global ranks of the mesh, row-major."""
        self.rank = rank
        """This process's global rank."""
        self.coord = mesh_coords(shape, ranks.index(rank))
        """This rank's coordinate on the mesh."""
        self._groups = groups
        self._owned = list(owned)

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return len(self.ranks)

    def axis_size(self, axis: int) -> int:
        """Number of ranks in each group of ``axis``."""
        return self.shape[self._axis(axis)]

    def group(self, axis: int) -> dist.ProcessGroup:
        """The process group of ``axis`` that holds this rank."""
        return self._groups[self._axis(axis)]

    def axis_ranks(self, axis: int) -> tuple[int, ...]:
        """The global ranks of this rank's ``axis`` group, by their coordinate on ``axis``."""
        axis = self._axis(axis)
        for members in axis_groups(self.shape, self.ranks, axis):
            if self.rank in members:
                return members
        raise AssertionError("a mesh rank belongs to one group of every axis")

    def destroy(self) -> None:
        """Destroy the process groups this mesh created. Collective over the ranks that created them."""
        for group in self._owned:
            dist.destroy_process_group(group)
        self._owned.clear()

    def _axis(self, axis: int) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise MeshError(
                f"axis={axis} is out of range for the mesh of shape {self.shape}; pass 0..{self.ndim - 1}."
            )
        return axis % self.ndim

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self.shape}, rank={self.rank}, coord={self.coord})"


def create_mesh(shape: Sequence[int] | int, groups: Sequence[Sequence[int]] | None = None) -> DeviceMesh:
    """Arrange tensor-parallel groups as meshes of ``shape``; returns the mesh that holds this rank.

    ``groups`` lists every tensor-parallel group of the world as global ranks in mesh order (for mp's
    topology: ``topology.groups(GroupKind.TP)``); the default is one group of all ranks. Collective:
    every rank of the default group calls it with the same arguments, since each axis group of every
    mesh is created with ``torch.distributed.new_group`` in the same order everywhere.
    """
    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialized; start the world (mp_comm.init_world) first.")
    rank = dist.get_rank()
    all_groups = [tuple(g) for g in groups] if groups is not None else [tuple(range(dist.get_world_size()))]
    mine = [g for g in all_groups if rank in g]
    if len(mine) != 1:
        raise MeshError(
            f"rank {rank} is in {len(mine)} of the groups {all_groups}; expected exactly one. Pass every "
            "tensor-parallel group once, as disjoint tuples of global ranks."
        )
    dims = normalize_shape(shape, len(mine[0]))
    per_axis: list[dist.ProcessGroup | None] = [None] * len(dims)
    owned = []
    for ranks in all_groups:
        normalize_shape(dims, len(ranks))
        for axis in range(len(dims)):
            for members in axis_groups(dims, ranks, axis):
                group = dist.new_group(list(members))
                if rank in members:
                    per_axis[axis] = group
                    owned.append(group)
    assert all(g is not None for g in per_axis)
    mesh = DeviceMesh(dims, mine[0], rank, tuple(g for g in per_axis if g is not None), owned)
    log.debug("rank %d: %r over ranks %s", rank, mesh, mine[0])
    return mesh
