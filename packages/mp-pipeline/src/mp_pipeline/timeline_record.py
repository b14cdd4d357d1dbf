"""Recording the pipeline timeline: the events each process records while :data:`RECORDER` is on.

While :data:`RECORDER` is enabled, the runtime records on each rank

* ``FWD`` / ``BWD``: the execution of a forward or backward request for one module and microbatch on
  its owner, and on pp_rank 0 the step function's own forward (until ``model.backward``) and backward
  for each microbatch (module ``<step>``);
* ``REQUEST``: a request sent to another rank (an instant; ``phase`` and ``peer`` say which);
* ``WAIT``: a thread blocked on that request's response (the rank runs other work meanwhile);
* ``STEP``: the step on this rank, from entering the pipeline to its end; ``REDUCE``: the gradient
  average over the data-parallel group after the step (recorded by the umbrella ``mp``).

Each event carries its rank, thread, module path, microbatch and step, with start and end from
``time.perf_counter_ns``. Disabled, every hook costs one attribute check.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

__all__ = ["EXECUTIONS", "RECORDER", "STEP_MODULE", "Event", "EventKind", "ProcessTrace", "Recorder"]

STEP_MODULE = "<step>"
"""Module path of the step function's own executions on pp_rank 0."""


class EventKind(enum.StrEnum):
    STEP = "STEP"
    FWD = "FWD"
    BWD = "BWD"
    REQUEST = "REQUEST"
    WAIT = "WAIT"
    REDUCE = "REDUCE"


EXECUTIONS = (EventKind.FWD, EventKind.BWD)


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded interval (``start_ns == end_ns`` for an instant)."""

    kind: EventKind
    rank: int
    thread: str
    step: int
    module: str
    microbatch: int
    start_ns: int
    end_ns: int
    phase: str | None = None
    """For REQUEST and WAIT: the phase of the request (FWD or BWD)."""
    peer: int | None = None
    """For REQUEST and WAIT: the rank the request went to."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, slots=True)
class ProcessTrace:
    """What one process recorded, with its clock offset (``time_ns - perf_counter_ns``)."""

    events: tuple[Event, ...]
    clock_offset_ns: int
    labels: dict[int, str] = field(default_factory=dict)
    """Optional row label per rank (e.g. ``"pp 0, dp 1"``)."""


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("kind", "microbatch", "module", "peer", "phase", "rank", "recorder", "start", "step")

    def __init__(  # noqa: PLR0917 - internal, built by Recorder.span only
        self,
        recorder: Recorder,
        kind: EventKind,
        rank: int,
        step: int,
        module: str,
        microbatch: int,
        phase: str | None,
        peer: int | None,
    ) -> None:
        self.recorder = recorder
        self.kind = kind
        self.rank = rank
        self.step = step
        self.module = module
        self.microbatch = microbatch
        self.phase = phase
        self.peer = peer
        self.start = 0

    def __enter__(self) -> None:
        self.start = time.perf_counter_ns()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.recorder.add(
            self.kind,
            rank=self.rank,
            step=self.step,
            module=self.module,
            microbatch=self.microbatch,
            start_ns=self.start,
            end_ns=time.perf_counter_ns(),
            phase=self.phase,
            peer=self.peer,
        )


class Recorder:
    """Collects events in this process while ``enabled`` (one per process: :data:`RECORDER`)."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[Event] = []
        self._offset = 0
        self._lock = threading.Lock()

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def start(self) -> None:
        """Forget earlier events and record from now on."""
        with self._lock:
            self._events = []
            self._offset = time.time_ns() - time.perf_counter_ns()
            self.enabled = True

    def stop(self) -> ProcessTrace:
        """Stop recording; returns what was recorded since :meth:`start`."""
        with self._lock:
            self.enabled = False
            events, self._events = tuple(self._events), []
        return ProcessTrace(events, self._offset)

    def add(
        self,
        kind: EventKind,
        *,
        rank: int,
        step: int,
        module: str,
        microbatch: int,
        start_ns: int,
        end_ns: int,
        phase: str | None = None,
        peer: int | None = None,
    ) -> None:
        """Record one event (nothing when disabled)."""
        if not self.enabled:
            return
        event = Event(
            kind,
            rank,
            threading.current_thread().name,
            step,
            module,
            microbatch,
            start_ns,
            end_ns,
            phase,
            peer,
        )
        with self._lock:
            self._events.append(event)

    def span(
        self,
        kind: EventKind,
        *,
        rank: int,
        step: int,
        module: str,
        microbatch: int,
        phase: str | None = None,
        peer: int | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """A context manager recording its body as one event (a shared no-op when disabled)."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, kind, rank, step, module, microbatch, phase, peer)


RECORDER = Recorder()
"""This process's recorder; the runtime's hooks write to it."""
