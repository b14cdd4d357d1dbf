"""Shared pieces of benchmarks/pipeline_vs_torch.py: the variants measured (:class:`Spec`), the runner
interface, idle barriers and per-rank CPU accounting.

pipeline_vs_torch.py, _pipeline_runners.py and _pipeline_report.py all import from here, and this module
imports none of them, so the benchmark's modules form no import cycle.
"""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from _pipeline_probe import StageProbe

__all__ = [
    "ACTIVE_PLUS3",
    "BOTH_RANKS",
    "STAGES",
    "CpuMeter",
    "CpuSample",
    "Runner",
    "Spec",
    "idle_barrier",
    "make_specs",
    "mp_schedules",
]

STAGES = 2
"""Pipeline stages (ranks) of the benchmark."""

ACTIVE_PLUS3 = "interleaved active 5"
"""The mp session with the interleaved schedule and ``active_microbatches`` = pp + 3 instead of smp's
default pp + 2 (run at m = 8; not one of the default-config pairs)."""

BOTH_RANKS = "accumulate, both ranks"
"""The single-process control run on both ranks at once (each its own copy, no communication): how much
two processes computing at the same time slow each other down on this host."""


@dataclass(frozen=True)
class Spec:
    """One variant of the benchmark: a system, its schedule and the microbatch count."""

    system: str
    """single, mp or torch."""
    schedule: str
    """single: full batch / accumulate; mp: simple / interleaved; torch: GPipe / 1F1B."""
    m: int
    """Microbatches."""
    threads: int = 1
    """torch threads (single process only)."""

    @property
    def key(self) -> str:
        return f"{self.system}/{self.schedule}/m{self.m}/t{self.threads}"


def mp_schedules(m: int) -> tuple[str, ...]:
    """The mp sessions run at ``m`` microbatches."""
    base = ("simple", "interleaved", "simple static", "interleaved static")
    return (*base, ACTIVE_PLUS3) if m > 5 else base  # where m leaves room for 5 in flight


def make_specs(micro: list[int]) -> list[Spec]:
    """Every variant the benchmark times, in the order of its table."""
    out = [Spec("single", "full batch", 1, 1), Spec("single", "full batch", 1, 2)]
    for m in micro:
        out += [
            Spec("single", "accumulate", m),
            Spec("single", BOTH_RANKS, m),
            *(Spec("mp", s, m) for s in mp_schedules(m)),
            Spec("torch", "GPipe", m),
            Spec("torch", "1F1B", m),
        ]
    return out


class Runner(Protocol):
    """One system's training steps on this rank (_pipeline_runners.py builds them)."""

    stage_times: dict[str, list[float]]
    probe: StageProbe | None

    def first_step(self) -> tuple[float | None, dict[str, Any]]:
        """One training step; (the loss where this rank knows it, this rank's gradients before the
        optimizer step)."""

    def step(self) -> None: ...

    def close(self) -> None: ...


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
