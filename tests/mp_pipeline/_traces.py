"""A hand-made two-rank trace for the timeline tests (and for the fresh interpreter one of them starts)."""

from __future__ import annotations

from typing import Any

from mp_pipeline import EventKind, ProcessTrace
from mp_pipeline.timeline import STEP_MODULE, Event


def ev(
    kind: EventKind, rank: int, start: int, end: int, *, mb: int = 0, thread: str = "w0", **kw: Any
) -> Event:
    return Event(kind, rank, thread, 1, kw.pop("module", "m"), mb, start, end, **kw)


def two_rank_trace(offset1: int = 0) -> list[ProcessTrace]:
    """pp=2, 2 microbatches, times in µs: rank 0 runs the step body, rank 1 serves module "h"."""
    us = 1000
    r0 = [
        ev(EventKind.STEP, 0, 0, 100 * us, mb=-1, thread="MainThread", module=STEP_MODULE),
        ev(EventKind.FWD, 0, 1 * us, 30 * us, mb=0, module=STEP_MODULE),
        ev(EventKind.REQUEST, 0, 5 * us, 5 * us, mb=0, phase="FWD", peer=1),
        ev(EventKind.WAIT, 0, 5 * us, 25 * us, mb=0, phase="FWD", peer=1),
        ev(EventKind.FWD, 0, 6 * us, 20 * us, mb=1, thread="w1", module=STEP_MODULE),
        ev(EventKind.BWD, 0, 40 * us, 90 * us, mb=0, module=STEP_MODULE),
        ev(EventKind.WAIT, 0, 45 * us, 80 * us, mb=0, phase="BWD", peer=1),
    ]
    r1 = [
        ev(EventKind.STEP, 1, 0, 100 * us, mb=-1, thread="MainThread", module=STEP_MODULE),
        ev(EventKind.FWD, 1, 8 * us, 22 * us, mb=0),
        ev(EventKind.BWD, 1, 50 * us, 75 * us, mb=0),
    ]

    def shifted(events: list[Event], off: int) -> tuple[Event, ...]:
        return tuple(
            Event(
                e.kind,
                e.rank,
                e.thread,
                e.step,
                e.module,
                e.microbatch,
                e.start_ns - off,
                e.end_ns - off,
                e.phase,
                e.peer,
            )
            for e in events
        )

    return [
        ProcessTrace(shifted(r0, 0), clock_offset_ns=10**12, labels={0: "pp 0, dp 0"}),
        # another process: its perf_counter reads differently, its offset makes up for it
        ProcessTrace(shifted(r1, offset1), clock_offset_ns=10**12 + offset1, labels={1: "pp 1, dp 0"}),
    ]
