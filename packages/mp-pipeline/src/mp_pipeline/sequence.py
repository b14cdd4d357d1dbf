"""One order of execution for the ranks of a tensor-parallel group (lockstep module servers).

A tensor-parallel module issues collectives in its TP group, so the servers of a TP group (the ranks
with the same pp_rank in mirrored pipelines) must run the same requests, responses and step tasks in
the same order: otherwise a collective pairs one rank's microbatch with another's, which gives silently
wrong numbers whenever the shapes agree. The order a server sees depends on timing (whether a response
arrives before pp_rank 0 starts its next task, which of two handed-off tensors comes first), and no
schedule fixes that. So the group's first rank, the leader, serves in arrival order and tells the
others, its followers, which event it dispatches next, before dispatching it; a follower holds what
arrives until the leader names it.

Events are named in pp_rank terms (:func:`event_of`): the pipelines of a TP group mirror each other, and
since their servers run the same events in the same order, request ids agree across the group too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from mp_pipeline.errors import PipelineError
from mp_pipeline.messages import Handoff, Request, Response, StepEnd, StepId
from mp_pipeline.structure import pickled_by_position

__all__ = ["FINISH", "TASK", "Event", "Order", "Sequencer", "event_of"]

Event = tuple[Any, ...]
"""What a server dispatches, named alike on every rank of a TP group."""

TASK = "task"
"""pp_rank 0: the event of starting a step task, ``(TASK, str(task))``."""
FINISH = "finish"
"""pp_rank 0: the event of ending the step once every task is done, ``(FINISH,)``."""


@pickled_by_position
@dataclass(frozen=True, slots=True)
class Order:
    """Leader to follower: dispatch ``event`` next."""

    step: StepId
    event: Event


def event_of(message: object, peers: tuple[int, ...]) -> Event:
    """The name of a received message's event; ``peers`` are the pipeline's global ranks (pp order)."""
    if isinstance(message, Request):
        return ("req", peers.index(message.requester), message.request_id)
    if isinstance(message, Response):
        return ("resp", message.request_id)
    if isinstance(message, Handoff):
        kind, requester, forward_id, index = message.key
        return ("hand", kind, peers.index(requester), forward_id, index)
    if isinstance(message, StepEnd):
        return ("end",)
    raise TypeError(f"no event for a {type(message).__name__} message")


class Sequencer:
    """One rank's part in its TP group's order (see the module docstring).

    ``group``: the global ranks of the TP group in tp_rank order (this rank among them); the first is
    the leader.
    """

    def __init__(self, rank: int, group: tuple[int, ...], peers: tuple[int, ...]) -> None:
        if rank not in group:
            raise ValueError(f"rank {rank} is not in its TP group {group}")
        self.rank = rank
        self.group = group
        self.peers = peers
        self.leader = group[0]
        self.is_leader = rank == self.leader
        self._orders: deque[Event] = deque()
        self._held: dict[Event, Any] = {}

    @property
    def followers(self) -> tuple[int, ...]:
        return self.group[1:] if self.is_leader else ()

    # -- follower ------------------------------------------------------------------------------------
    def hold(self, message: object) -> None:
        """Keep an arrived message (an Order joins the queue of orders) until its event is named."""
        if isinstance(message, Order):
            self._orders.append(message.event)
            return
        event = event_of(message, self.peers)
        if event in self._held:
            raise PipelineError(f"rank {self.rank}: a second message for event {event} arrived")
        self._held[event] = message

    def next_order(self) -> Event | None:
        """The event the leader dispatched next, if its order has arrived (not consumed)."""
        return self._orders[0] if self._orders else None

    def take(self, event: Event) -> Any:
        """The held message of ``event``, consuming its order; None if it has not arrived yet."""
        message = self._held.pop(event, None)
        if message is not None:
            self.done_order()
        return message

    def done_order(self) -> None:
        self._orders.popleft()

    def describe(self) -> str:
        """What this follower waits for (for timeout errors)."""
        nxt = "the leader's next order" if not self._orders else f"event {self._orders[0]}"
        return f"waiting for {nxt}; holding {sorted(map(str, self._held))}"

    @property
    def idle(self) -> bool:
        """Nothing held and no order pending (what a finished step leaves behind)."""
        return not self._orders and not self._held
