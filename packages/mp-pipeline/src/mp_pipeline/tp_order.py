"""Tensor parallelism on the server: the ranks of a TP group dispatch the same events in the same order
(mp_pipeline.sequence); the leader announces, followers follow."""

from __future__ import annotations

import logging
from typing import Any

from mp_pipeline.errors import PipelineError
from mp_pipeline.messages import PostedAck, PostedSync, Response, StepAbort
from mp_pipeline.sequence import FINISH, TASK, Event, Order, event_of
from mp_pipeline.server_base import Driver
from mp_pipeline.wire import Wire

log = logging.getLogger("mp_pipeline.server")

__all__ = ["TPOrder"]


class TPOrder(Wire):
    def _arrived(self, message: Any) -> None:
        """A message of this step: dispatched now (a leader first tells its followers), or, on a
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
        if event[0] == FINISH:
            if not driver.done:
                raise PipelineError(
                    f"rank {self.rank}: TP leader rank {seq.leader} ended the step, this rank's schedule "
                    "is not done: the tensor-parallel ranks ran different steps"
                )
            if self._posted:  # this rank's own posted calls first: the step's end ends the owners' serving
                self.sync_posted()
                self._arrived(self._poll(self._timeout))
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
