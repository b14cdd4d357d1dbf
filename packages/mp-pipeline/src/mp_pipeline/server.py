"""The module server of one rank (docs/pipeline.md): input queue, main thread, worker threads.

The transport's mailbox is the input queue: requests from other ranks and responses to this rank's requests
arrive there. The server's main thread (the thread that called the step) takes one message at a time. A
request goes to an IDLE worker thread (a new one if all are PENDING), which executes the module; a response
goes back to the thread that is PENDING on it. Control passes between threads by a
:class:`~mp_pipeline.workers.Baton`: exactly one thread of the rank (the main thread or one worker) holds it
and runs; a worker that sends a request of its own hands it back to the main thread and waits for its
response, so that other microbatches can use the rank meanwhile. Threads only switch at those points, which
keeps execution deterministic given the message order.

When the main thread would do nothing but wait for the next message (no tensor-parallel order to follow, no
step task that may start), the thread holding the rank waits for it itself: a worker that sent a request
takes its own response, and one that has answered a request takes the next request, without the two thread
switches through the main thread each would cost (~25-30 µs each here). Any other message goes to the main
thread, which dispatches it as if it had received it.

pp_rank 0's main thread, whenever it has the rank, first starts a backward the schedule would start
(:meth:`Server._backward_first`), then handles the messages that wait, except that the simple schedule's
next forward goes before responses to this rank's own requests (:meth:`Server._defer`), then starts the
schedule's next task.

The server is one object assembled from one module per mechanism: its state (mp_pipeline.server_base), the
wire (mp_pipeline.wire), waiting in place (mp_pipeline.in_place), fast mode's handoffs and posted calls
(mp_pipeline.handoffs), the TP group's lockstep (mp_pipeline.tp_order), and this main loop.

The worker threads belong to a :class:`~mp_pipeline.workers.WorkerPool` that outlives the step (the runtime
owns it): a fresh thread faults its memory in again (tens of thousands of minor page faults for a GPT
block's forward and backward), so idle workers wait for the next step's requests instead of exiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mp_comm import waits
from mp_pipeline.errors import MICROBATCH_ATTR, PipelineAbortedError
from mp_pipeline.handoffs import Handoffs
from mp_pipeline.in_place import InPlace
from mp_pipeline.link import remote_error
from mp_pipeline.messages import (
    TAG,
    Failure,
    Handoff,
    PostedAck,
    PostedSync,
    Request,
    Response,
    StepAbort,
    StepEnd,
)
from mp_pipeline.posted import PostedCheck
from mp_pipeline.replay import Program, ProgramCall, fill
from mp_pipeline.schedule import Phase, Task
from mp_pipeline.sequence import FINISH, TASK
from mp_pipeline.server_base import Driver, _Slot
from mp_pipeline.timeline import RECORDER, EventKind
from mp_pipeline.tp_order import TPOrder
from mp_pipeline.workers import MAIN, ServerClosed, WorkerState, current_worker

__all__ = ["Driver", "Server"]

log = logging.getLogger(__name__)


class Server(InPlace, Handoffs, TPOrder):
    """One step's module server on one rank. `serve` runs its main loop in the calling thread."""

    def call(self, dest: int, request: Request) -> Response:
        """Send ``request`` and give the rank to other work until its response arrives."""
        slot = _Slot()
        self._pending[request.request_id] = slot
        sent = RECORDER.now()
        if self.replay is not None and self.replay.recording:
            self.replay.record(dest, request, False)
        self._send_flow(dest, request, request)
        return self._wait_for(slot, request, dest, sent)

    def replayed(self, dest: int, request: Request, check: PostedCheck | None) -> Response | None:
        """pp_rank 0, replaying (mp_pipeline.replay): the programmed call ``request`` (its id the
        program's). Its owner runs it without a request: only the tensors it needs from here travel.
        ``check``: a posted call (checked on its acknowledgement; returns None); else its response, which
        the owner sends unprompted (it may have come already: owners run ahead)."""
        self._account(dest, request)
        self.stats["replayed"] += 1
        rid = request.request_id
        early = self._unclaimed.pop(rid, None)
        slot = _Slot()
        if check is not None:
            self._posted[rid] = (dest, check)
            self._posted_to[dest] = self._posted_to.get(dest, 0) + 1
            self.stats["posted"] += 1
        elif early is None:
            self._pending[rid] = slot
        sent = RECORDER.now()
        for j, t in enumerate(request.tensors):
            if t is not None:
                self.stats["tensor_bytes"] += t.nbytes
                self.count_sent("Handoff")
                handoff = Handoff(self.step, ("fed", self.rank, rid, j), t)
                self._sends.append(self.transport.send(handoff, dest, TAG))
        if check is not None:
            if early is not None:  # a failure, or data where none was predicted
                self._posted.pop(rid, None)
                check(early)
            return None
        if early is not None:
            self.stats["responses"] += 1
            return early
        return self._wait_for(slot, request, dest, sent)

    def _wait_for(self, slot: _Slot, request: Request, dest: int, sent: int) -> Response:
        """Give the rank to other work until the response to ``request`` (sent to ``dest``) fills ``slot``."""
        worker = current_worker()
        if worker is not None:
            worker.state = WorkerState.PENDING
        # for the heartbeat's report of a silent rank: what this thread waits for, and from whom
        phase = request.phase.name.lower() if isinstance(request.phase, Phase) else request.phase
        what = f"the {phase} response of module {request.module!r} (microbatch {request.microbatch})"
        token = waits.enter(what, dest)
        try:
            if not self._response_in_place(slot):
                self.baton.switch(MAIN, slot)
        finally:
            waits.leave(token)
        if RECORDER.enabled:
            self._record_wait(request, dest, sent)
        if worker is not None:
            worker.state = WorkerState.EXECUTING
        assert slot.response is not None
        return slot.response

    def _record_wait(self, request: Request, dest: int, sent: int) -> None:
        """Timeline: the request sent at ``sent`` (an instant) and this thread's wait for its response."""
        self._record(EventKind.REQUEST, request, dest, sent, sent)
        self._record(EventKind.WAIT, request, dest, sent, RECORDER.now())

    # -- used by the main thread -----------------------------------------------------------------------
    def run_job(self, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle (or new) worker; returns when the rank is back at the main thread."""
        worker, new = self.pool.take()
        self.stats["workers"] += new
        worker.job = job
        self._lend(worker.token)

    def resume(self, token: object) -> None:
        """Hand the rank to the thread paused on ``token`` until it gives it back."""
        self._lend(token)

    def _lend(self, token: object) -> None:
        """Hand the rank to the worker thread waiting as ``token`` until it gives it back. Meanwhile the
        transport is marked busy: nothing that arrives can run before the worker is done, and on a host
        whose cores all compute, a progress thread's every poll would preempt the worker."""
        self.transport.set_busy(True)
        try:
            self.baton.switch(token, MAIN)
        finally:
            self.transport.set_busy(False)

    def serve(self, driver: Driver | None = None) -> Any:
        """The main loop: until the step ends here (pp_rank 0: the driver is done; others: StepEnd)."""
        self._driver = driver
        try:
            for message in self._take_early():
                self._arrived(message)
            for microbatch in sorted(self.program or {}):  # per-rank replay: this rank's own program
                assert self.program is not None
                calls = self.program[microbatch]
                self.run_job(lambda calls=calls: self._run_program(calls))  # type: ignore[misc]
            while not self.finished or self._posted:
                if self._inbox_error is not None:
                    raise self._inbox_error
                if driver is not None and driver.failure is not None:
                    raise driver.failure
                if self._backward_first(driver):
                    continue
                if self._ready:  # a wait that this rank's own work ended (fast mode)
                    self._lend(self._ready.popleft())
                    continue
                if self._inbox:  # taken by a thread that waited in place: arrived before anything else
                    self._arrived(self._inbox.popleft())
                    continue
                if self.sequencer is not None and not self.sequencer.is_leader:
                    self._follow(driver)
                    continue
                if driver is not None:
                    if self._deferred and not driver.has_early_forward():
                        self._arrived(self._deferred.popleft())
                        continue
                    message = self._poll(0.0)
                    if message is not None and self._defer(driver, message):
                        continue
                    if message is None:
                        task = driver.next_task()
                        if task is not None:
                            self._start(driver, task)
                            continue
                        if driver.done and self.replay is not None:
                            self.replay.check_complete()  # a programmed call left unmade: a flow change
                        if driver.done and not self._posted:
                            self._announce((FINISH,))
                            self._finish(driver)
                            break
                        if driver.done:
                            self.sync_posted()
                        message = self._poll(self._timeout)
                else:
                    message = self._poll(self._timeout)
                if message is not None:
                    self._arrived(message)
            if driver is not None and driver.failure is not None:
                raise driver.failure
        except BaseException as exc:
            self._abort(exc)
            raise
        finally:
            self._shutdown()
            self._driver = None  # the driver refers to this server: freed now, not by a full gc pass
        return self.results

    def _start(self, driver: Driver, task: Task) -> None:
        log.debug("rank %d starts %s", self.rank, task)
        self._announce((TASK, str(task)))
        driver.start(task)

    def _backward_first(self, driver: Driver | None) -> bool:
        """pp_rank 0 (or its TP leader): start a backward the schedule would start now before handling
        any message. Its first act is usually the request that starts the backward on the last stage,
        which otherwise waits behind whatever those messages resume here (a forward's continuation, a
        backward's local half): the last stage idles meanwhile. Forwards still wait for the messages."""
        if driver is None or (self.sequencer is not None and not self.sequencer.is_leader):
            return False
        if not driver.has_backward():
            return False
        task = driver.next_task()
        assert task is not None
        self._start(driver, task)
        return True

    def _defer(self, driver: Driver, message: Any) -> bool:
        """pp_rank 0 (or its TP leader): hold back a response to one of this rank's own requests while the
        simple schedule may start a forward. The response would resume a microbatch already in flight
        (in the benchmark GPT: the rest of the step function up to ``model.backward``, ~0.4 ms of Python
        after a forward's compute), while the next forward's request is what the last stage waits for.
        Requests from other ranks and failures are never held: another rank waits on those."""
        if not isinstance(message, Response) or message.failure is not None or not driver.has_early_forward():
            return False
        self._deferred.append(message)
        return True

    def _finish(self, driver: Driver) -> None:
        self.finished = True
        # per-rank replay: a recorded step that made the same calls as the one before gives each owner
        # its program for the next steps
        replay = self.replay
        programs = replay.learned() if replay is not None and replay.recording else None
        self._send_end(driver.peer_results(), programs or {})

    def _send_end(self, results: Any, programs: dict[int, Program]) -> None:
        # pp_rank 0: tell the other ranks of the pipeline that the step is over.
        for peer in self.peers:
            if peer != self.rank:
                self.send(peer, StepEnd(self.step, results, programs.get(peer)))

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Request):
            self.stats["requests"] += 1
            self.run_job(lambda: self._serve_request(message))
        elif isinstance(message, Response):
            self.stats["responses"] += 1
            posted = self._posted.pop(message.request_id, None)
            if posted is not None:
                posted[1](message)
                return
            slot = self._pending.pop(message.request_id, None)
            if slot is None and self.replay is not None and self.replay.active is not None:
                if message.failure is not None:  # fail now: the parent may wait on a later call
                    raise remote_error(message.failure)
                self._unclaimed[message.request_id] = message  # its owner ran ahead of the parent
                return
            if slot is None:
                log.error("rank %d: response to unknown request %d dropped", self.rank, message.request_id)
                return
            slot.response = message
            self._lend(slot)
        elif isinstance(message, Handoff):
            waiter = self._awaited.pop(message.key, None)
            if waiter is None:
                self._handed[message.key] = message.tensor
            else:
                waiter.handed = message.tensor
                self._lend(waiter)
        elif isinstance(message, PostedAck):
            self._acknowledged(message)
        elif isinstance(message, PostedSync):
            self._sync_wanted(message)
        elif isinstance(message, StepEnd):
            self.finished = True
            self.results = message.results
            if message.program is not None:
                self.new_program = message.program
        elif isinstance(message, StepAbort):
            f = message.failure
            raise PipelineAbortedError(
                f"the step was aborted: {f.describe()}\n--- traceback on rank {f.rank} ---\n{f.traceback}",
                f.exc_type,
                f,
            )
        else:  # pragma: no cover - _poll filters
            log.error("rank %d: unknown message %r dropped", self.rank, type(message))

    def _serve_request(self, request: Request) -> None:
        following: Request | None = request
        while following is not None and self._serve_one(following):
            following = self._request_in_place()

    def _run_program(self, calls: list[ProgramCall]) -> None:
        """Per-rank replay: run one microbatch's programmed calls for pp_rank 0 in order, each once the
        tensors pp_rank 0 sends for it have come (its other inputs come as the shortcut's do)."""
        requester = self.peers[0]
        for call in calls:
            tensors: list[Any] = [None] * call.slots
            for j in call.fed:
                tensors[j] = self.take(("fed", requester, call.request.request_id, j))
            self.stats["replayed"] += 1
            if not self._serve_one(fill(call, self.step, tensors)):
                return

    def _serve_one(self, request: Request) -> bool:
        """Run ``request`` and answer it; False if it failed (its failure answered)."""
        try:
            response = self._handle_request(request)
            if not self._answer_quietly(request, response):
                self._send_flow(request.requester, response, request)  # fast mode: may find a changed flow
            return True
        except ServerClosed:
            raise
        except BaseException as exc:
            phase = request.phase.value if isinstance(request.phase, Phase) else str(request.phase)
            failure = Failure.from_exception(
                exc, rank=self.rank, module=request.module, microbatch=request.microbatch, phase=phase
            )
            log.debug("rank %d: %s", self.rank, failure.describe())
        self.send(request.requester, Response(request.step, request.request_id, self.rank, failure=failure))
        return False

    def _abort(self, exc: BaseException) -> None:
        """Tell the pipeline (and, with TP, the TP group: its ranks wait on each other's orders and
        collectives) that the step failed. A rank told by another passes the news on only under TP: the
        failing rank reaches its own pipeline and TP group, the others reach theirs."""
        targets = set(self.peers) | set(self.sequencer.group if self.sequencer is not None else ())
        targets.discard(self.rank)
        if isinstance(exc, PipelineAbortedError):
            if self.sequencer is None or exc.failure is None:
                return  # another rank aborted and told everyone
            failure: Failure = exc.failure
        else:
            failure = Failure.from_exception(
                exc, rank=self.rank, module="<step>", microbatch=-1, phase="step"
            )
            if failure.rank == self.rank and getattr(exc, "microbatch", None) is None:
                failure.microbatch = getattr(exc, MICROBATCH_ATTR, -1)
        for peer in sorted(targets):
            try:
                self.send(peer, StepAbort(self.step, failure))
            except Exception as send_exc:  # pragma: no cover - transport already broken
                log.error("rank %d: could not tell rank %d about the failure: %s", self.rank, peer, send_exc)

    def _shutdown(self) -> None:
        self.closed = True
        # Idle workers stay for the next step; one still busy (an aborted step) needs a fresh pool.
        if self._own_pool or not self.finished or not self.pool.all_idle():
            self.pool.reset()
        self._wait_sends()

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for handle in sends:
            try:
                handle.wait(timeout=self._timeout)
            except Exception as exc:
                log.warning("rank %d: a pipeline message did not complete: %s", self.rank, exc)
