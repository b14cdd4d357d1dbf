"""How a rank waits for an MPI collective to complete: spin, or yield and then sleep.

MPICH's blocking collectives (``MPI_Allreduce``, ``MPI_Wait``...) busy-poll until the operation
completes. On cores of their own that is the fastest wait. Where the cores are shared, with other
ranks of the job, other jobs or a notebook, a spinning waiter takes the core from the very process
it waits for: tensor parallelism over MPI fell to 0.49x of DTensor over gloo (whose waits sleep in the
kernel) on a loaded host, from 1.36x on a quiet one.

The ``yield`` policy posts the nonblocking collective and tests it. Between tests it yields the CPU
(``sched_yield``: free on an idle core, a hand-over where another process is runnable) for a budget
that grows with the bytes moved, since a large transfer progresses only while someone tests it. After
the budget it sleeps between tests, from ``SLEEP_MIN`` doubling up to ``SLEEP_MAX``: a wait that long
is a peer that has not arrived yet, and the core is better spent on it.

``MP_COMM_WAIT`` chooses: ``yield`` (the default) or ``spin`` (MPI's own blocking wait, for jobs with
one dedicated core per rank). It is read once per process, like MPICH's own settings.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Final, Literal

from mp_comm import waits

__all__ = ["ENV", "WaitPolicy", "complete"]

ENV: Final = "MP_COMM_WAIT"
SPIN_BASE_S: Final = 200e-6
"""Yield-polling budget of any wait: a balanced collective between ready peers ends within it."""
SPIN_BYTES_PER_S: Final = 1e9
"""Budget per byte moved: polling must keep a transfer of that size moving (MPICH moves 3-14 GB/s here)."""
SLEEP_MIN: Final = 20e-6
SLEEP_MAX: Final = 200e-6
"""Longest nap: what a collective may finish late by, once its wait has outlasted the budget."""


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    mode: Literal["yield", "spin"]

    @classmethod
    def from_env(cls) -> WaitPolicy:
        value = os.environ.get(ENV, "yield").strip().lower()
        if value not in ("yield", "spin"):
            raise ValueError(
                f"{ENV}={value!r} is not a wait policy: expected 'yield' (the default: poll, yielding the "
                "CPU, then sleep) or 'spin' (MPI's busy wait, for one dedicated core per rank)"
            )
        return cls(value)  # type: ignore[arg-type]


POLICY: Final = WaitPolicy.from_env()


def complete(request: Any, nbytes: int, policy: WaitPolicy = POLICY) -> None:
    """Wait until the MPI ``request`` (a collective moving about ``nbytes`` per rank) completes."""
    if request.Test():
        return
    token = waits.enter(f"an MPI collective of {nbytes} bytes")  # for the heartbeat's report
    try:
        if policy.mode == "spin":
            request.Wait()
            return
        deadline = time.perf_counter() + SPIN_BASE_S + nbytes / SPIN_BYTES_PER_S
        while time.perf_counter() < deadline:
            os.sched_yield()
            if request.Test():
                return
        nap = SLEEP_MIN
        while not request.Test():
            time.sleep(nap)
            nap = min(nap * 2, SLEEP_MAX)
    finally:
        waits.leave(token)
