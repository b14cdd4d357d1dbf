"""At exit, wait until torch's gloo worker threads have let go of their last collective.

A gloo process group runs each collective on one of its worker threads (``pt_gloo_runloop``). The
caller's ``dist.all_reduce`` returns as soon as the collective completes; the worker then still drops
its references to the work and its tensors, and for a tensor made in Python that releases a reference
to the tensor's Python object: torch checks that Python is initialized, then takes the GIL. When the
worker is not scheduled for a while (a loaded host) and Python starts finalizing between that check and
the GIL, CPython ends the thread with a forced unwind through torch's noexcept destructors:
``terminate called without an active exception`` and SIGABRT, after the script has done everything
right (seen: one 2-rank job in 30 in CI; a plain gloo group of one process whose workers were
starved behind its main thread, as on a loaded host: 6 runs in 70, native stack
``ProcessGroupGloo::runLoop`` > ``~AsyncAllreduceWork`` > ``TensorImpl::decref_pyobject`` >
``gil_scoped_acquire`` > ``take_gil`` > ``pthread_exit``; with this wait, 0 in 70).

Destroying a group joins its workers (mp_comm.teardown does so at exit), but a group the script still
references (smp scripts keep theirs: ``smp.get_dp_process_group()``) keeps them. So the last exit stage
waits, with the GIL released, until every worker is parked: blocked on its queue's condition variable,
which it reaches only after dropping the last work. Linux shows where a blocked thread waits in
``/proc/self/task/<tid>/syscall``: a condition-variable wait is a futex wait without a timeout
(FUTEX_WAIT_BITSET in glibc since 2.34; FUTEX_WAIT on a value other than 2 before), a thread that
waits for the GIL waits with a timeout, one that waits for a mutex waits on the value 2 (FUTEX_WAIT),
and a thread that runs or is preempted is not in a futex wait at all. Where this cannot be read (not
Linux, an unknown architecture, a kernel without the file) the stage does nothing. A worker that stays
busy (a collective whose peers are gone, started with ``async_op=True`` and never waited for) is given
up on after `EXIT_TIMEOUT` seconds.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from typing import Final

from mp_comm.teardown import EXIT_TIMEOUT, Stage, at_exit

__all__ = ["busy_workers", "wait_for_workers"]

log = logging.getLogger(__name__)

WORKER_NAME: Final = "pt_gloo_runloop"
"""The name torch gives a gloo process group's worker threads (``/proc/self/task/<tid>/comm``)."""

_SYS_FUTEX: Final = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
_FUTEX_WAIT: Final = 0
_FUTEX_WAIT_BITSET: Final = 9
_FUTEX_FLAGS: Final = 128 | 256  # FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME
_MUTEX_CONTENDED: Final = 2  # the value glibc's mutexes wait on (lll_lock_wait)
_TASKS: Final = "/proc/self/task"


def _parked(syscall: str) -> bool:
    """Whether a thread whose ``/proc/.../syscall`` reads `syscall` waits on a condition variable."""
    fields = syscall.split()
    if len(fields) < 5 or not fields[0].isdigit() or int(fields[0]) != _SYS_FUTEX:
        return False  # "running", "-1 ..." (blocked outside a system call), or another call
    op, value, timeout = int(fields[2], 16), int(fields[3], 16), int(fields[4], 16)
    command = op & ~_FUTEX_FLAGS
    if timeout != 0:
        return False  # a timed wait: the GIL, or a collective's wait for its peers
    return command == _FUTEX_WAIT_BITSET or (command == _FUTEX_WAIT and value != _MUTEX_CONTENDED)


def busy_workers() -> list[int] | None:
    """The thread ids of this process's gloo workers that are not parked; None where that cannot be told."""
    if _SYS_FUTEX is None:
        return None
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    busy = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as comm:
                if comm.read().strip() != WORKER_NAME:
                    continue
            with open(f"{_TASKS}/{tid}/syscall") as syscall:
                state = syscall.read()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        except OSError:
            return None  # a kernel without the syscall file, or no access to it
        if not _parked(state):
            busy.append(int(tid))
    return busy


def wait_for_workers(timeout: float = EXIT_TIMEOUT, poll: float = 0.001) -> bool:
    """Wait until every gloo worker of this process is parked (see the module docstring), sleeping with
    the GIL released so that a worker that needs it gets it. True once they are (or when it cannot be
    told, logged at debug level), False after `timeout` seconds (logged at info level)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = busy_workers()
        if busy is None:
            log.debug("cannot tell whether gloo's worker threads are idle here; not waiting for them")
            return True
        if not busy:
            return True
        if time.monotonic() >= deadline:
            log.info("gloo worker threads %s were still busy after %g s at exit", busy, timeout)
            return False
        time.sleep(poll)


def _wait_at_exit() -> None:
    wait_for_workers()


at_exit(Stage.GLOO_WORKERS, _wait_at_exit)
