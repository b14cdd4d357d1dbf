"""The threads of a module server (docs/pipeline.md) and the baton that lets exactly one of them run.

Control passes between the server's main thread and its worker threads by a :class:`Baton`: exactly
one thread of the rank holds it and runs, and threads switch only where one hands it to another, which
keeps execution deterministic given the message order. Workers belong to a :class:`WorkerPool` that
outlives the step (the runtime owns it): a fresh thread faults its memory in again (tens of thousands of
minor page faults for a GPT block's forward and backward), so idle workers wait for the next step's
requests instead of exiting.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

__all__ = ["MAIN", "Baton", "ServerClosed", "WorkerPool", "WorkerState", "current_worker"]

log = logging.getLogger(__name__)

MAIN: object = "main-thread"
"""The baton token of the server's main thread."""


class ServerClosed(BaseException):
    """Raised in threads waiting for the baton when the server shuts down (a BaseException so that
    user code catching ``Exception`` does not swallow it)."""


class Baton:
    """The right to run on this rank: handed explicitly from one holder (a token) to the next.

    Each waiting thread blocks on a lock of its own, which the thread handing the baton to it releases:
    a hand-off wakes exactly the next holder (a broadcast would wake every idle worker, and each woken
    thread competes for the GIL before it can go back to sleep).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards the fields below."""
        self._holder: object = MAIN
        self._closed: BaseException | None = None
        self._waiters: dict[object, threading.Lock] = {}
        """token -> the (held) lock its waiting thread blocks on; released to wake it."""

    def _give(self, to: object) -> None:
        # caller holds self._lock
        self._holder = to
        waiter = self._waiters.pop(to, None)
        if waiter is not None:
            waiter.release()

    def _enlist(self, token: object) -> threading.Lock:
        # caller holds self._lock and the baton is not ``token``'s
        waiter = threading.Lock()
        waiter.acquire()
        self._waiters[token] = waiter
        return waiter

    def _check(self, token: object) -> None:
        if self._holder is not token and self._closed is not None:
            raise self._closed

    def switch(self, to: object, wait_as: object) -> None:
        """Hand the baton to ``to`` and block until it comes back to ``wait_as``."""
        with self._lock:
            self._give(to)
            if self._holder is wait_as or self._closed is not None:
                self._check(wait_as)
                return
            waiter = self._enlist(wait_as)
        waiter.acquire()  # released by the thread that hands the baton back (or by close)
        self._check(wait_as)

    def wait_for(self, token: object, alive: Callable[[], bool] | None = None) -> None:
        """Block until ``token`` holds the baton; with ``alive``, also give up (ServerClosed) once it
        returns False (checked every second: an idle pool worker notices its transport closed)."""
        with self._lock:
            if self._holder is token or self._closed is not None:
                self._check(token)
                return
            waiter = self._enlist(token)
        while not waiter.acquire(timeout=1.0 if alive is not None else -1):
            assert alive is not None
            if not alive():
                with self._lock:
                    if self._waiters.get(token) is waiter:  # not handed meanwhile: give up
                        del self._waiters[token]
                        raise ServerClosed()
        self._check(token)

    def hand(self, to: object) -> None:
        with self._lock:
            self._give(to)

    def close(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (the main thread keeps running)."""
        with self._lock:
            self._closed = error
            self._holder = MAIN
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.release()


class WorkerState(enum.Enum):
    PENDING = "PENDING"
    IDLE = "IDLE"
    EXECUTING = "EXECUTING"


_LOCAL = threading.local()


class _Worker:
    def __init__(self, pool: WorkerPool, index: int) -> None:
        self.pool = pool
        self.baton = pool.baton
        self.token = object()
        self.state = WorkerState.IDLE
        self.job: Callable[[], None] | None = None
        self.thread = threading.Thread(
            target=self._loop, name=f"mp-pipeline-r{pool.rank}-w{index}", daemon=True
        )

    def _loop(self) -> None:
        baton = self.baton
        _LOCAL.worker = self
        try:
            while True:
                baton.wait_for(self.token, self.pool.alive)
                job, self.job = self.job, None
                if job is None:  # pragma: no cover - the server never hands an empty job
                    baton.hand(MAIN)
                    continue
                self.state = WorkerState.EXECUTING
                job()
                self.state = WorkerState.IDLE
                self.pool.idle.append(self)
                baton.hand(MAIN)
        except ServerClosed:
            return


class WorkerPool:
    """The worker threads of one rank's module servers, kept from step to step.

    Threads are added when every worker is PENDING and stay for later steps. A step that
    ends with a worker still busy (an aborted step) closes the baton, which stops every worker, and
    starts over with a new baton; :meth:`close` (the runtime's) stops them for good. Idle workers also
    stop by themselves once ``alive()`` turns False (the transport closed: ``smp.reset``).
    """

    def __init__(self, rank: int, alive: Callable[[], bool] = lambda: True) -> None:
        self.rank = rank
        self.baton = Baton()
        self.idle: list[_Worker] = []
        self.workers: list[_Worker] = []
        self._alive = alive
        self.closed = False
        self.created = 0
        """Threads started in all (tests and stats)."""

    def alive(self) -> bool:
        return not self.closed and self._alive()

    def take(self) -> tuple[_Worker, bool]:
        """An idle worker, or a new one; (worker, whether it is new). Main thread only."""
        while self.idle:
            worker = self.idle.pop()
            if worker.thread.is_alive():
                return worker, False
        worker = _Worker(self, self.created)
        self.created += 1
        self.workers.append(worker)
        worker.thread.start()
        return worker, True

    def all_idle(self) -> bool:
        return all(w.state is WorkerState.IDLE for w in self.workers)

    def reset(self) -> None:
        """Stop every worker (waking the busy ones with ServerClosed) and start over with a new baton."""
        self.baton.close(ServerClosed())
        for worker in self.workers:
            worker.thread.join(timeout=5.0)
            if worker.thread.is_alive():
                log.warning("rank %d: worker %s did not stop", self.rank, worker.thread.name)
        self.workers, self.idle = [], []
        self.baton = Baton()

    def close(self) -> None:
        self.closed = True
        self.reset()


def current_worker() -> _Worker | None:
    """The pool worker running in the calling thread, or None (the server's main thread)."""
    worker: _Worker | None = getattr(_LOCAL, "worker", None)
    return worker
