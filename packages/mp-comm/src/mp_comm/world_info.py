"""Where this process sits in the world: which launcher started it (mpiexec, torchrun, or none), its
rank and host coordinates (`WorldInfo`), the CPUs its host gives the world's processes, and torch's
thread count from them.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mp_comm.errors import WorldError

__all__ = ["Launcher", "WorldInfo", "detect_launcher", "first_slurm_host"]

# Environment variables that MPI launchers set in every rank (MPICH/hydra, Open MPI, PMIx, Intel MPI).
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


class Launcher(enum.Enum):
    """How this process was started."""

    MPI = "mpi"
    TORCHRUN = "torchrun"
    SLURM = "slurm"
    """Slurm's srun, without MPI (`srun -N2 -n4 python train.py`): ranks from SLURM_PROCID and friends."""
    SINGLE = "single"


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in the world."""

    rank: int
    size: int
    local_rank: int
    """Rank among the processes on this host."""
    local_size: int
    """Number of processes on this host."""
    node: int
    """Index of this host, in the order of the lowest global rank on each host."""
    num_nodes: int
    launcher: Launcher
    host_cpus: int = 0
    """CPUs the world's processes on this host may run on, together (0: unknown; then this process's)."""
    bound: bool = False
    """Whether the launcher bound the processes on this host to CPU sets of their own (mp-launch does)."""

    @property
    def oversubscribed(self) -> bool:
        """Whether this host runs more of the world's processes than they have cores."""
        return self.local_size > (self.host_cpus or _usable_cores())


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launcher:
    """MPI if an MPI launcher's variables are present, torchrun if RANK/WORLD_SIZE are, Slurm if srun
    started this process as a task of a job step, else single."""
    env = os.environ if environ is None else environ
    if any(var in env for var in _MPI_RANK_VARS):
        return Launcher.MPI
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launcher.TORCHRUN
    # srun sets the step's variables; an sbatch script itself (one process, SLURM_NTASKS of the whole
    # allocation) has none of them and runs as a single process.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return Launcher.SLURM
    return Launcher.SINGLE


def _slurm_tasks_per_node(spec: str) -> list[int]:
    """Slurm's SLURM_STEP_TASKS_PER_NODE ("2(x3),1") as one count per node."""
    counts: list[int] = []
    for item in spec.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm host list ("node[03-05,9],gpu1" -> "node03")."""
    head = nodelist.split(",", 1)[0] if "[" not in nodelist.split(",", 1)[0] else nodelist
    prefix, bracket, rest = head.partition("[")
    if not bracket:
        return prefix
    first = rest.split("]", 1)[0].split(",", 1)[0].split("-", 1)[0]
    return prefix + first


def _slurm_coordinates(env: Mapping[str, str]) -> WorldInfo:
    size = _env_int(env, "SLURM_STEP_NUM_TASKS")
    node = _env_int(env, "SLURM_NODEID", 0)
    per_node = _slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(size)))
    return WorldInfo(
        rank=_env_int(env, "SLURM_PROCID"),
        size=size,
        local_rank=_env_int(env, "SLURM_LOCALID", 0),
        local_size=per_node[node] if node < len(per_node) else 1,
        node=node,
        num_nodes=_env_int(env, "SLURM_STEP_NUM_NODES", len(per_node)),
        launcher=Launcher.SLURM,
    )


def _cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _usable_cores() -> int:
    return len(_cpus())


def _placement(masks: Sequence[Sequence[int]]) -> tuple[int, bool]:
    """(CPUs of all, whether bound) from the CPU sets of a host's processes: bound when the sets are
    disjoint (a launcher gave each process its own), as opposed to all sharing the same ones."""
    union = set().union(*map(set, masks))
    return len(union), len(masks) > 1 and sum(len(m) for m in masks) == len(union)


def _set_thread_count(info: WorldInfo, environ: Mapping[str, str]) -> None:
    # Several ranks on one host each defaulting to all cores oversubscribe the host badly; a rank the
    # launcher bound to cores of its own sees just those, its share already.
    if "OMP_NUM_THREADS" in environ or "MP_NUM_THREADS" in environ:
        if "MP_NUM_THREADS" in environ:
            torch.set_num_threads(int(environ["MP_NUM_THREADS"]))
        return
    cores = _usable_cores()
    torch.set_num_threads(max(1, cores if info.bound else cores // max(1, info.local_size)))


def _mpi_coordinates() -> tuple[Any, WorldInfo]:
    from mp_comm.transport.ucx_setup import preload_before_mpi

    preload_before_mpi()  # UCX's libraries before MPICH's bundled older copy (no-op without ucxx)
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - mpi4py is a declared dependency
        raise WorldError(
            "this process was started by an MPI launcher but mpi4py cannot be imported "
            f"({exc}); install it with `pip install mpi4py mpich`."
        ) from exc
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    _check_launched_size(size, os.environ, MPI.Get_library_version())
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    leader = local.bcast(rank, root=0)
    host_cpus, bound = _placement(local.allgather(sorted(_cpus())))
    local.Free()
    leaders = sorted(set(comm.allgather(leader)))
    info = WorldInfo(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        node=leaders.index(leader),
        num_nodes=len(leaders),
        launcher=Launcher.MPI,
        host_cpus=host_cpus,
        bound=bound,
    )
    return comm, info


_LAUNCHED_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _check_launched_size(size: int, env: Mapping[str, str], library: str) -> None:
    """Refuse a world smaller than the launcher started: mpi4py then loaded another MPI library than
    the one whose mpiexec started the job (a system Open MPI beside the mpich wheel, say), and every
    process runs alone, so the job's first collective would wait forever."""
    for name in _LAUNCHED_SIZE_VARS:
        raw = env.get(name, "")
        if raw.isdigit() and int(raw) != size:
            lib = library.strip().splitlines()[0] if library.strip() else "unknown"
            raise WorldError(
                f"the launcher started {raw} processes ({name}={raw}) but MPI.COMM_WORLD has {size}: "
                f"mpi4py loaded a different MPI library ({lib}) than the one whose mpiexec started the "
                "job, so each process runs alone. Fix: start the job with the mpiexec of the MPI that "
                "mpi4py uses (the mpich wheel's sits beside this Python), or point mpi4py at the "
                "launcher's library, e.g. MPI4PY_LIBMPI=/path/to/libmpi.so.12 MPI4PY_MPIABI=mpich."
            )


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise WorldError(
                f"{name} is not set; the launcher (torchrun, srun) sets it. Start the job with torchrun, "
                "srun or mpiexec."
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorldError(f"{name}={raw!r} is not an integer; expected the value torchrun sets.") from None
