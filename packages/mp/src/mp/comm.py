"""smp's communication API over CommGroups: barrier, broadcast/send/recv_from, allgather, gather.

These move picklable Python objects (tensors included) and are synchronous, as in smp. `broadcast`
is a send to every other member: the receivers call `recv_from(sender, rank_type)`.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist

from mp.errors import CommGroupConfigError
from mp.ranks import process_group
from mp.state import state
from mp_comm import GroupKind, collective_wait


class CommGroup(enum.Enum):
    """The groups of smp's communication API (values as in smp)."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


class RankType(enum.Enum):
    """How a rank argument is read: globally, or as a position within one of this process's groups."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


def _kind(group: object, what: str = "group") -> GroupKind:
    if isinstance(group, CommGroup):
        return GroupKind(group.value)
    if isinstance(group, RankType):
        return GroupKind(group.value)
    names = ", ".join(f"smp.CommGroup.{g.name}" for g in CommGroup)
    raise CommGroupConfigError(
        f"{what}={group!r} is not a CommGroup; expected one of {names}. "
        "Fix: pass e.g. smp.CommGroup.DP_GROUP (or the alias smp.DP_GROUP)."
    )


def _global_rank(index: int, rank_type: object) -> int:
    if not isinstance(rank_type, RankType):
        names = ", ".join(f"smp.RankType.{t.name}" for t in RankType)
        raise CommGroupConfigError(f"rank_type={rank_type!r} is not a RankType; expected one of {names}.")
    _, world, topo = state.require()
    kind = GroupKind(rank_type.value)
    members = topo.group(kind, world.rank)
    if not isinstance(index, int) or not 0 <= index < len(members):
        raise CommGroupConfigError(
            f"rank {index!r} is outside this process's {kind.name} group of size {len(members)} "
            f"(members {list(members)}); expected 0 <= rank < {len(members)} for {rank_type}."
        )
    return members[index]


def _object_device() -> torch.device:
    # Objects travel as byte tensors; gloo carries CPU tensors, NCCL-only worlds need the GPU.
    _, world, _ = state.require()
    return torch.device("cpu") if "gloo" in world.backend else world.device


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every process of this process's `group` has reached the barrier."""
    pg = process_group(_kind(group))
    with collective_wait("barrier", pg):
        dist.barrier(group=pg)


def dp_barrier() -> None:
    """Barrier over the data-parallel group."""
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    """Barrier over the model-parallel group."""
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    """Barrier over the pipeline group."""
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    """Barrier over the tensor-parallel group."""
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    """Barrier over the reduced data-parallel group."""
    barrier(CommGroup.RDP_GROUP)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send a picklable object to `dest_rank` (read according to `rank_type`); it calls `recv_from`."""
    dest = _global_rank(dest_rank, rank_type)
    if dest == state.require()[1].rank:
        raise CommGroupConfigError(f"send to rank {dest_rank} ({rank_type}) is this process itself.")
    dist.send_object_list([obj], dst=dest, device=_object_device())


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object that `src_rank` (read according to `rank_type`) sent or broadcast."""
    src = _global_rank(src_rank, rank_type)
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, device=_object_device())
    return box[0]


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send `obj` to every other process of this process's `group`; each of them calls `recv_from`."""
    _, world, topo = state.require()
    device = _object_device()
    for member in topo.group(_kind(group), world.rank):
        if member != world.rank:
            dist.send_object_list([obj], dst=member, device=device)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """Every member's object, in group-rank order (the i-th from the i-th rank of the group)."""
    kind = _kind(group)
    out: list[Any] = [None] * state.require()[2].size(kind)
    pg = process_group(kind)
    with collective_wait("all_gather_object", pg):
        dist.all_gather_object(out, obj, group=pg)
    return out


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any] | None:
    """Gather objects to the group member at position `rank`; the others get None."""
    kind = _kind(group)
    _, world, topo = state.require()
    members = topo.group(kind, world.rank)
    if not isinstance(rank, int) or not 0 <= rank < len(members):
        raise CommGroupConfigError(
            f"rank={rank!r} is outside the {kind.name} group of size {len(members)}; "
            f"expected 0 <= rank < {len(members)}."
        )
    root = members[rank]
    out: list[Any] | None = [None] * len(members) if world.rank == root else None
    dist.gather_object(obj, out, dst=root, group=process_group(kind))
    return out
