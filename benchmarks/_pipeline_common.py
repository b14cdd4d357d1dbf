"""Shared pieces of benchmarks/pipeline_vs_torch.py: idle barriers and per-rank CPU accounting."""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["CpuMeter", "CpuSample", "idle_barrier"]

_TICK = 0.01  # /proc clock ticks (USER_HZ is 100 on Linux)


def idle_barrier(comm: Any, nap: float = 1e-3) -> None:
    """A barrier that sleeps while it waits (MPI's blocking barrier spins and would steal a core from the
    other rank, which on 2 cores is the one still computing)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(nap)


def _thread_cpu(native_id: int) -> float:
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK  # utime, stime (fields 14 and 15 of stat)


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds this rank used over a window: in all, in its main thread, in mp's MPI progress thread."""

    total: float
    main: float
    progress: float


class CpuMeter:
    """CPU time of this process over a window, split into the main thread, the mp-comm MPI progress thread
    (found by name) and the rest (mp's module-server workers, gloo's threads)."""

    def start(self) -> None:
        self._progress = [
            t.native_id
            for t in threading.enumerate()
            if t.name.startswith("mp-comm-mpi") and t.native_id is not None
        ]
        self._t0 = (_process_cpu(), time.thread_time(), sum(_thread_cpu(i) for i in self._progress))

    def stop(self) -> CpuSample:
        total, main, progress = self._t0
        return CpuSample(
            total=_process_cpu() - total,
            main=time.thread_time() - main,
            progress=sum(_thread_cpu(i) for i in self._progress) - progress,
        )
