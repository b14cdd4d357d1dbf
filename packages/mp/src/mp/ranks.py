"""smp's rank and group queries: `smp.rank()`, `smp.pp_size()`, `smp.get_dp_group()`, ...

All of them raise NotInitializedError before `smp.init`.
"""

from __future__ import annotations

import torch.distributed as dist

from mp.state import state
from mp_comm import GroupKind


def _coords_rank(kind: GroupKind) -> int:
    _, world, topo = state.require()
    return topo.rank_in_group(kind, world.rank)


def _size(kind: GroupKind) -> int:
    _, _, topo = state.require()
    return topo.size(kind)


def rank() -> int:
    """Global rank of this process."""
    return state.require()[1].rank


def size() -> int:
    """Number of processes in the job."""
    return state.require()[1].size


def local_rank() -> int:
    """Rank of this process among the processes on its host."""
    return state.require()[1].info.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return state.require()[1].info.local_size


def pp_rank() -> int:
    """Pipeline stage of this process."""
    return _coords_rank(GroupKind.PP)


def pp_size() -> int:
    """Number of pipeline stages (pipeline_parallel_degree)."""
    return _size(GroupKind.PP)


def tp_rank() -> int:
    """Rank in the tensor-parallel group."""
    return _coords_rank(GroupKind.TP)


def tp_size() -> int:
    """Tensor-parallel degree."""
    return _size(GroupKind.TP)


def rdp_rank() -> int:
    """Rank among the processes holding the same pipeline stage and the same TP shard."""
    return _coords_rank(GroupKind.RDP)


def rdp_size() -> int:
    """Reduced data-parallel degree: size // (pp * tp)."""
    return _size(GroupKind.RDP)


def dp_rank() -> int:
    """Rank among the processes holding the same pipeline stage (TP x RDP)."""
    return _coords_rank(GroupKind.DP)


def dp_size() -> int:
    """Data-parallel degree: size // pp."""
    return _size(GroupKind.DP)


def mp_rank() -> int:
    """Rank within one full model replica (PP x TP)."""
    return _coords_rank(GroupKind.MP)


def mp_size() -> int:
    """Processes in one model replica: pp * tp."""
    return _size(GroupKind.MP)


def _group(kind: GroupKind, of_rank: int | None) -> list[int]:
    _, world, topo = state.require()
    return list(topo.group(kind, world.rank if of_rank is None else of_rank))


def get_world_group() -> list[int]:
    """All global ranks."""
    return _group(GroupKind.WORLD, None)


def get_pp_group(rank: int | None = None) -> list[int]:
    """Global ranks of the pipeline group of `rank` (default: this process)."""
    return _group(GroupKind.PP, rank)


def get_tp_group(rank: int | None = None) -> list[int]:
    """Global ranks of the tensor-parallel group of `rank` (default: this process)."""
    return _group(GroupKind.TP, rank)


def get_rdp_group(rank: int | None = None) -> list[int]:
    """Global ranks of the reduced data-parallel group of `rank` (default: this process)."""
    return _group(GroupKind.RDP, rank)


def get_dp_group(rank: int | None = None) -> list[int]:
    """Global ranks of the data-parallel group of `rank` (default: this process)."""
    return _group(GroupKind.DP, rank)


def get_mp_group(rank: int | None = None) -> list[int]:
    """Global ranks of the model-parallel group (one replica) of `rank` (default: this process)."""
    return _group(GroupKind.MP, rank)


def process_group(kind: GroupKind) -> dist.ProcessGroup:
    """The torch ProcessGroup of this process's group of `kind`."""
    state.require()
    return state.process_groups[kind]


def get_world_process_group() -> dist.ProcessGroup:
    """torch ProcessGroup of all ranks."""
    return process_group(GroupKind.WORLD)


def get_pp_process_group() -> dist.ProcessGroup:
    """torch ProcessGroup of this process's pipeline group."""
    return process_group(GroupKind.PP)


def get_tp_process_group() -> dist.ProcessGroup:
    """torch ProcessGroup of this process's tensor-parallel group."""
    return process_group(GroupKind.TP)


def get_rdp_process_group() -> dist.ProcessGroup:
    """torch ProcessGroup of this process's reduced data-parallel group."""
    return process_group(GroupKind.RDP)


def get_dp_process_group() -> dist.ProcessGroup:
    """torch ProcessGroup of this process's data-parallel group."""
    return process_group(GroupKind.DP)


def get_mp_process_group() -> dist.ProcessGroup:
    """torch ProcessGroup of this process's model-parallel group."""
    return process_group(GroupKind.MP)
