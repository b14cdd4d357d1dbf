"""A step server's wire (mp_pipeline.server): what one rank sends and receives in one step.

Receiving: messages of this step, in arrival order, with those of later steps kept for them, those of
earlier ones dropped, another rank's entry into a collective kept for the runtime (or, from pp_rank 0,
refused: the script called it on some ranks only), and static mode's compact messages rebuilt from their
templates. While it waits, the wire does the rank's idle work (zero_bubble's deferred weight halves).

Sending: every message of the step, counted by kind, its handle kept until the step's end; requests and
responses compact when static mode replays them (mp_pipeline.static).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

from mp_comm import waits
from mp_comm.errors import PeerTimeoutError
from mp_comm.transport.base import ANY_SOURCE, ANY_TAG, SendHandle, Transport
from mp_pipeline.errors import PipelineError, PipelineTimeoutError, collective_mismatch
from mp_pipeline.messages import (
    TAG,
    Compact,
    Entered,
    Handoff,
    Request,
    Response,
    StepId,
    compact_response_of,
    compact_response_tag,
    handoff_of,
    handoff_tag,
    is_pipeline_tag,
    static_tag,
)
from mp_pipeline.static import FlowRecorder, Key, Template, TemplateStore, expand, template_of

log = logging.getLogger("mp_pipeline.server")

__all__ = ["Wire"]


class Wire:
    """One step's sending and receiving on one rank (see the module docstring).

    ``stats``: the server's counters, of which the wire keeps ``compact_sent``, ``compact_received`` and
    ``tensor_bytes``. ``waiting``: a weak reference to the server's description of what it waits for,
    for the error of a wait that timed out (weak: the server holds the wire, and a cycle would keep both
    until a full garbage collection). The other arguments are the server's
    (mp_pipeline.server.Server).
    """

    def __init__(
        self,
        *,
        transport: Transport,
        rank: int,
        peers: tuple[int, ...],
        step: StepId,
        early: list[Any],
        entered: dict[int, list[Entered]],
        templates: TemplateStore,
        flow: FlowRecorder | None,
        idle: Callable[[], bool] | None,
        stats: dict[str, int],
        waiting: weakref.WeakMethod[Callable[[], str]],
    ) -> None:
        self.transport = transport
        self.rank = rank
        self.peers = peers
        self.step = step
        self._early = early
        """Messages of later steps seen while serving this one (kept for them; shared across steps)."""
        self._entered = entered
        self.templates = templates
        self.flow = flow
        """Static mode: the record of this rank's messages (None: every message is sent in full)."""
        self.idle = idle
        self._stats = stats
        self._waiting = waiting
        self._sends: list[SendHandle] = []
        self.closed = False
        """The step is over here: nothing more is sent."""
        self.sent: dict[str, int] = {}
        """Messages this rank sent in the step, by kind (see count_sent)."""

    # -- sending -----------------------------------------------------------------------------------------
    def send(self, dest: int, message: object) -> None:
        if self.closed:
            return
        self.count_sent(type(message).__name__)
        self._sends.append(self.transport.send(message, dest, TAG))

    def send_handoff(self, dest: int, handoff: Handoff) -> None:
        """Send a tensor handed to another rank (counted in ``tensor_bytes``)."""
        if self.closed:
            return
        self._stats["tensor_bytes"] += handoff.tensor.nbytes
        self.count_sent("Handoff")
        # the tensor alone, its step and key in the tag: no object to pickle around it (_received)
        self._sends.append(self.transport.send(handoff.tensor, dest, handoff_tag(handoff)))

    def count_sent(self, kind: str) -> None:
        """Count a message this rank sends in :attr:`sent`, by kind (its class name: Request, Response,
        Handoff, ...; a compact message counts as the request or response it stands for)."""
        self.sent[kind] = self.sent.get(kind, 0) + 1

    def send_flow(self, dest: int, message: Request | Response, request: Request) -> None:
        """Send a request or the response to ``request``: compact when static mode replays it."""
        moved = sum(t.nbytes for t in message.tensors if t is not None and not t.is_meta)  # meta: no data
        self._stats["tensor_bytes"] += moved
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
        if plan.compact and is_response:
            # A compact response is its step, ids and tensors: the ids go in the tag and the tensors alone
            # (one tensor: the transport's bare-tensor message), nothing else is pickled (_received).
            tensors = message.tensors
            lone = tensors[0] if len(tensors) == 1 else None
            body: object = lone if lone is not None else tensors
            self._stats["compact_sent"] += 1
            self.count_sent("Response")
            compact_tag = compact_response_tag(message.step, plan.template_id, message.request_id)
            self._sends.append(self.transport.send(body, dest, compact_tag))
            return
        if plan.compact:
            forward_id = message.forward_id if isinstance(message, Request) else None
            refs = message.refs if isinstance(message, Request) else ()
            posted = message.posted if isinstance(message, Request) else False
            out: object = Compact(
                message.step, plan.template_id, message.request_id, message.tensors, forward_id, refs, posted
            )
            self._stats["compact_sent"] += 1
        else:  # in full; the first one of a template leaves it at the receiver
            message.template_id = plan.template_id if plan.announce else None
            out = message
        if not self.closed:
            self.count_sent(type(message).__name__)
            self._sends.append(self.transport.send(out, dest, tag, static=True))

    def account(self, dest: int, request: Request, static: tuple[Key, Template] | None = None) -> None:
        """Per-rank replay: static mode's bookkeeping of a request its owner runs without receiving it
        (recorded and checked as if sent, so that the recording stays the same). ``static``: its key
        (occurrence 0) and template, when known already (a programmed call's, mp_pipeline.replay)."""
        flow = self.flow
        if flow is None or self.closed:
            return
        if static is None:
            key = Key(dest, False, request.phase, request.module, request.position, request.microbatch, 0)
            static = (key, template_of(request))
        flow.outgoing(flow.counted(static[0]), static[1])

    def close(self) -> None:
        """The step is over here: nothing more is sent."""
        self.closed = True

    def wait_sends(self, timeout: float) -> None:
        """Wait (up to ``timeout`` each) until what was sent has gone."""
        sends, self._sends = self._sends, []
        for handle in sends:
            try:
                handle.wait(timeout=timeout)
            except Exception as exc:
                log.warning("rank %d: a pipeline message did not complete: %s", self.rank, exc)

    # -- receiving ---------------------------------------------------------------------------------------
    def take_early(self) -> list[Any]:
        """The messages of this step that came while an earlier one was served."""
        for m in self._early:
            self._check_function(m.step, None)
        mine = [m for m in self._early if m.step == self.step]
        self._early[:] = [m for m in self._early if m.step > self.step]
        return mine

    def poll(self, timeout: float) -> Any:
        """The next message of this step, waiting up to ``timeout`` (0: None if none is there; a longer
        wait that ends without one raises PipelineTimeoutError)."""
        if timeout and self.idle is not None:  # the wait's first part does the rank's idle work
            while (message := self.poll(0.0)) is None:
                if not self.idle():
                    break
            else:
                return message
        while True:
            try:
                received = self.transport.recv(ANY_SOURCE, ANY_TAG, timeout=timeout)
            except PeerTimeoutError:
                if timeout == 0.0:
                    return None
                raise PipelineTimeoutError(
                    f"rank {self.rank} received no pipeline message within {timeout:g} s in step "
                    f"{self.step.step} ({self._waiting_for()}). A rank of "
                    f"pipeline {list(self.peers)} is stuck (alive but not answering, e.g. a deadlock: a "
                    "stopped or dead rank is found sooner, by MP_HEARTBEAT_TIMEOUT); raise "
                    "MP_PIPELINE_TIMEOUT for very long module executions. This rank was "
                    + ("; ".join(waits.describe(w) for w in waits.current()) or "waiting for any message")
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

    def _waiting_for(self) -> str:
        describe = self._waiting()
        return describe() if describe is not None else "its server is gone"

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

    def _received(self, source: int, tag: object, message: Any) -> Any:
        """A received object as a full message: keeps announced templates, rebuilds compact messages."""
        if not is_pipeline_tag(tag):
            return None  # not a pipeline message (dropped by the caller)
        handoff = handoff_of(tag, message)
        if handoff is not None:
            return handoff
        message = compact_response_of(tag, message) or message
        if isinstance(message, Compact):
            if message.step < self.step:  # left over from an aborted step (dropped by the caller): its
                return message  # template may be gone with the recording that the retry forgot
            self._stats["compact_received"] += 1
            return expand(self.templates.get(source, message.template_id), message)
        if isinstance(message, Request | Response) and message.template_id is not None:
            self.templates.put(source, message.template_id, dataclasses.replace(message, tensors=[]))
        return message
