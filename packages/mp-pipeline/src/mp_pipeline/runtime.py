"""The per-step driver: one pipelined step of a partitioned model on one rank.

Every rank of a pipeline calls :meth:`PipelineRuntime.run_step` at the same step. On pp_rank 0 the
:class:`StepDriver` starts the step function's microbatches as the :class:`~mp_pipeline.schedule.Scheduler`
decides (each in a worker thread of the module server, paused at its first ``model.backward`` until
the schedule starts its backward); the other ranks serve requests until pp_rank 0 sends the end of the
step, with the step's results. A failure anywhere ends the step on every rank of the pipeline with an
error that names the rank, the module and the original traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mp_comm.errors import PeerTimeoutError
from mp_comm.transport.base import Transport
from mp_pipeline.context import ExecState, TaskContext, applied, current, task_context
from mp_pipeline.errors import (
    MICROBATCH_ATTR,
    FlowChangedError,
    NotInStepError,
    PipelineError,
    collective_mismatch,
)
from mp_pipeline.fast import FastPlan
from mp_pipeline.messages import ENTERED_TAG, Entered, StepId, is_pipeline_tag
from mp_pipeline.posted import Predictions
from mp_pipeline.remote import Remote
from mp_pipeline.replay import Program, Replay
from mp_pipeline.schedule import Phase, Scheduler, Task
from mp_pipeline.server import Server
from mp_pipeline.split_backward import WeightQueue
from mp_pipeline.static import FlowRecorder, TemplateStore, default_record_steps
from mp_pipeline.structure import flatten, map_structure
from mp_pipeline.timeline import RECORDER, STEP_MODULE, EventKind
from mp_pipeline.workers import ServerClosed, WorkerPool

__all__ = ["PipelineRuntime", "StepDriver", "default_timeout", "pipelined_backward"]

log = logging.getLogger(__name__)


def default_timeout() -> float:
    """Seconds a rank waits for a pipeline message before failing the step (MP_PIPELINE_TIMEOUT)."""
    return float(os.environ.get("MP_PIPELINE_TIMEOUT", "300"))


def pipelined_backward(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    grad_tensors: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
) -> None:
    """``torch.autograd.backward`` inside a step function: on pp_rank 0 the microbatch first waits for
    the schedule to start its backward. Raises NotInStepError outside a step."""
    task = current()
    if task is None:
        raise NotInStepError("backward outside a step function")
    task.backward_calls += 1
    if task.on_backward is not None and task.backward_calls == 1:
        task.on_backward()
    torch.autograd.backward(tensors, grad_tensors)


class StepDriver:
    """pp_rank 0's side of a step: the scheduler's tasks as jobs of the module server."""

    def __init__(
        self,
        server: Server,
        scheduler: Scheduler,
        body: Callable[[int], Any],
        state: ExecState,
        plan: FastPlan | None = None,
    ) -> None:
        self.server = server
        self.plan = plan
        """Fast mode: the plan that watches the step function while it learns."""
        self.scheduler = scheduler
        self.body = body
        self.state = state
        self.results: dict[int, Any] = {}
        self.failure: BaseException | None = None
        self._paused: dict[int, object] = {}

    @property
    def done(self) -> bool:
        return self.scheduler.done

    def next_task(self) -> Task | None:
        return None if self.failure is not None else self.scheduler.next_task()

    def has_task(self) -> bool:
        return self.failure is None and self.scheduler.has_task()

    def has_urgent(self) -> bool:
        return self.failure is None and self.scheduler.has_urgent()

    def has_early_forward(self) -> bool:
        return self.failure is None and self.scheduler.has_early_forward()

    def start(self, task: Task) -> None:
        if task.phase is Phase.FORWARD:
            self.server.run_job(self._job(task.microbatch))
        else:
            self.server.resume(self._paused.pop(task.microbatch))

    def peer_results(self) -> list[Any]:
        return [
            map_structure(self.results[m], lambda t: t.detach()) for m in range(self.scheduler.microbatches)
        ]

    def _job(self, mb: int) -> Callable[[], None]:
        # Timeline: the step function's forward of this microbatch runs until it pauses at
        # model.backward, its backward from the schedule's resume to the end of the body.
        kind, start = EventKind.FWD, 0

        def record() -> None:
            RECORDER.add(
                kind,
                rank=self.server.rank,
                step=self.server.step.step,
                module=STEP_MODULE,
                microbatch=mb,
                start_ns=start,
                end_ns=RECORDER.now(),
            )

        def on_backward() -> None:
            nonlocal kind, start
            token = object()
            self.scheduler.backward_ready(mb)
            self._paused[mb] = token
            record()
            self.server.pause(token)
            kind, start = EventKind.BWD, RECORDER.now()

        def job() -> None:
            nonlocal start
            start = RECORDER.now()
            task = TaskContext(mb, (STEP_MODULE,), on_backward=on_backward)
            try:
                watch = self.plan.watching() if self.plan is not None else contextlib.nullcontext()
                with task_context(task), applied(self.state), watch:
                    out = self.body(mb)
                if self.plan is not None and self.plan.learning:
                    self.plan.touched(flatten(out)[1])  # the step's results are used
                elif self.plan is not None and self.plan.learned:
                    _no_placeholder(flatten(out)[1], mb)
            except ServerClosed:
                raise
            except BaseException as exc:
                if self.failure is None:
                    with contextlib.suppress(Exception):  # exceptions without a __dict__
                        setattr(exc, MICROBATCH_ATTR, mb)
                    self.failure = exc
                return
            record()
            self.results[mb] = out
            self.scheduler.finished(mb)

        return job


def _no_placeholder(tensors: Sequence[Any], mb: int) -> None:
    """A step function that returns an output the plan hands from module to module (a ``meta``
    placeholder here) reads it after all: a flow change, found before the step's results leave it."""
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        raise FlowChangedError(
            f"the step function returned, for microbatch {mb}, a module output that fast mode's plan "
            "passes straight to the next module (the parent holds only a placeholder for it)"
        )


class PipelineRuntime:
    """The pipeline machinery of one partitioned model on one rank."""

    def __init__(
        self,
        *,
        transport: Transport,
        rank: int,
        peers: tuple[int, ...],
        model_id: int,
        timeout: float | None = None,
        static: bool = False,
        strict: bool = False,
        record_steps: int | None = None,
        tp_group: tuple[int, ...] = (),
        retry: bool = False,
        split_backward: bool = False,
    ) -> None:
        """``tp_group``: the global ranks of this rank's tensor-parallel group, whose servers then run in
        lockstep (mp_pipeline.sequence). ``static``: static mode (see mp_pipeline.static), recording
        ``record_steps`` steps (default MP_PIPELINE_STATIC_STEPS or 5) before replaying; ``strict``
        (fast mode, implies static): a flow that changes after the recording raises FlowChangedError
        instead of falling back. ``retry`` (with ``strict``, mp's default): the caller runs a step that
        failed under the shortcut again after :meth:`relearn` (see :attr:`shortcut_step`).
        ``split_backward`` (``"pipeline": "zero_bubble"``): the owner of a remote call sends its input
        gradients first and defers the weight half (mp_pipeline.split_backward) to when it would wait;
        every deferred half runs before the step returns."""
        self.transport = transport
        self.rank = rank
        self.peers = peers
        self.pp_rank = peers.index(rank)
        self.tp_group = tp_group
        self.model_id = model_id
        self.timeout = default_timeout() if timeout is None else timeout
        self.remote = Remote(rank, peers)
        self.remote.shortcut = strict  # fast mode's child-to-child shortcut (mp_pipeline.remote)
        if split_backward:
            if len(tp_group) > 1:
                raise PipelineError(
                    f"split_backward with a tensor-parallel group {list(tp_group)}: the zero_bubble "
                    "schedule runs without tensor parallelism so far; use 'pipeline': 'interleaved' with "
                    "tensor_parallel_degree > 1"
                )
            self.remote.weights = WeightQueue(len(peers))
        self._early: list[Any] = []
        self._step = 0
        self.last_stats: dict[str, int] = {}
        self.last_sent: dict[str, int] = {}
        """Messages this rank sent in the last step, by kind (Server.sent)."""
        self.pool = WorkerPool(rank, alive=lambda: not transport.closed)
        """Worker threads kept across steps (closed by :meth:`close`)."""
        self.flow: FlowRecorder | None = None
        self._record_steps = default_record_steps() if record_steps is None else max(1, record_steps)
        if static or strict:
            # fast mode learns its plan in the first step and follows it from the second: the recording
            # starts there
            # with ``retry`` a changed flow falls back to full messages (exact): only a step the shortcut
            # cannot finish needs to run again
            self.flow = FlowRecorder(
                rank,
                record_steps=self._record_steps,
                strict=strict and not retry,
                skip_steps=int(strict),
                quiet=retry,
            )
        self.retry = retry and strict
        self._started = 0
        self._completed = 0
        """Steps started and completed since the plan was last reset (alike on every rank of the pipeline)."""
        self.relearned = 0
        """How many times :meth:`relearn` reset the plan (each after a step that failed under it)."""
        self._hold = False
        """The next step runs on the full path and learns nothing (a step run again: its flow is the
        unusual one, so the plan is learned from the step after it)."""
        self.templates = TemplateStore()
        self.replays: dict[str, Replay] = {}
        """pp_rank 0: per-rank replay's learned flow (mp_pipeline.replay), per step function (a training
        and an evaluation step each learn their own)."""
        self.programs: dict[str, Program] = {}
        """Another rank: its per-rank replay program from pp_rank 0, per step function (none: it serves
        requests only)."""
        self._entered: dict[int, list[Entered]] = {}
        """Entered messages that the server took during a step (from ranks that finished it first)."""
        self._entries = 0

    @property
    def flow_mismatch(self) -> str | None:
        """Static mode: what in the last step did not match the recording (None if it matched, was
        recorded, or static mode is off)."""
        return self.flow.mismatch if self.flow is not None else None

    @property
    def replaying_static(self) -> bool:
        """Whether the last step came after the recorded ones (the same on every rank of the pipeline,
        unlike whether this rank replays, so a collective may depend on it)."""
        return self.flow is not None and self._started > self.flow.skip_steps + self.flow.record_steps

    @property
    def shortcut_step(self) -> bool:
        """Whether the next step follows the fast-mode plan (learned in an earlier completed step): a
        step whose failure mp's default retries on the full path. The same on every rank of the pipeline,
        which count completed steps alike (a failed step fails on all of them)."""
        return self.remote.shortcut and self._completed >= 1

    def relearn(self) -> None:
        """Forget the fast-mode plan, the predictions and the recording (every rank of the pipeline at
        once): the next step (the failed one, run again) runs on the full path, and the plan is learned
        again from the step after it."""
        self.remote.plan = FastPlan()
        self.remote.predictions = Predictions()
        if self.flow is not None:
            flow = self.flow
            self.flow = FlowRecorder(
                self.rank,
                record_steps=self._record_steps,
                strict=flow.strict,
                skip_steps=flow.skip_steps,
                quiet=flow.quiet,
            )
        self.templates = TemplateStore()
        self.replays.clear()
        self.programs.clear()
        self._started = self._completed = 0
        self.relearned += 1
        self._hold = True

    def give_up_shortcut(self) -> None:
        """Run every later step on the full path (a flow that keeps changing)."""
        self.relearn()
        self.remote.shortcut = False
        self.flow = None
        self._hold = False

    def install(self, root: nn.Module, assignment: Mapping[str, int]) -> None:
        self.remote.install(root, assignment)

    def uninstall(self) -> None:
        self.remote.uninstall()

    def close(self) -> None:
        """Stop the worker threads (a later step starts new ones)."""
        self.pool.close()
        self.pool = WorkerPool(self.rank, alive=lambda: not self.transport.closed)

    def enter(self, what: str) -> None:
        """Enter `what`, a collective over this pipeline's ranks between steps (a gather of the model's
        state): tell the other ranks of the pipeline, and wait until each has entered it too.

        A collective that some ranks of a pipeline call and others do not (``if smp.rank() == 0:
        model.state_dict()``) would otherwise hang until a transport timeout, with nothing naming the
        cause. Here the ranks that went on into the next step learn of it from pp_rank 0's message at
        once (their server raises), and a rank waiting here raises PipelineError after
        MP_PIPELINE_TIMEOUT, naming the rank that did not come; so does a mismatch (another collective,
        or the same one a different number of times).
        """
        self._entries += 1
        mine = Entered(what, self._entries)
        others = [p for p in self.peers if p != self.rank]
        sends = [self.transport.send(mine, p, ENTERED_TAG) for p in others]
        deadline = time.monotonic() + self.timeout
        for peer in others:
            theirs = self._take_entered(peer, what, deadline)
            if (theirs.what, theirs.count) != (what, mine.count):
                raise PipelineError(
                    f"rank {self.rank} entered {what} (its collective number {mine.count} over pipeline "
                    f"{list(self.peers)}) while rank {peer} entered {theirs.what} (its number "
                    f"{theirs.count}): every rank of the pipeline must call the same collectives, in the "
                    "same order"
                )
        for handle in sends:
            handle.wait(max(0.0, deadline - time.monotonic()))

    def _take_entered(self, peer: int, what: str, deadline: float) -> Entered:
        kept = self._entered.get(peer)
        if kept:
            return kept.pop(0)
        try:
            received = self.transport.recv(peer, ENTERED_TAG, timeout=max(0.0, deadline - time.monotonic()))
        except PeerTimeoutError:
            mailbox = getattr(self.transport, "mailbox", None)
            stepping = mailbox is not None and any(
                source == peer and is_pipeline_tag(tag) for source, tag in mailbox.pending()
            )
            where = f" (its pipeline messages are waiting here: rank {peer} is in a step)" if stepping else ""
            raise collective_mismatch(
                f"rank {self.rank} entered {what}, which every rank of pipeline {list(self.peers)} must "
                f"call together, and rank {peer} did not within {self.timeout:g} s{where}",
                ", or raise MP_PIPELINE_TIMEOUT if a rank can legitimately arrive that much later",
            ) from None
        message = received.obj
        assert isinstance(message, Entered), type(message)
        return message

    def run_step(
        self, body: Callable[[int], Any], scheduler: Scheduler, state: ExecState, *, name: str = ""
    ) -> list[Any]:
        """Run one step; returns the per-microbatch results of the step function on every rank.

        ``name`` names the step function (every rank of the pipeline must run the same one)."""
        self._step += 1
        hold, self._hold = self._hold, False
        flow = None if hold else self.flow
        if hold:
            self.remote.shortcut = False
        else:
            self._started += 1
        step = StepId(self.model_id, self._step, name)
        # per-rank replay (mp_pipeline.replay) follows fast mode's plan; a TP group keeps the posted path
        # (its lockstep orders requests, which replay does without)
        replaying = self.remote.shortcut and len(self.tp_group) <= 1
        top = self.pp_rank == 0
        replay = self.replays.setdefault(name, Replay()) if top else None
        if replay is not None:
            replay.begin_step(record=replaying and self._completed >= 2)
            if replaying and replay.active is not None:
                scheduler.feed_first(replay.leading)
        weights = self.remote.weights
        server = Server(
            transport=self.transport,
            rank=self.rank,
            peers=self.peers,
            step=step,
            handle_request=self.remote.handle,
            timeout=self.timeout,
            early=self._early,
            pool=self.pool,
            flow=flow,
            templates=self.templates,
            group=self.tp_group,
            entered=self._entered,
            replay=replay if replaying else None,
            program=self.programs.get(name) if replaying and not top else None,
            idle=weights.run_one if weights is not None else None,
        )
        self.remote.server = server
        self.remote.begin_step(step)
        if flow is not None:
            flow.begin_step()
        completed = False
        recorded = RECORDER.span(
            EventKind.STEP, rank=self.rank, step=step.step, module=STEP_MODULE, microbatch=-1
        )
        # The transport is busy outside the step's serving (see Transport.set_busy): between steps the
        # script runs its own code, and what arrives early waits for this step's server, which drives
        # progress itself from its first wait.
        self.transport.set_busy(False)
        ran = (weights.ran_idle, weights.ran_early, weights.ran_at_end) if weights is not None else (0, 0, 0)
        try:
            with recorded:
                if self.pp_rank == 0:
                    plan = self.remote.plan if self.remote.shortcut else None
                    driver = StepDriver(server, scheduler, body, state, plan)
                    server.serve(driver)
                    results = [driver.results[m] for m in range(scheduler.microbatches)]
                    log.debug("step %d: schedule %s", self._step, " ".join(map(str, scheduler.issued)))
                else:
                    results = list(server.serve(None))
                if weights is not None:  # before the step's gradients are reduced
                    weights.drain()
            completed = True
            self._completed += 0 if hold else 1
            if server.new_program is not None:
                self.programs[name] = server.new_program
        finally:
            if flow is not None:
                flow.end_step(completed=completed)
            self.remote.end_step(completed=completed)
            self.remote.server = None
            self.remote.saved.clear()
            self.last_stats = dict(server.stats)
            self.last_sent = dict(server.sent)
            if weights is not None:
                weights.discard()  # left only by a failed step
                now = (weights.ran_idle, weights.ran_early, weights.ran_at_end)
                names = ("weights_idle", "weights_early", "weights_end")
                for key, before, after in zip(names, ran, now, strict=True):
                    self.last_stats[key] = after - before
            self.transport.set_busy(True)
            if hold:
                self.remote.shortcut = True
        return results
