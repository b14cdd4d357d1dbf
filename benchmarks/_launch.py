"""How a benchmark that needs several ranks starts itself: `python benchmarks/x.py` re-runs the same
script under mpiexec. Kept free of torch so that the parent process stays light."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path


def under_mpi() -> bool:
    """Whether this process is a rank started by an MPI launcher."""
    return any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def mpiexec() -> str | None:
    """The mpiexec beside this Python (the MPICH wheel's), else the one on PATH."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def relaunch(script: str, ranks: int) -> int:
    """Run `script` with this process's arguments on `ranks` ranks, one torch thread each (they share
    the host's cores); returns mpiexec's exit code."""
    exe = mpiexec()
    if exe is None:
        print("mpiexec not found; install it with `pip install mpich`", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [exe, "-n", str(ranks), sys.executable, str(Path(script).resolve()), *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


def sweep_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every interleaved size-sweep benchmark takes (--quick, --reps); add your own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of the interleaved sweep")
    return parser
