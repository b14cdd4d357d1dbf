"""The state a step's module server shares among its parts (see mp_pipeline.server).

The server of one rank is one object, :class:`~mp_pipeline.server.Server`, assembled from one module per
mechanism: the wire (receiving, static mode's compact messages; mp_pipeline.wire), waiting in place
(mp_pipeline.in_place), fast mode's handed-off tensors and posted calls (mp_pipeline.handoffs), the tensor-
parallel group's lockstep (mp_pipeline.tp_order) and the main loop (mp_pipeline.server). This module holds
what they all read: the server's state, sending, and a worker thread's pause.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mp_comm.transport.base import SendHandle, Transport
from mp_pipeline.messages import TAG, Entered, Request, Response, StepId
from mp_pipeline.posted import PostedCheck
from mp_pipeline.replay import Program, Replay
from mp_pipeline.schedule import Phase, Task
from mp_pipeline.sequence import Sequencer
from mp_pipeline.static import FlowRecorder, TemplateStore
from mp_pipeline.timeline import RECORDER, EventKind
from mp_pipeline.workers import MAIN, WorkerPool, WorkerState, current_worker

__all__ = ["Driver", "ServerBase"]


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


class ServerBase:
    """One step's module server on one rank: its state (assembled into Server, mp_pipeline.server)."""

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
        """``group``: the global ranks of this rank's tensor-parallel group (tp_rank order), whose
        servers must run in lockstep (:mod:`mp_pipeline.sequence`); empty or just this rank: no TP.
        ``entered``: where to keep the :class:`Entered` messages of ranks that finished the step first
        (PipelineRuntime.enter takes them from there). ``replay`` (pp_rank 0) and ``program`` (another
        rank): per-rank replay (mp_pipeline.replay). ``idle``: work for the time this rank would wait for
        a message (zero_bubble's deferred weight halves), one piece per call, False when none is left."""
        self.idle = idle
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
            "acks": 0,
            "replayed": 0,
        }
        self.sent: dict[str, int] = {}
        """Messages this rank sent in the step, by kind (see count_sent)."""
        self._handed: dict[tuple[str, int, int, int], torch.Tensor] = {}
        """Fast mode: tensors handed to this rank (or kept here) for a later request, by Handoff key."""
        self._awaited: dict[tuple[str, int, int, int], _Slot] = {}
        self._ready: collections.deque[_Slot] = collections.deque()
        """Fast mode: threads whose wait this rank's own work ended (resumed by the main thread next)."""
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

    # -- used by worker threads ------------------------------------------------------------------------
    def next_request_id(self) -> int:
        return next(self._ids)

    def send(self, dest: int, message: object) -> None:
        if self.closed:
            return
        self.count_sent(type(message).__name__)
        self._sends.append(self.transport.send(message, dest, TAG))

    def count_sent(self, kind: str) -> None:
        """Count a message this rank sends in :attr:`sent`, by kind (its class name: Request, Response,
        Handoff, ...; a compact message counts as the request or response it stands for)."""
        self.sent[kind] = self.sent.get(kind, 0) + 1

    def pause(self, token: object) -> None:
        """Give the rank back to the main thread until it hands the baton to ``token``."""
        worker = current_worker()
        if worker is not None:
            worker.state = WorkerState.PENDING
        self.baton.switch(MAIN, token)
        if worker is not None:
            worker.state = WorkerState.EXECUTING

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

    # -- the main loop's, in mp_pipeline.server -----------------------------------------------------------
    def _dispatch(self, message: Any) -> None:
        """Act on a message of this step."""
        raise NotImplementedError

    def _finish(self, driver: Driver) -> None:
        """pp_rank 0: end the step here and tell the pipeline."""
        raise NotImplementedError

    # -- waiting in place's, in mp_pipeline.in_place ---------------------------------------------------
    def _handoff_in_place(self, key: tuple[str, int, int, int]) -> torch.Tensor | None:
        """Wait in this thread for the tensor handed over under ``key`` (None: wait the usual way)."""
        raise NotImplementedError

    # -- fast mode's, in mp_pipeline.handoffs -----------------------------------------------------------
    def sync_posted(self) -> None:
        """pp_rank 0, its tasks done: ask the owners of its posted calls to acknowledge them."""
        raise NotImplementedError
