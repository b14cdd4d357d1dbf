"""The order in which a process takes mp down at interpreter exit.

A script may end without any shutdown call (smp scripts do). Python then runs its atexit handlers and
finalizes the interpreter; mpi4py finalizes MPI after that. Whatever C++ threads are still running
at finalization must not need Python any more: a torch.distributed gloo worker that drops the last
reference to a finished collective's tensors takes the GIL to release their Python objects, and a
thread that takes the GIL while the interpreter finalizes is ended by CPython with a forced unwind
through a noexcept destructor: ``terminate called without an active exception`` and SIGABRT
(measured: 2 to 4 in 10 jobs of 8 ranks that ran one allreduce, then ended).

So every piece registers how to stop at one :class:`Stage`, and one atexit handler runs the stages in
order while the interpreter is whole: the code that uses the transports (the pipeline's worker
threads), the transports and their progress threads (UCX first: it may still hand payloads to MPI),
then the process groups (destroying a group joins its C++ worker threads, which may still run
Python), then mp's MPI communicators, and last a wait until the gloo workers of the groups the script
still references have let go of their last collective (mp_comm.gloo_workers). Hooks are local: none
waits on another rank for long, so a rank that exits while others still run does not hang (a
transport's close meets the others for at most `EXIT_TIMEOUT` seconds).
"""

from __future__ import annotations

import atexit
import enum
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Final

__all__ = ["EXIT_TIMEOUT", "Stage", "at_exit", "run_exit_hooks"]

log = logging.getLogger(__name__)

EXIT_TIMEOUT: Final = 10.0
"""Seconds a transport's close at exit waits for the other ranks to close theirs. A rank that exits
with an error under plain mpiexec (sys.exit(1) is not an uncaught exception) is held this long before
mpiexec sees it fail; a rank that finishes later than the others (a final save on rank 0) makes them
give up on the meeting after this long, harmlessly (logged at info level)."""


class Stage(enum.IntEnum):
    """When a hook runs at exit, earliest first."""

    USERS = 0
    """What runs on top of the transports (the pipeline runtime's worker threads, the smp state)."""
    DEVICE_TRANSPORT = 1
    """The UCX transport and its progress thread."""
    HOST_TRANSPORT = 2
    """The MPI transport and its progress thread."""
    WORLD = 3
    """torch.distributed process groups (joining their C++ threads), then mp's MPI communicators."""
    GLOO_WORKERS = 4
    """Waiting for the gloo worker threads of groups that outlive the teardown (mp_comm.gloo_workers)."""


_Hook = Callable[[], None]
_hooks: dict[int, tuple[Stage, Callable[[], _Hook | None]]] = {}
_order = itertools.count()
_lock = threading.Lock()


def at_exit(stage: Stage, hook: _Hook) -> Callable[[], None]:
    """Run `hook` at interpreter exit in `stage`; returns a function that cancels it.

    A bound method is held weakly (an object that is gone by then has nothing to tear down); within a
    stage, the hook registered last runs first, as with atexit.
    """
    ref: Callable[[], _Hook | None]
    if hasattr(hook, "__self__") and hasattr(hook, "__func__"):
        ref = weakref.WeakMethod(hook)
    else:
        ref = lambda: hook  # noqa: E731 - a strong reference with the same call shape as a weak one
    key = next(_order)
    with _lock:
        _hooks[key] = (stage, ref)

    def cancel() -> None:
        with _lock:
            _hooks.pop(key, None)

    return cancel


def run_exit_hooks() -> None:
    """Run and forget every registered hook, stage by stage (atexit calls it; so may tests)."""
    with _lock:
        pending = sorted(_hooks.items(), key=lambda item: (item[1][0], -item[0]))
        _hooks.clear()
    for _, (stage, ref) in pending:
        hook = ref()
        if hook is None:
            continue
        try:
            hook()
        except Exception as exc:  # one piece failing must not keep the later ones from stopping
            log.warning("mp teardown at exit (%s): %s: %s", stage.name.lower(), type(exc).__name__, exc)


atexit.register(run_exit_hooks)
