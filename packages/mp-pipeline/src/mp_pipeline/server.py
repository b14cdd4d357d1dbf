"""The module server of one rank (seed 001 §4.2): input queue, main thread, worker threads.

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

The worker threads belong to a :class:`~mp_pipeline.workers.WorkerPool` that outlives the step (the runtime
owns it): a fresh thread faults its memory in again (tens of thousands of minor page faults for a GPT
block's forward and backward), so idle workers wait for the next step's requests instead of exiting.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mp_comm import waits
from mp_comm.errors import PeerTimeoutError
from mp_comm.transport.base import ANY_SOURCE, ANY_TAG, SendHandle, Transport
from mp_pipeline.errors import PipelineAbortedError, PipelineError, PipelineTimeoutError, collective_mismatch
from mp_pipeline.messages import (
    TAG,
    Compact,
    Entered,
    Failure,
    Handoff,
    Request,
    Response,
    StepAbort,
    StepEnd,
    StepId,
    is_pipeline_tag,
    static_tag,
)
from mp_pipeline.schedule import Phase, Task
from mp_pipeline.sequence import FINISH, TASK, Event, Order, Sequencer, event_of
from mp_pipeline.static import FlowRecorder, Key, TemplateStore, expand, template_of
from mp_pipeline.timeline import RECORDER, EventKind
from mp_pipeline.workers import MAIN, ServerClosed, WorkerPool, WorkerState, current_worker

__all__ = ["Driver", "Server"]

log = logging.getLogger(__name__)


class _Slot:
    __slots__ = ("handed", "response")

    def __init__(self) -> None:
        self.response: Response | None = None
        self.handed: torch.Tensor | None = None


class Driver(Protocol):
    """What pp_rank 0's server asks of the step driver (see runtime.StepDriver)."""

    failure: BaseException | None

    def next_task(self) -> Task | None: ...

    def has_task(self) -> bool:
        """Whether `next_task` would start a task now (without starting it)."""
        ...

    def has_backward(self) -> bool:
        """Whether `next_task` would start a backward now (without starting it)."""
        ...

    def has_early_forward(self) -> bool:
        """Whether `next_task` would start a forward that may go before waiting responses (see
        Scheduler.has_early_forward; without starting it)."""
        ...

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
        pool: WorkerPool | None = None,
        flow: FlowRecorder | None = None,
        templates: TemplateStore | None = None,
        group: tuple[int, ...] = (),
        entered: dict[int, list[Entered]] | None = None,
    ) -> None:
        """``group``: the global ranks of this rank's tensor-parallel group (tp_rank order), whose
        servers must run in lockstep (:mod:`mp_pipeline.sequence`); empty or just this rank: no TP.
        ``entered``: where to keep the :class:`Entered` messages of ranks that finished the step first
        (PipelineRuntime.enter takes them from there)."""
        self.transport = transport
        self.rank = rank
        self.peers = peers
        """Global ranks of this rank's pipeline group (pp_rank order)."""
        self.step = step
        self.pool = pool if pool is not None else WorkerPool(rank)
        self._own_pool = pool is None
        self.baton = self.pool.baton
        self.flow = flow
        """Static mode: the record of this rank's messages (None: every message is sent in full)."""
        self.templates = templates if templates is not None else TemplateStore()
        self.sequencer = Sequencer(rank, group, peers) if len(group) > 1 else None
        """Tensor parallelism: the TP group's one order of events (None without TP)."""
        self._handle_request = handle_request
        self._timeout = timeout
        self._pending: dict[int, _Slot] = {}
        self._ids = itertools.count()
        self._early = early
        """Messages of later steps seen while serving this one (kept for them; shared across steps)."""
        self._entered = entered if entered is not None else {}
        self._sends: list[SendHandle] = []
        self.finished = False
        self.results: Any = None
        self.closed = False
        self.stats = {
            "requests": 0,
            "responses": 0,
            "workers": 0,
            "compact_sent": 0,
            "compact_received": 0,
            "shortcuts": 0,
            "handoffs": 0,
            "tensor_bytes": 0,
            "in_place": 0,
            "posted": 0,
        }
        self._handed: dict[tuple[str, int, int, int], torch.Tensor] = {}
        """Fast mode: tensors handed to this rank (or kept here) for a later request, by Handoff key."""
        self._awaited: dict[tuple[str, int, int, int], _Slot] = {}
        self._ready: collections.deque[_Slot] = collections.deque()
        """Fast mode: threads whose wait this rank's own work ended (resumed by the main thread next)."""
        self._posted: dict[int, Callable[[Response], None]] = {}
        """Fast mode: requests sent without waiting (see post), with the check of their response."""
        self._driver: Driver | None = None
        self._inbox: collections.deque[Any] = collections.deque()
        """Messages a thread waiting in place took for the main thread (dispatched first, in order)."""
        self._inbox_error: BaseException | None = None
        """An error of a thread waiting in place (a timeout), raised by the main thread."""
        self._deferred: collections.deque[Response] = collections.deque()
        """pp_rank 0: responses to its own requests held back while a forward started first (dispatched
        in order once none may start; see _defer)."""

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
        self._send_flow(dest, request, request)
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

    def post(self, dest: int, request: Request, check: Callable[[Response], None]) -> None:
        """Fast mode: send ``request`` without waiting for its response, whose content the requester
        predicted from earlier steps; ``check`` runs on the response when it arrives (it raises on a
        failure or a wrong prediction). The step ends only after every posted request is answered."""
        self._posted[request.request_id] = check
        self.stats["posted"] += 1
        if RECORDER.enabled:
            now = RECORDER.now()
            RECORDER.add(
                EventKind.REQUEST,
                rank=self.rank,
                step=self.step.step,
                module=request.module,
                microbatch=request.microbatch,
                start_ns=now,
                end_ns=now,
                phase=request.phase.value if isinstance(request.phase, Phase) else str(request.phase),
                peer=dest,
            )
        self._send_flow(dest, request, request)

    def hand(self, dest: int, key: tuple[str, int, int, int], tensor: torch.Tensor) -> None:
        """Fast mode: give ``tensor`` to rank ``dest`` (this rank too) for the request that will name
        ``key`` (see mp_pipeline.fast)."""
        self.stats["handoffs"] += 1
        if dest == self.rank:
            # the consumer here may already wait for it: its request was posted before this one ended
            waiter = self._awaited.pop(key, None)
            if waiter is None:
                self._handed[key] = tensor
            else:
                waiter.handed = tensor
                self._ready.append(waiter)
        elif not self.closed:
            self.stats["tensor_bytes"] += tensor.nbytes
            self._sends.append(self.transport.send(Handoff(self.step, key, tensor), dest, TAG))

    def take(self, key: tuple[str, int, int, int]) -> torch.Tensor:
        """Fast mode: the tensor handed over under ``key``, waiting for it (the rank serves other work
        meanwhile): it comes from another rank than the request that names it, in no fixed order."""
        found = self._handed.pop(key, None)
        if found is not None:
            return found
        slot = _Slot()
        self._awaited[key] = slot
        self.pause(slot)
        assert slot.handed is not None
        return slot.handed

    def await_local(self, key: tuple[str, int, int, int]) -> None:
        """Fast mode: wait (the rank serves other work meanwhile) until this rank's own work calls
        :meth:`wake` with ``key``."""
        slot = _Slot()
        self._awaited[key] = slot
        self.pause(slot)

    def wake(self, key: tuple[str, int, int, int]) -> None:
        """Resume the thread that waits for ``key`` in :meth:`await_local`, if any."""
        waiter = self._awaited.pop(key, None)
        if waiter is not None:
            self._ready.append(waiter)

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
        worker = current_worker()
        if worker is not None:
            worker.state = WorkerState.PENDING
        self.baton.switch(MAIN, token)
        if worker is not None:
            worker.state = WorkerState.EXECUTING

    # -- waiting in place (see the module docstring) ----------------------------------------------------
    def _polls_in_place(self) -> bool:
        """Whether the thread holding the rank may wait for the next message itself: the main thread
        would do nothing else (tasks become startable only through messages, which go to it)."""
        if (
            self.sequencer is not None
            or self.finished
            or self.closed
            or self._inbox
            or self._deferred
            or self._ready
        ):
            return False
        driver = self._driver
        return driver is None or not (driver.failure is not None or driver.done or driver.has_task())

    def _take_in_place(self) -> Any:
        """The next message of this step, taken by the thread holding the rank; None if it may not wait
        (or the wait failed: the main thread raises the error)."""
        if not self._polls_in_place():
            return None
        self.transport.set_busy(False)
        try:
            return self._poll(self._timeout)
        except BaseException as exc:
            self._inbox_error = exc
            return None
        finally:
            self.transport.set_busy(True)

    def _response_in_place(self, slot: _Slot) -> bool:
        """Wait for the response ``slot`` waits for in this thread; False, after handing what came instead
        to the main thread, when it must wait the usual way."""
        message = self._take_in_place()
        if message is None:
            return False
        if isinstance(message, Response) and self._pending.get(message.request_id) is slot:
            del self._pending[message.request_id]
            self.stats["responses"] += 1
            self.stats["in_place"] += 1
            slot.response = message
            return True
        self._inbox.append(message)
        return False

    def _request_in_place(self) -> Request | None:
        """After answering a request: the next one, if it is the next message and this thread may wait."""
        message = self._take_in_place()
        if message is None:
            return None
        if isinstance(message, Request):
            self.stats["requests"] += 1
            self.stats["in_place"] += 1
            return message
        self._inbox.append(message)
        return None

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
                        if driver.done and not self._posted:
                            self._announce((FINISH,))
                            self._finish(driver)
                            break
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

    def _sequence_state(self) -> str:
        seq = self.sequencer
        if seq is None:
            return ""
        if seq.is_leader:
            return f"; TP leader of {list(seq.group)}"
        return f"; TP follower of rank {seq.leader}, {seq.describe()}"

    def _finish(self, driver: Driver) -> None:
        self.finished = True
        self._send_end(driver.peer_results())

    def _arrived(self, message: Any) -> None:
        """A message of this step: dispatched now (a leader first tells its followers), or, on a
        follower, held until the leader names it. An abort, or a failed request's answer, is dispatched
        at once everywhere: the step ends either way, and the failure must not wait for an order."""
        seq = self.sequencer
        if (
            seq is None
            or isinstance(message, StepAbort)
            or (isinstance(message, Response) and message.failure is not None)
        ):
            self._dispatch(message)
        elif seq.is_leader:
            self._announce(event_of(message, self.peers))
            self._dispatch(message)
        else:
            seq.hold(message)

    def _announce(self, event: Event) -> None:
        """Leader: tell the followers the event dispatched next (before it runs: it may wait for them)."""
        if self.sequencer is not None:
            log.debug("rank %d (TP leader) dispatches %s", self.rank, event)
            for follower in self.sequencer.followers:
                self.send(follower, Order(self.step, event))

    def _follow(self, driver: Driver | None) -> None:
        """Follower: dispatch the event the leader dispatched next, waiting for its order and message."""
        seq = self.sequencer
        assert seq is not None
        event = seq.next_order()
        if event is not None and event[0] in (TASK, FINISH):
            self._follow_task(driver, event)
            return
        message = seq.take(event) if event is not None else None
        if message is None:  # the order or its message has not arrived yet
            self._arrived(self._poll(self._timeout))
            return
        log.debug("rank %d (TP follower) dispatches %s", self.rank, event)
        self._dispatch(message)

    def _follow_task(self, driver: Driver | None, event: Event) -> None:
        """Follower on pp_rank 0: start the task the leader started, or end the step as it did."""
        seq = self.sequencer
        assert seq is not None
        if driver is None:
            raise PipelineError(f"rank {self.rank}: the leader ordered {event}; this is not pp_rank 0")
        seq.done_order()
        if event[0] == FINISH:
            if not driver.done:
                raise PipelineError(
                    f"rank {self.rank}: TP leader rank {seq.leader} ended the step, this rank's schedule "
                    "is not done: the tensor-parallel ranks ran different steps"
                )
            self._finish(driver)
            return
        task = driver.next_task()
        if task is None or str(task) != event[1]:
            raise PipelineError(
                f"rank {self.rank}: TP leader rank {seq.leader} started task {event[1]}, this rank's "
                f"schedule has {task}: the tensor-parallel ranks ran different steps"
            )
        driver.start(task)

    def _send_end(self, results: Any) -> None:
        # pp_rank 0: tell the other ranks of the pipeline that the step is over.
        for peer in self.peers:
            if peer != self.rank:
                self.send(peer, StepEnd(self.step, results))

    # -- internals -------------------------------------------------------------------------------------
    def _take_early(self) -> list[Any]:
        for m in self._early:
            self._check_function(m.step, None)
        mine = [m for m in self._early if m.step == self.step]
        self._early[:] = [m for m in self._early if m.step > self.step]
        return mine

    def _check_function(self, step: StepId, source: int | None) -> None:
        """A message of this step number from another step function: the script called a step function
        on some ranks only (an evaluation step on rank 0, say). Served, its requests would run inside
        this rank's step as if they were part of it."""
        if step.model == self.step.model and step.step == self.step.step and step.fn != self.step.fn:
            who = f"rank {source}" if source is not None else "another rank of the pipeline"
            raise PipelineError(
                f"{who} runs step function {step.fn!r} as step {step.step} of the model, while rank "
                f"{self.rank} runs {self.step.fn!r}: every rank must call the same step functions in the "
                "same order (a step function called on some ranks only, e.g. an evaluation under "
                "`if smp.rank() == 0:`?)"
            )

    def _poll(self, timeout: float) -> Any:
        while True:
            try:
                received = self.transport.recv(ANY_SOURCE, ANY_TAG, timeout=timeout)
            except PeerTimeoutError:
                if timeout == 0.0:
                    return None
                raise PipelineTimeoutError(
                    f"rank {self.rank} received no pipeline message within {timeout:g} s in step "
                    f"{self.step.step} (waiting on {len(self._pending)} response(s) and "
                    f"{len(self._awaited)} handed-off tensor(s); workers: "
                    f"{[w.state.value for w in self.pool.workers]}{self._sequence_state()}). A rank of "
                    f"pipeline {list(self.peers)} is stuck or dead; raise MP_PIPELINE_TIMEOUT for very long "
                    "module executions."
                ) from None
            message = self._received(received.source, received.tag, received.obj)
            if isinstance(message, Entered):
                self._entered_meanwhile(received.source, message)
                continue
            step = getattr(message, "step", None)
            if not isinstance(step, StepId):
                log.error("rank %d: dropping a non-pipeline message %r", self.rank, type(received.obj))
                continue
            self._check_function(step, received.source)
            if step < self.step:
                log.debug("rank %d: dropping a message of the earlier step %s", self.rank, step)
                continue
            if step > self.step:
                self._early.append(message)
                continue
            return message

    def _entered_meanwhile(self, source: int, message: Entered) -> None:
        """Another rank of the pipeline entered a collective while this rank serves a step. From pp_rank 0,
        which starts every step and sent this step's end before anything later, it means that pp_rank 0
        will not come back to this step: the script called the collective on some ranks only (smp's most
        common hang). From another rank it may just have finished the step first: kept for later."""
        top = self.peers[0]
        if source == top and self.rank != top:
            raise collective_mismatch(
                f"rank {top} (pp_rank 0) entered {message.what}, which every rank of pipeline "
                f"{list(self.peers)} must call together, while rank {self.rank} is in step {self.step.step} "
                f"(of {self.step.fn or 'a step function'})"
            )
        self._entered.setdefault(source, []).append(message)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Request):
            self.stats["requests"] += 1
            self.run_job(lambda: self._serve_request(message))
        elif isinstance(message, Response):
            self.stats["responses"] += 1
            check = self._posted.pop(message.request_id, None)
            if check is not None:
                check(message)
                return
            slot = self._pending.pop(message.request_id, None)
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
        elif isinstance(message, StepEnd):
            self.finished = True
            self.results = message.results
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
        try:
            while True:
                response = self._handle_request(request)
                self._send_flow(request.requester, response, request)  # fast mode: may find a changed flow
                following = self._request_in_place()
                if following is None:
                    return
                request = following
        except ServerClosed:
            raise
        except BaseException as exc:
            phase = request.phase.value if isinstance(request.phase, Phase) else str(request.phase)
            failure = Failure.from_exception(
                exc, rank=self.rank, module=request.module, microbatch=request.microbatch, phase=phase
            )
            log.debug("rank %d: %s", self.rank, failure.describe())
        self.send(request.requester, Response(request.step, request.request_id, self.rank, failure=failure))

    # -- static mode -----------------------------------------------------------------------------------
    def _send_flow(self, dest: int, message: Request | Response, request: Request) -> None:
        """Send a request or the response to ``request``: compact when static mode replays it."""
        moved = sum(t.nbytes for t in message.tensors if t is not None and not t.is_meta)  # meta: no data
        self.stats["tensor_bytes"] += moved
        flow = self.flow
        if flow is None or self.closed or (isinstance(message, Response) and message.failure is not None):
            self.send(dest, message)
            return
        is_response = isinstance(message, Response)
        key = Key(dest, is_response, request.phase, request.module, request.position, request.microbatch, 0)
        key = flow.counted(key)
        plan = flow.outgoing(key, template_of(message))
        if plan is None:
            self.send(dest, message)
            return
        tag = static_tag(plan.template_id)  # the transport skips the tensors' metadata after the first
        if plan.compact:
            forward_id = message.forward_id if isinstance(message, Request) else None
            refs = message.refs if isinstance(message, Request) else ()
            out: object = Compact(
                message.step, plan.template_id, message.request_id, message.tensors, forward_id, refs
            )
            self.stats["compact_sent"] += 1
        else:  # in full; the first one of a template leaves it at the receiver
            message.template_id = plan.template_id if plan.announce else None
            out = message
        if not self.closed:
            self._sends.append(self.transport.send(out, dest, tag, static=True))

    def _received(self, source: int, tag: object, message: Any) -> Any:
        """A received object as a full message: keeps announced templates, rebuilds compact messages."""
        if not is_pipeline_tag(tag):
            return None  # not a pipeline message (dropped by the caller)
        if isinstance(message, Compact):
            self.stats["compact_received"] += 1
            return expand(self.templates.get(source, message.template_id), message)
        if isinstance(message, Request | Response) and message.template_id is not None:
            self.templates.put(source, message.template_id, dataclasses.replace(message, tensors=[]))
        return message

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
                failure.microbatch = getattr(exc, "_mp_microbatch", -1)
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
