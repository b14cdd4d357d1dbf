"""How a benchmark that needs several ranks starts itself: `python benchmarks/x.py` re-runs the same
script under mpiexec, with the ranks placed as `mp-launch` places them (each bound to cores of its own
where the host has a core per rank: see mp.launch), so that what is measured is what users run."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


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
    """Run `script` with this process's arguments on `ranks` ranks, one torch thread each, bound to
    cores as mp-launch binds them by default; returns mpiexec's exit code."""
    exe = mpiexec()
    if exe is None:
        print("mpiexec not found; install it with `pip install mpich`", file=sys.stderr)
        return 2
    from mp.launch import bind_arguments, placement

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    cpu_sets = placement("auto", ranks, exe)
    bind = bind_arguments(cpu_sets) if cpu_sets else []
    cmd = [exe, "-n", str(ranks), *bind, sys.executable, str(Path(script).resolve()), *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


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
