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

pp_rank 0's main thread, whenever it has the rank, first starts a backward the schedule would start, or a
forward that feeds another rank first (:meth:`Server._urgent_first`), then handles the messages that wait,
except that the simple schedule's next forward goes before responses to this rank's own requests
(:meth:`Server._defer`), then starts the schedule's next task.

Under tensor parallelism the servers of a TP group dispatch the same events in the same order
(mp_pipeline.sequence): the leader announces each event to its followers before dispatching it, and a
follower holds what arrives until the leader names it.

Fast mode's posted calls (mp_pipeline.posted): pp_rank 0 sends them without waiting; their owner answers
a data-free response only with its digest, acknowledged in one :class:`~mp_pipeline.messages.PostedAck`
once pp_rank 0, its tasks done, asks for it (:class:`~mp_pipeline.messages.PostedSync`).

The server is one object holding its parts: the :class:`~mp_pipeline.wire.Wire` (what the rank sends and
receives, static mode's compact messages), the :class:`~mp_pipeline.handoffs.HandoffStore` (fast mode's
handed-off tensors and the waits for them) and, under TP, the :class:`~mp_pipeline.sequence.Sequencer`.

The worker threads belong to a :class:`~mp_pipeline.workers.WorkerPool` that outlives the step (the runtime
owns it): a fresh thread faults its memory in again (tens of thousands of minor page faults for a GPT
block's forward and backward), so idle workers wait for the next step's requests instead of exiting.
"""

from __future__ import annotations

import collections
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mp_comm import waits
from mp_comm.transport.base import Transport
from mp_pipeline.errors import MICROBATCH_ATTR, PipelineAbortedError, PipelineError
from mp_pipeline.handoffs import HandoffKey, HandoffStore, Waiter
from mp_pipeline.link import remote_error
from mp_pipeline.messages import (
    Entered,
    Failure,
    Handoff,
    PostedAck,
    PostedSync,
    Request,
    Response,
    StepAbort,
    StepEnd,
    StepId,
)
from mp_pipeline.posted import PostedCheck, digest, shape_of
from mp_pipeline.replay import Program, ProgramCall, Replay, fill
from mp_pipeline.schedule import Phase, Task
from mp_pipeline.sequence import FINISH, TASK, Event, Order, Sequencer, event_of
from mp_pipeline.static import FlowRecorder, TemplateStore
from mp_pipeline.timeline import RECORDER, EventKind
from mp_pipeline.wire import Wire
from mp_pipeline.workers import MAIN, ServerClosed, WorkerPool, WorkerState, current_worker

__all__ = ["Driver", "Server"]

log = logging.getLogger(__name__)


class Driver(Protocol):
    """What pp_rank 0's server asks of the step driver (see runtime.StepDriver)."""

    failure: BaseException | None

    def next_task(self) -> Task | None: ...

    def has_task(self) -> bool:
        """Whether `next_task` would start a task now (without starting it)."""
        ...

    def has_urgent(self) -> bool:
        """Whether `next_task` would start a backward, or a forward that feeds another rank first, now
        (Scheduler.has_urgent; without starting it)."""
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
        replay: Replay | None = None,
        program: Program | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        """``early``: messages of later steps seen while serving this one (kept for them; shared across
        steps). ``flow``: static mode's record of this rank's messages (None: every message is sent in
        full). ``group``: the global ranks of this rank's tensor-parallel group (tp_rank order), whose
        servers must run in lockstep (:mod:`mp_pipeline.sequence`); empty or just this rank: no TP.
        ``entered``: where to keep the :class:`Entered` messages of ranks that finished the step first
        (PipelineRuntime.enter takes them from there). ``replay`` (pp_rank 0) and ``program`` (another
        rank): per-rank replay (mp_pipeline.replay). ``idle``: work for the time this rank would wait for
        a message (zero_bubble's deferred weight halves), one piece per call, False when none is left."""
        self.transport = transport
        self.rank = rank
        self.peers = peers
        """Global ranks of this rank's pipeline group (pp_rank order)."""
        self.step = step
        self.pool = pool if pool is not None else WorkerPool(rank)
        self._own_pool = pool is None
        self.baton = self.pool.baton
        self.sequencer = Sequencer(rank, group, peers) if len(group) > 1 else None
        """Tensor parallelism: the TP group's one order of events (None without TP)."""
        self._handle_request = handle_request
        self._timeout = timeout
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
            "acks": 0,
            "replayed": 0,
        }
        self.wire = Wire(
            transport=transport,
            rank=rank,
            peers=peers,
            step=step,
            early=early,
            entered=entered if entered is not None else {},
            templates=templates if templates is not None else TemplateStore(),
            flow=flow,
            idle=idle,
            stats=self.stats,
            waiting=weakref.WeakMethod(self._waiting),
        )
        self.handoffs = HandoffStore()
        """Fast mode: tensors handed to this rank for a later request, and the threads waiting for them."""
        self._pending: dict[int, Waiter] = {}
        """Threads waiting for the response to their request, by request id."""
        self._ids = itertools.count()
        self.finished = False
        self.results: Any = None
        self._posted: dict[int, tuple[int, PostedCheck]] = {}
        """Fast mode: requests sent without waiting (see post): their destination and check."""
        self._posted_to: dict[int, int] = {}
        """pp_rank 0: posted calls per destination that answer with an acknowledgement, not a response."""
        self._synced: dict[int, int] = {}
        """pp_rank 0: the count last sent to each destination in a PostedSync."""
        self._ran: dict[int, int] = {}
        """Owner: posted calls run per requester in this step."""
        self._acks: dict[int, list[tuple[int, int | None]]] = {}
        """Owner: posted calls run per requester and not acknowledged yet, with their digests."""
        self._ack_wanted: dict[int, int] = {}
        """Owner: per requester, the count of posted calls after which to acknowledge (PostedSync)."""
        self._driver: Driver | None = None
        self._inbox: collections.deque[Any] = collections.deque()
        """Messages a thread waiting in place took for the main thread (dispatched first, in order)."""
        self._inbox_error: BaseException | None = None
        """An error of a thread waiting in place (a timeout), raised by the main thread."""
        self.replay = replay
        """pp_rank 0: the learned flow (replayed when ``replay.active``) and its recording."""
        self.program = program
        """Another rank: the calls it runs for pp_rank 0 in this step without requests (None: none)."""
        self.new_program: Program | None = None
        """The program pp_rank 0 sent with this step's end, for the steps after it."""
        self._unclaimed: dict[int, Response] = {}
        """pp_rank 0, replaying: responses that came before the parent made their call (owners run
        ahead)."""
        self._deferred: collections.deque[Response] = collections.deque()
        """pp_rank 0: responses to its own requests held back while a forward started first (dispatched
        in order once none may start; see _defer)."""

    @property
    def sent(self) -> dict[str, int]:
        """Messages this rank sent in the step, by kind (see Wire.count_sent)."""
        return self.wire.sent

    # -- used by worker threads: remote calls ------------------------------------------------------------
    def next_request_id(self) -> int:
        return next(self._ids)

    def call(self, dest: int, request: Request) -> Response:
        """Send ``request`` and give the rank to other work until its response arrives."""
        slot = Waiter()
        self._pending[request.request_id] = slot
        sent = RECORDER.now()
        if self.replay is not None and self.replay.recording:
            self.replay.record(dest, request, False)
        self.wire.send_flow(dest, request, request)
        return self._wait_for(slot, request, dest, sent)

    def post(self, dest: int, request: Request, check: PostedCheck) -> None:
        """Fast mode: send ``request`` without waiting for its response, whose content the requester
        predicted from earlier steps. On pp_rank 0 (the driver) the owner sends no response unless the
        call fails or returns data; its digest comes in the owner's :class:`PostedAck` (see
        :meth:`sync_posted`). Elsewhere the response comes back. ``check`` runs on either (it raises on a
        failure or a wrong prediction). The step ends only after every posted request is answered."""
        quiet = self._driver is not None and check.digest is not None
        request.posted = quiet
        self._posted[request.request_id] = (dest, check)
        if quiet:
            self._posted_to[dest] = self._posted_to.get(dest, 0) + 1
        if self.replay is not None and self.replay.recording:
            self.replay.record(dest, request, quiet)
        self.stats["posted"] += 1
        if RECORDER.enabled:
            now = RECORDER.now()
            self._record(EventKind.REQUEST, request, dest, now, now)
        self.wire.send_flow(dest, request, request)

    def replayed(self, dest: int, request: Request, check: PostedCheck | None) -> Response | None:
        """pp_rank 0, replaying (mp_pipeline.replay): the programmed call ``request`` (its id the
        program's). Its owner runs it without a request: only the tensors it needs from here travel.
        ``check``: a posted call (checked on its acknowledgement; returns None); else its response, which
        the owner sends unprompted (it may have come already: owners run ahead)."""
        rid = request.request_id
        sent = RECORDER.now()
        # The tensors first: the owner waits for them, and nothing below is needed before they leave (only
        # this thread takes the response, once it waits for it).
        for j, t in enumerate(request.tensors):
            if t is not None:
                self.wire.send_handoff(dest, Handoff(self.step, ("fed", self.rank, rid, j), t))
        self.wire.account(dest, request, self.replay.static.get(rid) if self.replay is not None else None)
        self.stats["replayed"] += 1
        early = self._unclaimed.pop(rid, None)
        slot = None
        if check is not None:
            self._posted[rid] = (dest, check)
            self._posted_to[dest] = self._posted_to.get(dest, 0) + 1
            self.stats["posted"] += 1
        elif early is None:
            slot = self._pending[rid] = Waiter()
        if check is not None:
            if early is not None:  # a failure, or data where none was predicted
                self._posted.pop(rid, None)
                check(early)
            return None
        if early is not None:
            self.stats["responses"] += 1
            return early
        assert slot is not None
        return self._wait_for(slot, request, dest, sent)

    def _wait_for(self, slot: Waiter, request: Request, dest: int, sent: int) -> Response:
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
            self._record(EventKind.REQUEST, request, dest, sent, sent)
            self._record(EventKind.WAIT, request, dest, sent, RECORDER.now())
        if worker is not None:
            worker.state = WorkerState.EXECUTING
        assert slot.response is not None
        return slot.response

    def _record(self, kind: EventKind, request: Request, dest: int, start_ns: int, end_ns: int) -> None:
        """Timeline: an event of ``request`` to (or waiting on) rank ``dest``."""
        RECORDER.add(
            kind,
            rank=self.rank,
            step=self.step.step,
            module=request.module,
            microbatch=request.microbatch,
            start_ns=start_ns,
            end_ns=end_ns,
            phase=request.phase.value if isinstance(request.phase, Phase) else str(request.phase),
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

    # -- used by worker threads: fast mode's handed-off tensors ------------------------------------------
    def hand(self, dest: int, key: HandoffKey, tensor: torch.Tensor) -> None:
        """Fast mode: give ``tensor`` to rank ``dest`` (this rank too) for the request that will name
        ``key`` (see mp_pipeline.fast)."""
        self.stats["handoffs"] += 1
        if dest == self.rank:
            # the consumer here may already wait for it: its request was posted before this one ended
            waiter = self.handoffs.put(key, tensor)
            if waiter is not None:
                self.handoffs.ready.append(waiter)
        else:
            self.wire.send_handoff(dest, Handoff(self.step, key, tensor))

    def take(self, key: HandoffKey) -> torch.Tensor:
        """Fast mode: the tensor handed over under ``key``, waiting for it (the rank serves other work
        meanwhile): it comes from another rank than the request that names it, in no fixed order."""
        found = self.handoffs.pop(key)
        if found is None:
            found = self._handoff_in_place(key)
        if found is not None:
            return found
        slot = self.handoffs.wait(key)
        self.pause(slot)
        assert slot.handed is not None
        return slot.handed

    def await_local(self, key: HandoffKey) -> None:
        """Fast mode: wait (the rank serves other work meanwhile) until this rank's own work calls
        :meth:`wake` with ``key``."""
        self.pause(self.handoffs.wait(key))

    def wake(self, key: HandoffKey) -> None:
        """Resume the thread that waits for ``key`` in :meth:`await_local`, if any."""
        self.handoffs.wake(key)

    # -- the main thread ---------------------------------------------------------------------------------
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
        wire, ready = self.wire, self.handoffs.ready
        try:
            for message in wire.take_early():
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
                if self._urgent_first(driver):
                    continue
                if ready:  # a wait that this rank's own work ended (fast mode)
                    self._lend(ready.popleft())
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
                    message = wire.poll(0.0)
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
                        message = wire.poll(self._timeout)
                else:
                    message = wire.poll(self._timeout)
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

    def _urgent_first(self, driver: Driver | None) -> bool:
        """pp_rank 0 (or its TP leader): start a backward the schedule would start now before handling
        any message. Its first act is usually the request that starts the backward on the last stage,
        which otherwise waits behind whatever those messages resume here (a forward's continuation, a
        backward's local half): the last stage idles meanwhile. So does a forward whose first act feeds
        another rank (Scheduler.feed_first): it returns here at that call. Other forwards wait for the
        messages."""
        if driver is None or (self.sequencer is not None and not self.sequencer.is_leader):
            return False
        if not driver.has_urgent():
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
        """pp_rank 0: end the step here and tell the pipeline (with each owner's program for the next
        steps, when a recorded step made the same calls as the one before: per-rank replay)."""
        self.finished = True
        replay = self.replay
        programs = (replay.learned() if replay is not None and replay.recording else None) or {}
        results = driver.peer_results()
        for peer in self.peers:
            if peer != self.rank:
                self.wire.send(peer, StepEnd(self.step, results, programs.get(peer)))

    # -- dispatch, in the TP group's order -----------------------------------------------------------------
    def _arrived(self, message: Any) -> None:
        """A message of this step: dispatched now (a TP leader first tells its followers), or, on a TP
        follower, held until the leader names it. An abort, or a failed request's answer, is dispatched
        at once everywhere: the step ends either way, and the failure must not wait for an order. So are
        posted calls' acknowledgements and the requests for them: they run nothing."""
        seq = self.sequencer
        if (
            seq is None
            or isinstance(message, StepAbort | PostedAck | PostedSync)
            or (isinstance(message, Response) and message.failure is not None)
        ):
            self._dispatch(message)
        elif seq.is_leader:
            self._announce(event_of(message, self.peers))
            self._dispatch(message)
        else:
            seq.hold(message)

    def _announce(self, event: Event) -> None:
        """TP leader: tell the followers the event dispatched next (before it runs: it may wait for them)."""
        if self.sequencer is not None:
            log.debug("rank %d (TP leader) dispatches %s", self.rank, event)
            for follower in self.sequencer.followers:
                self.wire.send(follower, Order(self.step, event))

    def _follow(self, driver: Driver | None) -> None:
        """TP follower: dispatch the event the leader dispatched next, waiting for its order and message."""
        seq = self.sequencer
        assert seq is not None
        event = seq.next_order()
        if event is not None and event[0] in (TASK, FINISH):
            self._follow_task(driver, event)
            return
        message = seq.take(event) if event is not None else None
        if message is None:  # the order or its message has not arrived yet
            self._arrived(self.wire.poll(self._timeout))
            return
        log.debug("rank %d (TP follower) dispatches %s", self.rank, event)
        self._dispatch(message)

    def _follow_task(self, driver: Driver | None, event: Event) -> None:
        """TP follower on pp_rank 0: start the task the leader started, or end the step as it did."""
        seq = self.sequencer
        assert seq is not None
        if driver is None:
            raise PipelineError(f"rank {self.rank}: the leader ordered {event}; this is not pp_rank 0")
        if event[0] == FINISH:
            if not driver.done:
                raise PipelineError(
                    f"rank {self.rank}: TP leader rank {seq.leader} ended the step, this rank's schedule "
                    "is not done: the tensor-parallel ranks ran different steps"
                )
            if self._posted:  # this rank's own posted calls first: the step's end ends the owners' serving
                self.sync_posted()
                self._arrived(self.wire.poll(self._timeout))
                return
            seq.done_order()
            self._finish(driver)
            return
        seq.done_order()
        task = driver.next_task()
        if task is None or str(task) != event[1]:
            raise PipelineError(
                f"rank {self.rank}: TP leader rank {seq.leader} started task {event[1]}, this rank's "
                f"schedule has {task}: the tensor-parallel ranks ran different steps"
            )
        driver.start(task)

    def _dispatch(self, message: Any) -> None:
        """Act on a message of this step."""
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
            waiter = self.handoffs.put(message.key, message.tensor)
            if waiter is not None:
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
        else:  # pragma: no cover - the wire's poll filters
            log.error("rank %d: unknown message %r dropped", self.rank, type(message))

    # -- answering requests --------------------------------------------------------------------------------
    def _serve_request(self, request: Request) -> None:
        following: Request | None = request
        while following is not None and self._serve_one(following):
            following = self._request_in_place()

    def _run_program(self, calls: list[ProgramCall]) -> None:
        """Per-rank replay: run one microbatch's programmed calls for pp_rank 0 in order, each once the
        tensors pp_rank 0 sends for it have come (its other inputs come as the shortcut's do)."""
        requester, step, stats, serve = self.peers[0], self.step, self.stats, self._serve_one
        for call in calls:
            tensors: list[Any] = [None] * call.slots
            for j in call.fed:  # the calls of a run served as one graph have none: nothing to wait for
                tensors[j] = self.take(("fed", requester, call.request.request_id, j))
            stats["replayed"] += 1
            if not serve(fill(call, step, tensors)):
                return

    def _serve_one(self, request: Request) -> bool:
        """Run ``request`` and answer it; False if it failed (its failure answered)."""
        try:
            response = self._handle_request(request)
            if not self._answer_quietly(request, response):  # fast mode: the response may find a changed flow
                self.wire.send_flow(request.requester, response, request)
            return True
        except ServerClosed:
            raise
        except BaseException as exc:
            phase = request.phase.value if isinstance(request.phase, Phase) else str(request.phase)
            failure = Failure.from_exception(
                exc, rank=self.rank, module=request.module, microbatch=request.microbatch, phase=phase
            )
            log.debug("rank %d: %s", self.rank, failure.describe())
        self.wire.send(
            request.requester, Response(request.step, request.request_id, self.rank, failure=failure)
        )
        return False

    # -- posted calls (mp_pipeline.posted) -----------------------------------------------------------------
    def _answer_quietly(self, request: Request, response: Response) -> bool:
        """Owner: whether ``response`` (no failure) to pp_rank 0 is not sent as a message of the flow.
        A data-free one carries its digest (awaited: sent in full, outside static mode's recording, which
        must be the same whether or not the call is posted) or is only acknowledged (posted)."""
        if request.requester != self.peers[0]:
            return False
        shape = shape_of(response)
        if shape is None:
            if request.posted:  # data after all: sent (the requester finds the flow change), listed as such
                self._ran_posted(request, None)
            return False
        if request.posted:
            self._ran_posted(request, digest(shape))
        else:
            response.digest = digest(shape)
            self.wire.send(request.requester, response)
        return True

    def _ran_posted(self, request: Request, fingerprint: int | None) -> None:
        requester = request.requester
        self._acks.setdefault(requester, []).append((request.request_id, fingerprint))
        self._ran[requester] = self._ran.get(requester, 0) + 1
        self._maybe_ack(requester)

    def _maybe_ack(self, requester: int) -> None:
        wanted = self._ack_wanted.get(requester)
        if wanted is not None and self._ran.get(requester, 0) >= wanted:
            del self._ack_wanted[requester]
            done = tuple(self._acks.pop(requester, ()))
            self.wire.send(requester, PostedAck(self.step, done))

    def _sync_wanted(self, message: PostedSync) -> None:
        """Owner: acknowledge ``message.count`` posted calls of its requester once they have run."""
        self._ack_wanted[message.requester] = message.count
        self._maybe_ack(message.requester)

    def sync_posted(self) -> None:
        """pp_rank 0, its tasks done: ask each owner of posted calls not acknowledged yet for its
        acknowledgement once it has run as many as were posted to it (once per count)."""
        for dest, count in self._posted_to.items():
            if self._synced.get(dest) != count:
                self._synced[dest] = count
                self.wire.send(dest, PostedSync(self.step, self.rank, count))

    def _acknowledged(self, message: PostedAck) -> None:
        """pp_rank 0: check each acknowledged call's digest against its prediction."""
        self.stats["acks"] += 1
        for request_id, got in message.done:
            entry = self._posted.pop(request_id, None)
            if entry is not None:
                entry[1].acked(got)

    # -- waiting in place (see the module docstring) -------------------------------------------------------
    def _polls_in_place(self) -> bool:
        """Whether the thread holding the rank may wait for the next message itself: the main thread
        would do nothing else (tasks become startable only through messages, which go to it)."""
        if (
            self.sequencer is not None
            or self.finished
            or self.wire.closed
            or self._inbox
            or self._deferred
            or self.handoffs.ready
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
            return self.wire.poll(self._timeout)
        except BaseException as exc:
            self._inbox_error = exc
            return None
        finally:
            self.transport.set_busy(True)

    def _response_in_place(self, slot: Waiter) -> bool:
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

    def _handoff_in_place(self, key: HandoffKey) -> torch.Tensor | None:
        """Wait for the tensor handed over under ``key`` in this thread; None, after handing what came
        instead to the main thread, when it must wait the usual way."""
        message = self._take_in_place()
        if message is None:
            return None
        if isinstance(message, Handoff) and message.key == key:
            self.stats["in_place"] += 1
            return message.tensor
        self._inbox.append(message)
        return None

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

    # -- the step's end ------------------------------------------------------------------------------------
    def _waiting(self) -> str:
        """What this rank waits for (for the error of a wait that timed out)."""
        tp = ""
        seq = self.sequencer
        if seq is not None and seq.is_leader:
            tp = f"; TP leader of {list(seq.group)}"
        elif seq is not None:
            tp = f"; TP follower of rank {seq.leader}, {seq.describe()}"
        return (
            f"waiting on {len(self._pending)} response(s) and {self.handoffs.waiting} handed-off "
            f"tensor(s); workers: {[w.state.value for w in self.pool.workers]}{tp}"
        )

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
                self.wire.send(peer, StepAbort(self.step, failure))
            except Exception as send_exc:  # pragma: no cover - transport already broken
                log.error("rank %d: could not tell rank %d about the failure: %s", self.rank, peer, send_exc)

    def _shutdown(self) -> None:
        self.wire.close()
        # Idle workers stay for the next step; one still busy (an aborted step) needs a fresh pool.
        if self._own_pool or not self.finished or not self.pool.all_idle():
            self.pool.reset()
        self.wire.wait_sends(self._timeout)
