"""Pipeline schedules as pure data (docs/pipeline.md), and a communication-free simulator.

pp_rank 0 starts two tasks per microbatch: its forward (the step function runs until its first
``model.backward``, or to its end) and its backward (the step function continues from
``model.backward``). A :class:`Scheduler` decides which task to start whenever pp_rank 0's server has
control and nothing else is waiting:

* "simple" (GPipe): the forwards of all microbatches, then the backwards, in microbatch order, once
  every forward in flight has reached its backward (with ``eager_backward``: each as soon as its own
  forward has, see :class:`Scheduler`);
* "interleaved": a microbatch that is ready for its backward goes first; otherwise the next forward,
  while fewer than ``active_microbatches`` microbatches are in flight.

With ``deterministic`` the interleaved schedule starts its tasks in a fixed order (``active`` warm-up
forwards, then one backward and one forward alternately, then the remaining backwards), waiting for
each task's prerequisite instead of taking whatever is ready first; the order of requests every
server sees then no longer depends on timing (``deterministic_server``).

The scheduler is driven by events (:meth:`Scheduler.backward_ready`, :meth:`Scheduler.finished`) and
holds no threads or communication; :func:`simulate` drives it over a model of a linear pipeline.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Phase", "Scheduler", "SimResult", "Task", "fixed_order", "simulate"]

ScheduleKind = Literal["simple", "interleaved"]


class Phase(enum.Enum):
    """Forward or backward execution."""

    FORWARD = "FWD"
    BACKWARD = "BWD"


@dataclass(frozen=True, slots=True)
class Task:
    """A step-level task: the forward or the backward of one microbatch."""

    microbatch: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}"


def fixed_order(microbatches: int, active: int) -> list[Task]:
    """The deterministic interleaved order: warm-up forwards, then 1 backward / 1 forward, then drain."""
    warm = min(active, microbatches)
    order = [Task(m, Phase.FORWARD) for m in range(warm)]
    nxt = warm
    for m in range(microbatches):
        order.append(Task(m, Phase.BACKWARD))
        if nxt < microbatches:
            order.append(Task(nxt, Phase.FORWARD))
            nxt += 1
    return order


class Scheduler:
    """Which step-level task pp_rank 0 starts next. Pure: no threads, no communication."""

    def __init__(
        self,
        kind: ScheduleKind,
        microbatches: int,
        active_microbatches: int | None = None,
        *,
        deterministic: bool = False,
        eager_backward: bool = False,
    ) -> None:
        """``eager_backward`` (simple only): once no forward may start, start each backward, still in
        microbatch order, as soon as its microbatch is ready, without waiting for the later forwards
        still on their way through the pipeline. Right only where a backward request cannot overtake
        such a forward, i.e. with two stages: pp_rank 0's remote calls and its backward requests then
        all go to the other stage, in order, so that stage still runs every forward before the first
        backward, and starts that backward without waiting for its last forward's output to travel to
        pp_rank 0 and the request back. With more stages it could overtake a forward still in an earlier
        stage (``simulate``, 3 stages, 4 microbatches: 21 time units instead of 18)."""
        if kind not in ("simple", "interleaved"):
            raise ValueError(f"schedule {kind!r}: expected 'simple' or 'interleaved'")
        if microbatches < 1:
            raise ValueError(f"microbatches={microbatches}: expected >= 1")
        active = microbatches if active_microbatches is None else active_microbatches
        if not 1 <= active <= microbatches:
            raise ValueError(f"active_microbatches={active}: expected an int in [1, {microbatches}]")
        self.kind: ScheduleKind = kind
        self.microbatches = microbatches
        self.active = active
        self.deterministic = deterministic and kind == "interleaved"
        self.eager_backward = eager_backward and kind == "simple"
        self._next_forward = 0
        self._ready: list[int] = []  # microbatches waiting for their backward, in order of readiness
        self._backward_started: set[int] = set()
        self._finished: set[int] = set()
        self._order = fixed_order(microbatches, active) if self.deterministic else []
        self._pos = 0
        self._decision: tuple[Task | None, int] | None = None
        """`_decide`'s answer until an event or a started task changes the state: pp_rank 0's server asks
        several times between two changes (has_backward, has_early_forward, next_task)."""
        self.issued: list[Task] = []
        """Every task started so far, in order."""

    # -- events ----------------------------------------------------------------------------------------
    def backward_ready(self, microbatch: int) -> None:
        """The microbatch's forward reached ``model.backward``: it waits for its backward task."""
        self._check(microbatch)
        if microbatch in self._ready or microbatch in self._backward_started:
            raise ValueError(f"microbatch {microbatch} is already ready for (or running) its backward")
        self._ready.append(microbatch)
        self._decision = None

    def finished(self, microbatch: int) -> None:
        """The step function returned for this microbatch."""
        self._check(microbatch)
        if microbatch in self._ready:
            raise ValueError(f"microbatch {microbatch} finished while waiting for its backward")
        self._finished.add(microbatch)
        self._decision = None

    def _check(self, microbatch: int) -> None:
        if not 0 <= microbatch < self._next_forward:
            raise ValueError(f"microbatch {microbatch} has not started (started: {self._next_forward})")
        if microbatch in self._finished:
            raise ValueError(f"microbatch {microbatch} has already finished")

    # -- state -----------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Microbatches started and not finished."""
        return self._next_forward - len(self._finished)

    @property
    def done(self) -> bool:
        return len(self._finished) == self.microbatches

    @property
    def ready(self) -> tuple[int, ...]:
        return tuple(self._ready)

    # -- decisions -------------------------------------------------------------------------------------
    def next_task(self) -> Task | None:
        """The task to start now (recorded as started), or None if none may start yet."""
        task, self._pos = self._decide()
        if task is not None:
            self._decision = None
            if task.phase is Phase.FORWARD:
                self._next_forward += 1
            else:
                self._ready.remove(task.microbatch)
                self._backward_started.add(task.microbatch)
            self.issued.append(task)
        return task

    def has_task(self) -> bool:
        """Whether `next_task` would start a task now (nothing is recorded as started)."""
        return self._decide()[0] is not None

    def has_backward(self) -> bool:
        """Whether `next_task` would start a backward now (nothing is recorded as started)."""
        task = self._decide()[0]
        return task is not None and task.phase is Phase.BACKWARD

    def has_early_forward(self) -> bool:
        """Whether `next_task` would start a forward of the simple schedule now (nothing is recorded).

        Such a forward may start before pp_rank 0 handles the responses to its own requests that wait
        for it: they only continue microbatches already in flight, and every backward of the simple
        schedule waits for the forwards anyway (with ``eager_backward`` too, which starts none while a
        forward may start). The last stage then gets its next forward request sooner."""
        task = self._decide()[0]
        return self.kind == "simple" and task is not None and task.phase is Phase.FORWARD

    def _can_forward(self) -> bool:
        return self._next_forward < self.microbatches and self.in_flight < self.active

    def _decide(self) -> tuple[Task | None, int]:
        """The task to start now, and where the fixed order's cursor goes if it starts; reads only (but
        remembers the answer until the state changes)."""
        if self._decision is None:
            self._decision = self._decide_fixed() if self.deterministic else (self._decide_free(), self._pos)
        return self._decision

    def _decide_free(self) -> Task | None:
        if self.kind == "interleaved":
            if self._ready:
                return Task(self._ready[0], Phase.BACKWARD)
            if self._can_forward():
                return Task(self._next_forward, Phase.FORWARD)
            return None
        # simple
        if self._can_forward():
            return Task(self._next_forward, Phase.FORWARD)
        if self.eager_backward:
            started = self._finished | self._backward_started
            first = next((m for m in range(self._next_forward) if m not in started), None)
            return Task(first, Phase.BACKWARD) if first is not None and first in self._ready else None
        running = self.in_flight - len(self._ready) - len(self._backward_started - self._finished)
        if self._ready and running == 0:
            return Task(min(self._ready), Phase.BACKWARD)
        return None

    def _decide_fixed(self) -> tuple[Task | None, int]:
        pos = self._pos
        while pos < len(self._order):
            task = self._order[pos]
            if task.phase is Phase.BACKWARD:
                if task.microbatch in self._finished and task.microbatch not in self._backward_started:
                    pos += 1  # forward-only microbatch: no backward to start
                    continue
                return (task, pos + 1) if task.microbatch in self._ready else (None, pos)
            return (task, pos + 1) if self.in_flight < self.active else (None, pos)
        return None, pos


# ------------------------------------------------------------------------------------------ simulator
@dataclass(frozen=True, slots=True)
class Span:
    """One stretch of work on a stage: [start, end) for a microbatch's forward or backward part."""

    stage: int
    microbatch: int
    phase: Phase
    start: float
    end: float


@dataclass
class SimResult:
    """What :func:`simulate` produced: the per-stage spans, the step time and the most microbatches in
    flight at once."""

    spans: list[Span] = field(default_factory=list)
    makespan: float = 0.0
    peak_in_flight: int = 0
    order: list[Task] = field(default_factory=list)


def simulate(
    kind: ScheduleKind,
    microbatches: int,
    active_microbatches: int | None = None,
    *,
    forward_costs: Sequence[float] = (1.0, 1.0),
    backward_costs: Sequence[float] | None = None,
    deterministic: bool = False,
    eager_backward: bool = False,
) -> SimResult:
    """Simulates a linear pipeline of ``len(forward_costs)`` stages driven by a :class:`Scheduler`.

    A forward passes the stages in order and a backward in reverse; each stage is one module server
    (one task at a time, first come first served), and stage 0 asks the scheduler for a new task
    whenever it is idle with nothing queued, as the runtime's pp_rank 0 does.
    """
    stages = len(forward_costs)
    bwd = list(backward_costs) if backward_costs is not None else [2.0 * c for c in forward_costs]
    if len(bwd) != stages:
        raise ValueError("backward_costs needs one cost per stage")
    sched = Scheduler(
        kind, microbatches, active_microbatches, deterministic=deterministic, eager_backward=eager_backward
    )
    result = SimResult()
    queues: list[list[tuple[float, int, int, Phase, int]]] = [[] for _ in range(stages)]
    busy_until = [0.0] * stages
    unreported = [0] * stages  # work done or running whose completion has not been handled yet
    seq = 0
    events: list[tuple[float, int, int, int, Phase, int]] = []  # (time, seq, stage, mb, phase, hop)

    def enqueue(t: float, stage: int, mb: int, phase: Phase, hop: int) -> None:
        nonlocal seq
        heapq.heappush(queues[stage], (t, seq, mb, phase, hop))
        seq += 1

    def start_work(stage: int, now: float) -> bool:
        nonlocal seq
        if busy_until[stage] > now or not queues[stage] or queues[stage][0][0] > now:
            return False
        _, _, mb, phase, hop = heapq.heappop(queues[stage])
        cost = forward_costs[stage] if phase is Phase.FORWARD else bwd[stage]
        end = now + cost
        busy_until[stage] = end
        unreported[stage] += 1
        result.spans.append(Span(stage, mb, phase, now, end))
        heapq.heappush(events, (end, seq, stage, mb, phase, hop))
        seq += 1
        return True

    now = 0.0
    while not sched.done:
        for s in range(stages):
            start_work(s, now)
        # stage 0 asks once its last work has been passed on (pp_rank 0 sends a forward on before it
        # asks for the next task), with nothing queued
        if not unreported[0] and not (queues[0] and queues[0][0][0] <= now):
            task = sched.next_task()
            if task is not None:
                result.order.append(task)
                result.peak_in_flight = max(result.peak_in_flight, sched.in_flight)
                enqueue(now, 0 if task.phase is Phase.FORWARD else stages - 1, task.microbatch, task.phase, 0)
                continue
        if not events:
            raise RuntimeError(f"simulation stalled at t={now} (scheduler issued {sched.issued})")
        now, _, stage, mb, phase, hop = heapq.heappop(events)
        unreported[stage] -= 1
        if phase is Phase.FORWARD:
            if stage + 1 < stages:
                enqueue(now, stage + 1, mb, phase, hop + 1)
            else:
                sched.backward_ready(mb)
        elif stage > 0:
            enqueue(now, stage - 1, mb, phase, hop + 1)
        else:
            sched.finished(mb)
    result.makespan = max((s.end for s in result.spans), default=0.0)
    return result
