"""What each rank runs under `mp-launch`: the user's script, with failure reporting and job abort.

An uncaught exception (or `sys.exit` with a non-zero code) on one rank prints that rank's traceback,
leaves a report for mp-launch, and calls MPI_Abort so that every other rank stops at once rather than
waiting for it in a collective.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import json
import os
import runpy
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import IO


def _rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _user_traceback(exc: BaseException) -> str:
    # Drop the frames of this runner and runpy: the user's traceback starts at their script.
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _name_peers(exc: BaseException) -> None:
    # A peer that went away is named by address alone in gloo's errors: say which host and ranks it is.
    if "mp_comm.heartbeat" in sys.modules:
        with contextlib.suppress(Exception):
            note = sys.modules["mp_comm.heartbeat"].who_is_at(str(exc))
            if note:
                exc.add_note(f"mp: {note}")


def _fail(rank: int, code: int, text: str) -> None:
    sys.stdout.flush()
    failure_dir = os.environ.get("MP_LAUNCH_FAILURE_DIR")
    if not failure_dir:  # under mp-launch, the launcher prints the report once for the whole job
        print(f"[rank {rank}] {text}", file=sys.stderr, end="" if text.endswith("\n") else "\n", flush=True)
    else:
        report = {"rank": rank, "code": code, "traceback": text}
        tmp = Path(failure_dir) / f".rank-{rank}.tmp"
        tmp.write_text(json.dumps(report))
        tmp.replace(Path(failure_dir) / f"rank-{rank}.json")
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def _register(rank: int) -> None:
    # Which process is which rank, for mp-launch to name a rank that dies without a word (kill -9, the
    # OOM killer): mpiexec reports only its PID and host. The folder is on the launcher's host, so
    # ranks on other hosts leave no entry (mp-launch then names the PID and host alone).
    failure_dir = os.environ.get("MP_LAUNCH_FAILURE_DIR")
    if failure_dir and os.path.isdir(failure_dir):
        entry = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
        with contextlib.suppress(OSError):
            tmp = Path(failure_dir) / f".pid-{os.getpid()}.tmp"  # renamed: mp-launch never reads half
            tmp.write_text(json.dumps(entry))
            tmp.replace(Path(failure_dir) / f"pid-{os.getpid()}-{entry['host']}.json")
        # On SIGUSR1 (mp-launch sends it when a peer stops answering) every thread's stack goes to a
        # file of this rank's: what it was doing. faulthandler writes from the signal handler itself,
        # so a rank blocked in a C call (a collective, an MPI wait) answers too.
        with contextlib.suppress(OSError, ValueError, AttributeError, RuntimeError):
            _STACKS.append(open(Path(failure_dir) / f"stacks-{rank}.txt", "w"))  # noqa: SIM115
            faulthandler.register(signal.SIGUSR1, file=_STACKS[-1], all_threads=True)


_STACKS: list[IO[str]] = []  # kept open for the life of the rank (faulthandler holds its descriptor)


def main() -> None:
    # Started as a file, Python put this package's folder first on sys.path, where mp's own modules
    # (config.py, launch.py, ...) would shadow the user's; the user's script decides sys.path instead.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    argv = sys.argv[1:]
    if not argv:
        raise SystemExit("usage: python _rank_main.py (script | -m module) [args...]")
    rank = _rank()
    _register(rank)
    if importlib.util.find_spec("libucx") is not None:
        # ucxx's UCX libraries must be loaded before MPICH's bundled older copy (see mp_comm.transport)
        with contextlib.suppress(Exception):
            importlib.import_module("libucx").load_library()
    from mpi4py import MPI  # initialize MPI before user code, so Abort is always available

    del MPI
    try:
        if argv[0] == "-m":
            sys.path.insert(0, os.getcwd())
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return
        if isinstance(code, int):
            _fail(rank, code, f"exited with sys.exit({code})\n")
        else:
            _fail(rank, 1, f"exited with sys.exit({code!r})\n")
    except BaseException as exc:
        _name_peers(exc)
        _fail(rank, 1, _user_traceback(exc))


if __name__ == "__main__":
    main()
