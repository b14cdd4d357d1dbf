"""Where one pipelined step's time goes, per rank (benchmarks/pipeline_users.py; docs/pipeline.md).

For one observed step of each pipelined system, every rank's actions and its blocking receives, as
:class:`mp_pipeline.timeline.Event` on one clock:

* mp: its recorder's ``FWD`` / ``BWD`` executions (mp_pipeline.timeline; on pp_rank 0 the step
  function's own forward and backward of each microbatch), every receive of its transport
  (``Mailbox.take``, recorded here as ``WAIT`` events of phase :data:`RECV` while the step is observed)
  and the runtime's path of each call made to another rank (``Remote.call``, and ``Link.backward`` for
  its backward: phase :data:`CALL`), which is cut out of the execution it runs in: on pp_rank 0 that is
  the guard and the posting of each call, the runtime's own time, not the module's compute;
* torch.distributed.pipelining: its stages' ``forward_one_chunk``, the loss, ``backward_one_chunk``
  (the input-gradient half under ZBV) and ``backward_weight_one_chunk`` calls (:class:`ActionClock`),
  and its waits on send/recv work (``schedules._wait_batch_p2p``, phase :data:`RECV`).

:func:`split` divides each rank's step (mp: its ``STEP`` event, from entering the pipeline to its end;
torch: ``schedule.step``) into *compute* (the union of its actions, waits cut out), *waiting for a peer*
(its blocking receives outside any action) and the runtime's *own* time (the rest: scheduling, messages,
the guard). :func:`render` draws the systems' steps stacked, one row per rank, on one time axis.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mp_pipeline.timeline import Event, EventKind, Recorder, Timeline, busy_segments, draw_action
from mp_pipeline.timeline_record import EXECUTIONS

__all__ = [
    "CALL",
    "RECV",
    "ActionClock",
    "RankTime",
    "call_paths",
    "cause",
    "recording_mp",
    "recording_torch_waits",
    "render",
    "split",
]

RECV = "recv"
"""Phase of the WAIT events recorded here for a blocking receive, apart from the runtime's own WAITs."""
CALL = "call"
"""Phase of the WAIT events recorded here around the runtime's path of a call to another rank (its
forward in ``Remote.call``, its backward in ``Link.backward``): cut out of compute like a wait, counted
as the runtime's own time (less the receives inside it)."""
WEIGHTS = " weights"
"""Suffix of a torch stage's module name on its weight-gradient half (ZBV's ``backward_weight_one_chunk``)."""
LOSS = "loss"
WAITING: dict[str, Any] = {"facecolor": "white", "edgecolor": "#d62728", "hatch": "...", "lw": 0}
"""How the pictures draw waiting for a peer: red dots, apart from every microbatch's solid colour."""


class ActionClock:
    """A torch runner's stage actions, timed: each call adds its time to ``runner.busy`` and, while
    ``recorder`` records, becomes an event (microbatch: the call's first argument; the loss: the last
    forward's)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.recorder = Recorder()
        self.last_forward = 0

    def wrap(self, runner: Any, fn: Callable[..., Any], kind: EventKind, module: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter_ns()
                runner.busy += (t1 - t0) / 1e9
                if self.recorder.enabled:
                    mb = self.last_forward if module == LOSS else int(args[0])
                    if kind is EventKind.FWD and module != LOSS:
                        self.last_forward = mb
                    self.recorder.add(
                        kind, rank=self.rank, step=0, module=module, microbatch=mb, start_ns=t0, end_ns=t1
                    )

        return wrapper

    def step(self) -> contextlib.AbstractContextManager[None]:
        """The schedule's step as this rank's ``STEP`` event (nothing unless recording)."""
        return self.recorder.span(EventKind.STEP, rank=self.rank, step=0, module="<step>", microbatch=-1)


def _wait_event(
    recorder: Recorder, rank: int, t0: int, peer: int | None, *, phase: str = RECV, what: str = ""
) -> None:
    recorder.add(
        EventKind.WAIT,
        rank=rank,
        step=0,
        module=what,
        microbatch=-1,
        start_ns=t0,
        end_ns=time.perf_counter_ns(),
        phase=phase,
        peer=peer,
    )


@contextlib.contextmanager
def recording_torch_waits(clock: ActionClock) -> Iterator[None]:
    """While the block runs, torch.distributed.pipelining's waits on its send/recv work are recorded
    into ``clock``'s recorder."""
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p

    def timed(work: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            original(work)
        finally:
            _wait_event(clock.recorder, clock.rank, t0, None)

    schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def _mp_methods() -> list[tuple[type, str, str]]:
    """The methods :func:`recording_mp` times: (class, name, phase)."""
    from mp_comm.transport.mailbox import Mailbox
    from mp_pipeline.link import Link
    from mp_pipeline.remote import Remote

    return [(Mailbox, "take", RECV), (Remote, "call", CALL), (Link, "backward", CALL)]


def _timed_method(
    original: Callable[..., Any], phase: str, what: str, recorder: Recorder, rank: int
) -> Callable[..., Any]:
    """``original`` recording each call as a WAIT event of ``phase`` (a receive's peer: its source)."""

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            source = args[0] if phase == RECV and args and isinstance(args[0], int) else -1
            _wait_event(recorder, rank, t0, source if source >= 0 else None, phase=phase, what=what)

    return timed


@contextlib.contextmanager
def recording_mp(recorder: Recorder, rank: int) -> Iterator[None]:
    """While the block runs, every receive of mp's transports (``Mailbox.take``: a rank's main loop
    waiting for its next message, a thread waiting for a handed tensor; phase :data:`RECV`, the peer its
    source) and the runtime's path of every call to another rank (phase :data:`CALL`) are recorded into
    ``recorder``, on the thread that ran them (the event's module: ``"<class>.<method>"``)."""
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in _mp_methods()]
    for (cls, name, original), (_, _, phase) in zip(originals, _mp_methods(), strict=True):
        setattr(cls, name, _timed_method(original, phase, f"{cls.__name__}.{name}", recorder, rank))
    try:
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


@dataclass(frozen=True)
class RankTime:
    """One rank's observed step, in ms."""

    rank: int
    step: float
    compute: float
    wait: float
    own: float
    actions: int
    fill: float
    """Waiting before the rank's first action."""
    drain: float
    """Waiting after its last action."""
    calls: int = 0
    """mp: the paths of calls to another rank it ran (a call's forward and its backward count apart)."""
    in_calls: float = 0.0
    """mp: the part of ``own`` spent in those paths."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _union(intervals: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The union of ``intervals`` clipped to ``[lo, hi]``, sorted and disjoint."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(intervals: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint sorted ``intervals`` minus disjoint sorted ``holes``."""
    return [seg for a, b in intervals for seg in busy_segments(a, b, holes)]


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in intervals)


def _receives(timeline: Timeline, rank: int) -> list[tuple[int, int]]:
    return [(e.start_ns, e.end_ns) for e in timeline.select(EventKind.WAIT, rank=rank) if e.phase == RECV]


def call_paths(timeline: Timeline, rank: int) -> list[tuple[Event, list[tuple[int, int]]]]:
    """Each recorded call path (phase :data:`CALL`) of ``rank`` with the intervals it ran: its span less
    where its thread waited (parked on a response, or receiving)."""
    waits = timeline.select(EventKind.WAIT, rank=rank)
    parked: dict[str, list[tuple[int, int]]] = {}
    for e in waits:
        if e.phase != CALL:
            parked.setdefault(e.thread, []).append((e.start_ns, e.end_ns))
    return [
        (e, busy_segments(e.start_ns, e.end_ns, parked.get(e.thread, ()))) for e in waits if e.phase == CALL
    ]


def split(timeline: Timeline) -> list[RankTime]:
    """Each rank's step divided into compute, waiting for a peer and the runtime's own time."""
    out = []
    for rank in timeline.ranks:
        steps = timeline.select(EventKind.STEP, rank=rank)
        if not steps:
            continue
        lo, hi = min(e.start_ns for e in steps), max(e.end_ns for e in steps)
        segments = timeline.compute_segments(rank)
        compute = _union([s for _, segs in segments for s in segs], lo, hi)
        wait = _minus(_union(_receives(timeline, rank), lo, hi), compute)
        paths = call_paths(timeline, rank)
        running = [seg for _, segs in paths for seg in segs]
        in_calls = _minus(_minus(_union(running, lo, hi), compute), wait)
        first = compute[0][0] if compute else hi
        last = compute[-1][1] if compute else hi
        ms = 1e-6
        out.append(
            RankTime(
                rank=rank,
                step=(hi - lo) * ms,
                compute=_length(compute) * ms,
                wait=_length(wait) * ms,
                own=(hi - lo - _length(compute) - _length(wait)) * ms,
                actions=sum(1 for _, segs in segments if segs),
                fill=_length(_union(wait, lo, first)) * ms,
                drain=_length(_union(wait, last, hi)) * ms,
                calls=len(paths),
                in_calls=_length(in_calls) * ms,
            )
        )
    return out


def cause(row: RankTime, ranks: int) -> str:
    """One sentence on where ``row``'s step went beyond compute: its waits (fill, between actions,
    drain) or the runtime's own time: per call to another rank where it made some, else per action."""
    peer = f"rank {1 - row.rank}" if ranks == 2 else "its peers"
    between = max(row.wait - row.fill - row.drain, 0.0)
    if row.wait >= row.own and row.wait >= 0.1 * row.step:
        return (
            f"waited {row.wait:.1f} ms for {peer}: {row.fill:.1f} before its first action (fill), "
            f"{between:.1f} between actions, {row.drain:.1f} after its last (drain)"
        )
    if row.own >= 0.1 * row.step and row.calls:
        return (
            f"{row.own:.1f} ms of the runtime's own, {row.in_calls:.1f} of it in the paths of its "
            f"{row.calls} calls to another rank ({row.in_calls / row.calls * 1e3:.0f} µs each)"
        )
    if row.own >= 0.1 * row.step and row.actions:
        return (
            f"{row.own:.1f} ms of the runtime's own over {row.actions} actions "
            f"({row.own / row.actions * 1e3:.0f} µs per action)"
        )
    return f"computed {row.compute / row.step:.0%} of its step" if row.step > 0 else "-"


def _letter(timeline: Timeline, split_backward: bool) -> Callable[[Any], str]:
    """F, B or W (a weight-gradient half) for each execution of ``timeline``. mp records a split
    backward's two halves as two BWD executions of the same call: the second one is the weight half."""
    seen: set[tuple[int, str, int]] = set()
    letters: dict[int, str] = {}
    for e in timeline.events:
        if e.kind is EventKind.FWD:
            letters[id(e)] = "F"
        elif e.kind is EventKind.BWD:
            key = (e.rank, e.module, e.microbatch)
            weight = e.module.endswith(WEIGHTS) or (split_backward and key in seen)
            seen.add(key)
            letters[id(e)] = "W" if weight else "B"
    return lambda e: letters.get(id(e), "F")


def render(panels: Sequence[tuple[str, Timeline, bool]], path: str | Path, *, title: str) -> Path | None:
    """One picture, the systems stacked (``(name, timeline, split_backward)`` each), one row per rank on
    one time axis from each system's step start: the step as a light band (the runtime's own time where
    nothing else covers it), waiting for a peer as red dots, each action's computing part coloured by
    microbatch (forward solid, backward hatched ``///``, weight half hatched ``xx``). None without
    matplotlib."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return None
    mbs = sorted(
        {e.microbatch for _, tl, _ in panels for e in tl.events if e.kind in EXECUTIONS and e.microbatch >= 0}
    )
    cmap = colormaps["tab10" if len(mbs) <= 10 else "tab20"]

    def color(mb: int) -> Any:
        return cmap((mbs.index(mb) if mb in mbs else 0) % (10 if len(mbs) <= 10 else 20))

    scale = 1e-6
    end = max((e.end_ns for _, tl, _ in panels for e in tl.events), default=1) * scale
    rows = sum(len(tl.ranks) for _, tl, _ in panels)
    fig = Figure(figsize=(12, 1.2 + 0.6 * rows + 0.35 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    height, min_label = 0.7, end * 0.018
    for ax, (name, tl, split_backward) in zip(axes, panels, strict=True):
        letter = _letter(tl, split_backward)
        times = {r.rank: r for r in split(tl)}
        for row, rank in enumerate(tl.ranks):
            for e in tl.select(EventKind.STEP, rank=rank):
                band = [(e.start_ns * scale, e.duration_ns * scale)]
                ax.broken_barh(band, (row - 0.45, 0.9), facecolors="0.9")
            ax.broken_barh(
                [(a * scale, (b - a) * scale) for a, b in _union(_receives(tl, rank), 0, 1 << 62)],
                (row - 0.45, 0.9),
                **WAITING,
            )
            for e, segs in tl.compute_segments(rank):
                kind = letter(e)
                draw_action(
                    ax,
                    segs,
                    row,
                    f"{kind}{e.microbatch}",
                    color(e.microbatch),
                    height=height,
                    hatch={"F": None, "B": "///", "W": "xx"}[kind],
                    scale=scale,
                    min_label=min_label,
                )
        labels = []
        for rank in tl.ranks:
            t = times.get(rank)
            labels.append(
                f"rank {rank}" + (f"\n{t.compute:.0f}/{t.wait:.0f}/{t.own:.0f} ms" if t is not None else "")
            )
        ax.set_yticks(range(len(tl.ranks)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_ylim(len(tl.ranks) - 0.5, -0.5)
        step = max((t.step for t in times.values()), default=0.0)
        ax.set_title(f"{name}: step {step:.1f} ms (per rank: compute/waiting/own)", fontsize=9, loc="left")
    axes[-1].set_xlim(0, end * 1.01)
    axes[-1].set_xlabel("time from the step's start (ms)")
    handles = [
        Patch(facecolor="white", edgecolor="0.15", label="forward"),
        Patch(facecolor="white", edgecolor="0.15", hatch="///", label="backward (input half under ZB)"),
        Patch(facecolor="white", edgecolor="0.15", hatch="xx", label="weight-gradient half"),
        Patch(**WAITING, label="waiting for a peer"),
        Patch(facecolor="0.9", label="runtime's own (step, nothing else)"),
        *(Patch(facecolor=color(m), label=f"microbatch {m}") for m in mbs),
    ]
    # the legend belongs to the figure, not to the first panel: tight_layout would otherwise squeeze that
    # panel (and so all of them) to the legend's height, which with 16 microbatches exceeds a panel's
    fig.set_figheight(max(fig.get_figheight(), 1.0 + 0.16 * len(handles)))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0.0, 0.0, 0.84, 1.0))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.84, 0.95), fontsize=7, frameon=False)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110, bbox_inches="tight")  # (the legend right of the axes)
    return target
