"""The module server of one rank (seed 001 §4.2): input queue, main thread, worker threads.

The transport's mailbox is the input queue: requests from other ranks and responses to this rank's
requests arrive there. The server's main thread (the thread that called the step) takes one message
at a time. A request goes to an IDLE worker thread (a new one if all are PENDING), which executes the
module; a response goes back to the thread that is PENDING on it. Control passes between threads by
a :class:`Baton`: exactly one thread of the rank (the main thread or one worker) holds it and runs;
a worker that sends a request of its own hands it back to the main thread and waits for its
response, so that other microbatches can use the rank meanwhile. Threads only switch at those points,
which keeps execution deterministic given the message order.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from mp_comm.errors import PeerTimeoutError
from mp_comm.transport.base import ANY_SOURCE, SendHandle, Transport
from mp_pipeline.errors import PipelineAbortedError, PipelineTimeoutError
from mp_pipeline.messages import TAG, Failure, Request, Response, StepAbort, StepEnd, StepId
from mp_pipeline.schedule import Phase, Task
from mp_pipeline.timeline import RECORDER, EventKind

__all__ = ["MAIN", "Baton", "Server", "ServerClosed", "WorkerState"]

log = logging.getLogger(__name__)

MAIN: object = "main-thread"
"""The baton token of the server's main thread."""


class ServerClosed(BaseException):
    """Raised in threads waiting for the baton when the server shuts down (a BaseException so that
    user code catching ``Exception`` does not swallow it)."""


class Baton:
    """The right to run on this rank: handed explicitly from one holder (a token) to the next."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: object = MAIN
        self._closed: BaseException | None = None

    def switch(self, to: object, wait_as: object) -> None:
        """Hand the baton to ``to`` and block until it comes back to ``wait_as``."""
        with self._cond:
            self._holder = to
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder is wait_as or self._closed is not None)
            if self._holder is not wait_as and self._closed is not None:
                raise self._closed

    def wait_for(self, token: object) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder is token or self._closed is not None)
            if self._holder is not token and self._closed is not None:
                raise self._closed

    def hand(self, to: object) -> None:
        with self._cond:
            self._holder = to
            self._cond.notify_all()

    def close(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (the main thread keeps running)."""
        with self._cond:
            self._closed = error
            self._holder = MAIN
            self._cond.notify_all()


class WorkerState(enum.Enum):
    PENDING = "PENDING"
    IDLE = "IDLE"
    EXECUTING = "EXECUTING"


_LOCAL = threading.local()


class _Worker:
    def __init__(self, server: Server, index: int) -> None:
        self.server = server
        self.token = object()
        self.state = WorkerState.IDLE
        self.job: Callable[[], None] | None = None
        self.thread = threading.Thread(
            target=self._loop, name=f"mp-pipeline-r{server.rank}-w{index}", daemon=True
        )

    def _loop(self) -> None:
        baton = self.server.baton
        _LOCAL.worker = self
        try:
            while True:
                baton.wait_for(self.token)
                job, self.job = self.job, None
                if job is None:  # pragma: no cover - the server never hands an empty job
                    baton.hand(MAIN)
                    continue
                self.state = WorkerState.EXECUTING
                job()
                self.state = WorkerState.IDLE
                self.server.idle.append(self)
                baton.hand(MAIN)
        except ServerClosed:
            return


class _Slot:
    __slots__ = ("response",)

    def __init__(self) -> None:
        self.response: Response | None = None


class Driver(Protocol):
    """What pp_rank 0's server asks of the step driver (see runtime.StepDriver)."""

    failure: BaseException | None

    def next_task(self) -> Task | None: ...

    @property
    def done(self) -> bool: ...

    def start(self, task: Task) -> None: ...

    def peer_results(self) -> Any: ...


class Server:
    """One step's module server on one rank. `serve` runs its main loop in the calling thread."""

    def __init__(
        self,
        *,
        transport: Transport,
        rank: int,
        peers: tuple[int, ...],
        step: StepId,
        handle_request: Callable[[Request], Response],
        timeout: float,
        early: list[Any],
    ) -> None:
        self.transport = transport
        self.rank = rank
        self.peers = peers
        """Global ranks of this rank's pipeline group (pp_rank order)."""
        self.step = step
        self.baton = Baton()
        self.idle: list[_Worker] = []
        self.workers: list[_Worker] = []
        self._handle_request = handle_request
        self._timeout = timeout
        self._pending: dict[int, _Slot] = {}
        self._ids = itertools.count()
        self._early = early
        """Messages of later steps seen while serving this one (kept for them; shared across steps)."""
        self._sends: list[SendHandle] = []
        self.finished = False
        self.results: Any = None
        self.closed = False
        self.stats = {"requests": 0, "responses": 0, "workers": 0}

    # -- used by worker threads ------------------------------------------------------------------------
    def next_request_id(self) -> int:
        return next(self._ids)

    def send(self, dest: int, message: object) -> None:
        if self.closed:
            return
        self._sends.append(self.transport.send(message, dest, TAG))

    def call(self, dest: int, request: Request) -> Response:
        """Send ``request`` and give the rank to other work until its response arrives."""
        slot = _Slot()
        self._pending[request.request_id] = slot
        sent = RECORDER.now()
        self.send(dest, request)
        worker: _Worker | None = getattr(_LOCAL, "worker", None)
        if worker is not None:
            worker.state = WorkerState.PENDING
        self.baton.switch(MAIN, slot)
        if RECORDER.enabled:
            self._record_wait(request, dest, sent)
        if worker is not None:
            worker.state = WorkerState.EXECUTING
        assert slot.response is not None
        return slot.response

    def _record_wait(self, request: Request, dest: int, sent: int) -> None:
        """Timeline: the request sent at ``sent`` (an instant) and this thread's wait for its response."""
        phase = request.phase.value if isinstance(request.phase, Phase) else str(request.phase)
        for kind, end in ((EventKind.REQUEST, sent), (EventKind.WAIT, RECORDER.now())):
            RECORDER.add(
                kind,
                rank=self.rank,
                step=self.step.step,
                module=request.module,
                microbatch=request.microbatch,
                start_ns=sent,
                end_ns=end,
                phase=phase,
                peer=dest,
            )

    def pause(self, token: object) -> None:
        """Give the rank back to the main thread until it hands the baton to ``token``."""
        worker: _Worker | None = getattr(_LOCAL, "worker", None)
        if worker is not None:
            worker.state = WorkerState.PENDING
        self.baton.switch(MAIN, token)
        if worker is not None:
            worker.state = WorkerState.EXECUTING

    # -- used by the main thread -----------------------------------------------------------------------
    def run_job(self, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle (or new) worker; returns when the rank is back at the main thread."""
        worker = self.idle.pop() if self.idle else None
        if worker is None:
            worker = _Worker(self, len(self.workers))
            self.workers.append(worker)
            self.stats["workers"] += 1
            worker.thread.start()
        worker.job = job
        self.baton.switch(worker.token, MAIN)

    def resume(self, token: object) -> None:
        """Hand the rank to the thread paused on ``token`` until it gives it back."""
        self.baton.switch(token, MAIN)

    def serve(self, driver: Driver | None = None) -> Any:
        """The main loop: until the step ends here (pp_rank 0: the driver is done; others: StepEnd)."""
        try:
            for message in self._take_early():
                self._dispatch(message)
            while not self.finished:
                if driver is not None:
                    if driver.failure is not None:
                        raise driver.failure
                    message = self._poll(0.0)
                    if message is None:
                        task = driver.next_task()
                        if task is not None:
                            log.debug("rank %d starts %s", self.rank, task)
                            driver.start(task)
                            continue
                        if driver.done:
                            self.finished = True
                            self._send_end(driver.peer_results())
                            break
                        message = self._poll(self._timeout)
                else:
                    message = self._poll(self._timeout)
                if message is not None:
                    self._dispatch(message)
            if driver is not None and driver.failure is not None:
                raise driver.failure
        except BaseException as exc:
            self._abort(exc)
            raise
        finally:
            self._shutdown()
        return self.results

    def _send_end(self, results: Any) -> None:
        # pp_rank 0: tell the other ranks of the pipeline that the step is over.
        for peer in self.peers:
            if peer != self.rank:
                self.send(peer, StepEnd(self.step, results))

    # -- internals -------------------------------------------------------------------------------------
    def _take_early(self) -> list[Any]:
        mine = [m for m in self._early if m.step == self.step]
        self._early[:] = [m for m in self._early if m.step > self.step]
        return mine

    def _poll(self, timeout: float) -> Any:
        while True:
            try:
                received = self.transport.recv(ANY_SOURCE, TAG, timeout=timeout)
            except PeerTimeoutError:
                if timeout == 0.0:
                    return None
                raise PipelineTimeoutError(
                    f"rank {self.rank} received no pipeline message within {timeout:g} s in step "
                    f"{self.step.step} (waiting on {len(self._pending)} response(s); workers: "
                    f"{[w.state.value for w in self.workers]}). A rank of pipeline {list(self.peers)} is "
                    "stuck or dead; raise MP_PIPELINE_TIMEOUT for very long module executions."
                ) from None
            message = received.obj
            step = getattr(message, "step", None)
            if not isinstance(step, StepId):
                log.error("rank %d: dropping a non-pipeline message %r", self.rank, type(message))
                continue
            if step < self.step:
                log.debug("rank %d: dropping a message of the earlier step %s", self.rank, step)
                continue
            if step > self.step:
                self._early.append(message)
                continue
            return message

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Request):
            self.stats["requests"] += 1
            self.run_job(lambda: self._serve_request(message))
        elif isinstance(message, Response):
            self.stats["responses"] += 1
            slot = self._pending.pop(message.request_id, None)
            if slot is None:
                log.error("rank %d: response to unknown request %d dropped", self.rank, message.request_id)
                return
            slot.response = message
            self.baton.switch(slot, MAIN)
        elif isinstance(message, StepEnd):
            self.finished = True
            self.results = message.results
        elif isinstance(message, StepAbort):
            f = message.failure
            raise PipelineAbortedError(
                f"the step was aborted: {f.describe()}\n--- traceback on rank {f.rank} ---\n{f.traceback}"
            )
        else:  # pragma: no cover - _poll filters
            log.error("rank %d: unknown message %r dropped", self.rank, type(message))

    def _serve_request(self, request: Request) -> None:
        try:
            response = self._handle_request(request)
        except ServerClosed:
            raise
        except BaseException as exc:
            phase = request.phase.value if isinstance(request.phase, Phase) else str(request.phase)
            failure = Failure.from_exception(
                exc, rank=self.rank, module=request.module, microbatch=request.microbatch, phase=phase
            )
            log.debug("rank %d: %s", self.rank, failure.describe())
            response = Response(request.step, request.request_id, self.rank, failure=failure)
        self.send(request.requester, response)

    def _abort(self, exc: BaseException) -> None:
        if isinstance(exc, PipelineAbortedError):
            return  # another rank aborted and told everyone
        failure = Failure.from_exception(exc, rank=self.rank, module="<step>", microbatch=-1, phase="step")
        if failure.rank == self.rank and getattr(exc, "microbatch", None) is None:
            failure.microbatch = getattr(exc, "_mp_microbatch", -1)
        for peer in self.peers:
            if peer != self.rank:
                try:
                    self.send(peer, StepAbort(self.step, failure))
                except Exception as send_exc:  # pragma: no cover - transport already broken
                    log.error(
                        "rank %d: could not tell rank %d about the failure: %s", self.rank, peer, send_exc
                    )

    def _shutdown(self) -> None:
        self.closed = True
        self.baton.close(ServerClosed())
        for worker in self.workers:
            worker.thread.join(timeout=5.0)
            if worker.thread.is_alive():
                log.warning("rank %d: worker %s did not stop", self.rank, worker.thread.name)
        self._wait_sends()

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for handle in sends:
            try:
                handle.wait(timeout=self._timeout)
            except Exception as exc:
                log.warning("rank %d: a pipeline message did not complete: %s", self.rank, exc)
