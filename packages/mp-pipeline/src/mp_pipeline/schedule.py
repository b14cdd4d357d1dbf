"""Pipeline schedules as pure data (docs/pipeline.md), and a communication-free simulator.

pp_rank 0 starts two tasks per microbatch: its forward (the step function runs until its first
``model.backward``, or to its end) and its backward (the step function continues from
``model.backward``). A :class:`Scheduler` decides which task to start whenever pp_rank 0's server has
control and nothing else is waiting:

* "simple" (GPipe): the forwards of all microbatches, then the backwards, in microbatch order, once
  every forward in flight has reached its backward (with ``eager_backward``: each as soon as its own
  forward has, see :class:`Scheduler`);
* "interleaved": a microbatch that is ready for its backward goes first; otherwise the next forward,
  while fewer than ``active_microbatches`` microbatches are in flight. A forward whose first act feeds
  another rank (:meth:`Scheduler.feed_first`, learned by per-rank replay) goes before the backward;
* "zero_bubble": pp_rank 0 starts its tasks as "interleaved" does; the owners of remote calls split
  each backward and defer its weight half (mp_pipeline.split_backward, PipelineRuntime's
  ``split_backward``), ZB-H1's idea (:func:`zero_bubble_orders`) on the runtime's tasks.

With ``deterministic`` the interleaved schedule starts its tasks in a fixed order (``active`` warm-up
forwards, then one backward and one forward alternately, then the remaining backwards), waiting for
each task's prerequisite instead of taking whatever is ready first; the order of requests every
server sees then no longer depends on timing (``deterministic_server``).

The scheduler is driven by events (:meth:`Scheduler.backward_ready`, :meth:`Scheduler.finished`) and
holds no threads or communication; :func:`simulate` drives it over a model of a linear pipeline.

Per-stage orders (:func:`one_f_one_b_orders`, :func:`zero_bubble_orders`) describe a schedule as each
stage's list of actions, with the backward split into its input and weight halves where the schedule
splits it; :func:`simulate_orders` runs them.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Action",
    "Op",
    "OrderResult",
    "Phase",
    "Scheduler",
    "SimResult",
    "Task",
    "fixed_order",
    "one_f_one_b_orders",
    "simulate",
    "simulate_orders",
    "zero_bubble_orders",
]

ScheduleKind = Literal["simple", "interleaved", "zero_bubble"]


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
        if kind not in ("simple", "interleaved", "zero_bubble"):
            raise ValueError(f"schedule {kind!r}: expected 'simple', 'interleaved' or 'zero_bubble'")
        if microbatches < 1:
            raise ValueError(f"microbatches={microbatches}: expected >= 1")
        active = microbatches if active_microbatches is None else active_microbatches
        if not 1 <= active <= microbatches:
            raise ValueError(f"active_microbatches={active}: expected an int in [1, {microbatches}]")
        self.kind: ScheduleKind = kind
        self.microbatches = microbatches
        self.active = active
        self.deterministic = deterministic and kind != "simple"
        self.eager_backward = eager_backward and kind == "simple"
        self._next_forward = 0
        self._ready: list[int] = []  # microbatches waiting for their backward, in order of readiness
        self._backward_started: set[int] = set()
        self._finished: set[int] = set()
        self._order = fixed_order(microbatches, active) if self.deterministic else []
        self._pos = 0
        self.forward_first: frozenset[int] = frozenset()
        """Microbatches whose forward goes before a ready backward (:meth:`feed_first`)."""
        self._decision: tuple[Task | None, int] | None = None
        """`_decide`'s answer until an event or a started task changes the state: pp_rank 0's server asks
        several times between two changes (has_urgent, has_early_forward, next_task)."""
        self.issued: list[Task] = []
        """Every task started so far, in order."""

    def feed_first(self, microbatches: frozenset[int]) -> None:
        """The forwards of ``microbatches`` start before a ready backward (interleaved and zero_bubble,
        not in a fixed order). For a forward whose first act sends its input to another rank before
        pp_rank 0 computes anything (T5's encoder on pp_rank 1): that rank then runs it next instead of
        the backwards that would otherwise go first, and pp_rank 0 is back within the Python up to that
        call. A forward that computes on pp_rank 0 first would delay the backward the last stage waits
        for, so the others keep the backward first."""
        self.forward_first = microbatches if self.kind != "simple" and not self.deterministic else frozenset()
        self._decision = None

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

    def has_urgent(self) -> bool:
        """Whether `next_task` would start a task that pp_rank 0 starts before handling messages: a
        backward, or a forward of :attr:`forward_first` (nothing is recorded as started)."""
        task = self._decide()[0]
        return task is not None and (task.phase is Phase.BACKWARD or task.microbatch in self.forward_first)

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
        if self.kind != "simple":
            feeds = self._next_forward in self.forward_first and self._can_forward()
            if self._ready and not feeds:
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


# ------------------------------------------------------------------------------ per-stage action orders
class Op(enum.Enum):
    """One stage's work on one microbatch: its forward, the input half of its backward (``B``), the
    weight half (``W``, mp_pipeline.split_backward), or both halves at once (``BW``, a full backward)."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"


@dataclass(frozen=True, slots=True)
class Action:
    """One entry of a stage's order."""

    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}"


def one_f_one_b_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B's order per stage: ``stages - 1 - s`` warm-up forwards on stage ``s``, then one forward
    and one full backward alternately, then the remaining backwards."""
    _check_sizes(stages, microbatches)
    orders = []
    for s in range(stages):
        nf = min(stages - 1 - s, microbatches)
        order = [Action(Op.F, k) for k in range(nf)]
        for k in range(microbatches):
            if nf < microbatches:
                order.append(Action(Op.F, nf))
                nf += 1
            order.append(Action(Op.BW, k))
        orders.append(order)
    return orders


def zero_bubble_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1's order per stage (zero-bubble pipeline parallelism, the schedule whose activations stay
    those of 1F1B): each backward splits into its input half ``B``, which the stage before waits for,
    and its weight half ``W``, which nothing waits for and which fills the time 1F1B's stages idle.

    The order is what this rule gives with unit costs: a stage runs a ready ``B`` first; else the next
    forward while fewer than ``stages - s`` of its microbatches are between forward and ``B`` (1F1B's
    in-flight bound); else a pending ``W``. A ``W`` goes first once ``stages - 1`` are pending, so at
    most ``stages`` weight halves (and the graphs they keep) wait at once. With equal forward, input-
    and weight-half costs the step takes ``3m + p - 1`` units against 1F1B's ``3(m + p - 1)``: the
    bubble falls from ``(p - 1)/m`` of the work to ``(p - 1)/3m``."""
    _check_sizes(stages, microbatches)
    m = microbatches
    orders: list[list[Action]] = [[] for _ in range(stages)]
    done: dict[tuple[Op, int, int], int] = {}  # (op, stage, microbatch) -> tick it ends
    nf, nb, nw = [0] * stages, [0] * stages, [0] * stages
    tick = 0
    while any(n < m for n in nw):
        for s in range(stages):
            if nb[s] < nf[s]:
                waits_on = (Op.F, s, nb[s]) if s == stages - 1 else (Op.B, s + 1, nb[s])
                b_ready = done.get(waits_on, tick + 1) <= tick
            else:
                b_ready = False
            f_ready = (
                nf[s] < m
                and nf[s] - nb[s] < stages - s
                and (s == 0 or done.get((Op.F, s - 1, nf[s]), tick + 1) <= tick)
            )
            pending = nb[s] - nw[s]
            if pending >= stages or (pending and not b_ready and not f_ready):
                action, nw[s] = Action(Op.W, nw[s]), nw[s] + 1
            elif b_ready:
                action, nb[s] = Action(Op.B, nb[s]), nb[s] + 1
            elif f_ready:
                action, nf[s] = Action(Op.F, nf[s]), nf[s] + 1
            else:
                continue
            orders[s].append(action)
            done[(action.op, s, action.microbatch)] = tick + 1
        tick += 1
    return orders


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages={stages}, microbatches={microbatches}: expected both >= 1")


@dataclass
class OrderResult:
    """What :func:`simulate_orders` produced: per-stage spans (``(action, start, end)``), the step
    time, each stage's busy time, the most microbatches between forward and input gradient on each
    stage (what 1F1B bounds: their activations), and the most weight halves pending on each stage."""

    spans: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]
    peak_activations: list[int]
    peak_pending_weights: list[int]

    @property
    def bubble(self) -> float:
        """Idle time over all stages as a fraction of the work."""
        work = sum(self.busy)
        return (self.makespan * len(self.busy) - work) / work if work else 0.0


def simulate_orders(
    orders: Sequence[Sequence[Action]],
    *,
    forward_costs: Sequence[float],
    input_costs: Sequence[float],
    weight_costs: Sequence[float],
) -> OrderResult:
    """Runs per-stage orders on a linear pipeline without communication cost: each stage runs its
    actions in order, each as soon as the stage is free and its input is there (a forward waits for
    the previous stage's forward, an input half or full backward for the next stage's, a weight half
    for its own input half). ``BW`` costs an input plus a weight half."""
    stages = len(orders)
    if not len(forward_costs) == len(input_costs) == len(weight_costs) == stages:
        raise ValueError(f"{stages} orders: expected that many forward, input and weight costs")
    end: dict[tuple[Op, int, int], float] = {}
    free = [0.0] * stages
    pos = [0] * stages
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(stages)]
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            action = orders[s][pos[s]]
            op, mb = action.op, action.microbatch
            if op is Op.F:
                deps = [(Op.F, s - 1, mb)] if s else []
                cost = forward_costs[s]
            elif op is Op.W:
                deps = [(Op.B, s, mb)]
                cost = weight_costs[s]
            else:
                deps = [(Op.F, s, mb)] + ([(Op.B, s + 1, mb)] if s + 1 < stages else [])
                cost = input_costs[s] + (weight_costs[s] if op is Op.BW else 0.0)
            if not all(d in end for d in deps):
                continue
            start = max([free[s], *(end[d] for d in deps)])
            free[s] = start + cost
            end[(Op.B if op is Op.BW else op, s, mb)] = free[s]
            spans[s].append((action, start, free[s]))
            pos[s] += 1
            left -= 1
            moved = True
        if not moved:
            waiting = {s: str(orders[s][pos[s]]) for s in range(stages) if pos[s] < len(orders[s])}
            raise ValueError(f"the orders deadlock: each stage's next action waits forever ({waiting})")
    return OrderResult(
        spans=spans,
        makespan=max(free),
        busy=[sum(e - b for _, b, e in sp) for sp in spans],
        peak_activations=[_peak(sp, {Op.F}, {Op.B, Op.BW}) for sp in spans],
        peak_pending_weights=[_peak(sp, {Op.B}, {Op.W}) for sp in spans],
    )


def _peak(spans: list[tuple[Action, float, float]], up: set[Op], down: set[Op]) -> int:
    count = peak = 0
    for action, _, _ in spans:
        count += (action.op in up) - (action.op in down)
        peak = max(peak, count)
    return peak
