"""How a benchmark that needs several ranks starts itself: `python -m benchmarks.x` re-runs the same
module under mpiexec, with the ranks placed as `mp-launch` places them (each bound to cores of its own
where the host has a core per rank: see mp.launch), so that what is measured is what users run.

Benchmarks are modules of the `benchmarks` package, run from the repository's root; the processes they
start get the root on PYTHONPATH (:func:`python_command`, :func:`root_env`), wherever they run."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
"""The repository's root: the folder that holds the `benchmarks` package."""


def python_command(script: str | Path) -> list[str]:
    """This Python running the benchmark module whose file is `script` (`-m benchmarks.name`)."""
    path = Path(script).resolve()
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return [sys.executable, "-m", module]


def root_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the repository's root first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def under_mpi() -> bool:
    """Whether this process is a rank started by an MPI launcher."""
    return any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def mpiexec() -> str | None:
    """$MP_BENCH_MPIEXEC, else the mpiexec beside this Python (the MPICH wheel's), else the one on PATH."""
    named = os.environ.get("MP_BENCH_MPIEXEC")
    if named:
        return named
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def relaunch(script: str, ranks: int) -> int:
    """Run the benchmark module whose file is `script` with this process's arguments on `ranks` ranks,
    one torch thread each, bound to cores as mp-launch binds them by default; returns mpiexec's exit
    code."""
    exe = mpiexec()
    if exe is None:
        print("mpiexec not found; install it with `pip install mpich`", file=sys.stderr)
        return 2
    from mp.launch import Mpiexec, bind_arguments, placement

    env = root_env()
    env["OMP_NUM_THREADS"] = "1"
    cpu_sets = placement("auto", ranks, Mpiexec(exe))
    bind = bind_arguments(cpu_sets) if cpu_sets else []
    cmd = [exe, "-n", str(ranks), *bind, *python_command(script), *sys.argv[1:]]
    return subprocess.call(cmd, env=env, cwd=ROOT)


@contextlib.contextmanager
def on_all_cores() -> Iterator[None]:
    """Let the calling thread run on every CPU of the host for the block (then restore its CPU set).

    For the single-process variants with several threads, the ones meant to use the cores the ranks
    share: `relaunch` binds each rank to its own. Threads the block creates (OpenMP's, on first use)
    inherit the wide set.
    """
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps only the CPUs allowed here
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def sweep_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every interleaved size-sweep benchmark takes (--quick, --reps); add your own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of the interleaved sweep")
    return parser


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """`items` starting at position `rep` (cyclically): repetition `rep` of an interleaved sweep runs its
    variants in this order, so that no variant always runs first or right after the same other one."""
    turn = rep % len(items)
    return [*items[turn:], *items[:turn]]


def idle_barrier(comm: Any, nap: float = 1e-3) -> None:
    """A barrier that sleeps while it waits (MPI's blocking barrier spins and would steal a core from the
    other rank, which on 2 cores is the one still computing)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(nap)


class _Landing:
    """A receive into host memory whose wait copies the message into its CUDA tensor."""

    def __init__(self, work: Any, device_tensor: Any, host: Any) -> None:
        self.work, self.device_tensor, self.host = work, device_tensor, host
        self.landed = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self.work.wait(*args, **kwargs)
        if not self.landed:
            import torch

            with torch.no_grad():  # torch's receive buffers are leaves that require grad
                self.device_tensor.copy_(self.host)
            self.landed = True
        return True

    def is_completed(self) -> bool:
        return self.landed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def stage_cuda_p2p_through_host(should_stage: Callable[[Any], bool] | None = None) -> None:
    """Make torch.distributed's point-to-point calls (``isend``, ``irecv``, ``send``, ``recv``, and so
    ``batch_isend_irecv``, all that torch.distributed.pipelining sends with) carry CUDA tensors through
    host memory when the default group is gloo (ranks sharing a GPU: NCCL refuses them, and gloo's
    point-to-point takes host memory), as mp's MPI route carries the same tensors. CPU tensors pass
    unchanged. Call it before building the stages (their P2POps keep the functions they were given);
    idempotent. ``should_stage`` (default: ``Tensor.is_cuda``) is for checking the wiring on a CPU host."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist.isend, "_staged", False) or dist.get_backend() != "gloo":
        return
    staged = should_stage or (lambda t: t.is_cuda)
    isend, irecv, send, recv = c10d.isend, c10d.irecv, c10d.send, c10d.recv

    def host_isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return isend(tensor.detach().to("cpu", copy=True) if staged(tensor) else tensor, *args, **kwargs)

    def host_irecv(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not staged(tensor):
            return irecv(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _Landing(irecv(host, *args, **kwargs), tensor, host)

    def host_send(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return send(tensor.detach().to("cpu", copy=True) if staged(tensor) else tensor, *args, **kwargs)

    def host_recv(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not staged(tensor):
            return recv(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        sender = recv(host, *args, **kwargs)
        tensor.copy_(host)
        return sender

    for name, fn in (("isend", host_isend), ("irecv", host_irecv), ("send", host_send), ("recv", host_recv)):
        fn._staged = True  # type: ignore[attr-defined]
        setattr(c10d, name, fn)  # what P2POp and batch_isend_irecv check and call
        setattr(dist, name, fn)  # what torch.distributed.pipelining looks up
