"""The pipeline timeline: what every rank executed, requested and waited for (docs/pipeline.md).

While :data:`RECORDER` is enabled, the runtime records on each rank

* ``FWD`` / ``BWD``: the execution of a forward or backward request for one module and microbatch on
  its owner, and on pp_rank 0 the step function's own forward (until ``model.backward``) and backward
  for each microbatch (module ``<step>``);
* ``REQUEST``: a request sent to another rank (an instant; ``phase`` and ``peer`` say which);
* ``WAIT``: a thread blocked on that request's response (the rank runs other work meanwhile);
* ``STEP``: the step on this rank, from entering the pipeline to its end; ``REDUCE``: the gradient
  average over the data-parallel group after the step (recorded by the umbrella ``mp``).

Each event carries its rank, thread, module path, microbatch and step, with start and end from
``time.perf_counter_ns``. :class:`Timeline` merges the per-process traces (clocks aligned through
``time.time_ns``, so ranks on several hosts line up to NTP accuracy), with times relative to the
origin of the first recorded step, and writes a Chrome trace (JSON for https://ui.perfetto.dev or
chrome://tracing) and a PNG with one row per rank. Disabled, every hook costs one attribute check.

Recording is in :mod:`mp_pipeline.timeline_record`, re-exported here.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mp_pipeline.timeline_record import (
    EXECUTIONS,
    RECORDER,
    STEP_MODULE,
    Event,
    EventKind,
    ProcessTrace,
    Recorder,
)

__all__ = [
    "RECORDER",
    "STEP_MODULE",
    "Event",
    "EventKind",
    "ProcessTrace",
    "Recorder",
    "Timeline",
    "busy_segments",
    "draw_action",
]

_log = logging.getLogger(__name__)


def draw_action(
    ax: Any,
    segments: Sequence[tuple[int, int]],
    row: int,
    label: str,
    color: Any,
    *,
    height: float,
    hatch: str | None,
    scale: float,
    min_label: float,
) -> None:
    """One action's computing ``segments`` (ns) as bars on matplotlib axes ``ax`` at ``row``, hatched
    (a backward) or solid (a forward, more opaque), labelled on its longest segment where that is at
    least ``min_label`` wide; ``scale`` converts ns to the axis' unit. Shared by :meth:`Timeline.render`
    and pictures that stack several timelines."""
    if not segments:
        return
    ax.broken_barh(
        [(a * scale, (b - a) * scale) for a, b in segments],
        (row - height / 2, height),
        facecolors=color,
        edgecolor="0.15",
        lw=0.5,
        hatch=hatch,
        alpha=1.0 if hatch is None else 0.8,
    )
    a, b = max(segments, key=lambda s: s[1] - s[0])
    if (b - a) * scale >= min_label:
        ax.text(
            (a + b) / 2 * scale,
            row,
            label,
            ha="center",
            va="center",
            fontsize=7,
            fontweight="bold",
            bbox={"facecolor": "white", "alpha": 0.7, "pad": 0.5, "lw": 0},
        )


def busy_segments(start: int, end: int, holes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end]`` minus the union of ``holes`` (the thread's waits): the intervals it computed."""
    out: list[tuple[int, int]] = []
    cursor = start
    for h0, h1 in sorted(holes):
        if h1 <= cursor or h0 >= end:
            continue
        if h0 > cursor:
            out.append((cursor, h0))
        cursor = max(cursor, h1)
    if cursor < end:
        out.append((cursor, end))
    return out


@dataclass(frozen=True)
class Timeline:
    """Events of every rank on one clock, in ns relative to the first recorded step's origin (the
    earliest ``STEP`` start over all ranks; ``step_origins_ns`` holds each step's)."""

    events: tuple[Event, ...]
    labels: dict[int, str] = field(default_factory=dict)
    step_origins_ns: dict[int, int] = field(default_factory=dict)

    # -- building --------------------------------------------------------------------------------------
    @classmethod
    def merge(cls, traces: Sequence[ProcessTrace]) -> Timeline:
        """Merge the traces of all processes (e.g. gathered to rank 0)."""
        absolute: list[Event] = []
        labels: dict[int, str] = {}
        for trace in traces:
            labels.update(trace.labels)
            off = trace.clock_offset_ns
            absolute += [replace(e, start_ns=e.start_ns + off, end_ns=e.end_ns + off) for e in trace.events]
        if not absolute:
            return cls((), labels, {})
        starts: dict[int, int] = {}
        for e in absolute:
            if e.kind is EventKind.STEP:
                starts[e.step] = min(starts.get(e.step, e.start_ns), e.start_ns)
        origin = min(starts.values()) if starts else min(e.start_ns for e in absolute)
        events = sorted(
            (replace(e, start_ns=e.start_ns - origin, end_ns=e.end_ns - origin) for e in absolute),
            key=lambda e: (e.start_ns, e.rank, e.end_ns),
        )
        return cls(tuple(events), labels, {s: t - origin for s, t in sorted(starts.items())})

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({e.rank for e in self.events} | set(self.labels)))

    def select(
        self, kind: EventKind | None = None, *, rank: int | None = None, step: int | None = None
    ) -> list[Event]:
        return [
            e
            for e in self.events
            if (kind is None or e.kind is kind)
            and (rank is None or e.rank == rank)
            and (step is None or e.step == step)
        ]

    def compute_segments(self, rank: int) -> list[tuple[Event, list[tuple[int, int]]]]:
        """Each FWD/BWD execution of ``rank`` with the intervals it computed (its thread's waits cut out)."""
        waits: dict[str, list[tuple[int, int]]] = {}
        for e in self.select(EventKind.WAIT, rank=rank):
            waits.setdefault(e.thread, []).append((e.start_ns, e.end_ns))
        return [
            (e, busy_segments(e.start_ns, e.end_ns, waits.get(e.thread, ())))
            for e in self.events
            if e.rank == rank and e.kind in EXECUTIONS
        ]

    def stage_time_s(self, rank: int) -> float | None:
        """Seconds ``rank`` computed per microbatch and step: the union of its FWD/BWD executions with
        waits cut out (nested executions count once), over its recorded steps and their microbatches.
        None when the rank recorded no execution. The partition report's measured stage time."""
        intervals = sorted(seg for _, segs in self.compute_segments(rank) for seg in segs)
        if not intervals:
            return None
        busy, end = 0, None
        for a, b in intervals:
            if end is None or a >= end:
                busy += b - a
                end = b
            elif b > end:
                busy += b - end
                end = b
        runs = {(e.step, e.microbatch) for e in self.events if e.rank == rank and e.kind in EXECUTIONS}
        runs = {r for r in runs if r[1] >= 0}
        return busy / 1e9 / max(len(runs), 1)

    def busy_fraction(self, rank: int) -> float:
        """Share of ``rank``'s step time spent executing modules (FWD/BWD, waits excluded)."""
        step = sum(e.duration_ns for e in self.select(EventKind.STEP, rank=rank))
        busy = sum(b - a for _, segs in self.compute_segments(rank) for a, b in segs)
        return busy / step if step > 0 else 0.0

    # -- Chrome trace ----------------------------------------------------------------------------------
    def to_chrome(self) -> dict[str, Any]:
        """The Chrome trace-event format: complete events (``ph: "X"``, µs) with ``pid`` = rank and
        ``tid`` = thread, instants (``ph: "i"``) for requests, and process/thread names."""
        tids: dict[tuple[int, str], int] = {}
        for rank, thread in sorted({(e.rank, e.thread) for e in self.events}, key=_thread_order):
            tids[(rank, thread)] = sum(1 for r, _ in tids if r == rank)
        out: list[dict[str, Any]] = []
        for rank in self.ranks:
            name = f"rank {rank}" + (f" ({self.labels[rank]})" if rank in self.labels else "")
            out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}})
            out.append(
                {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
            )
        for (rank, thread), tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": thread}})
            out.append(
                {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
            )
        for e in self.events:
            args: dict[str, Any] = {"step": e.step, "module": e.module, "microbatch": e.microbatch}
            if e.phase is not None:
                args["phase"] = e.phase
            if e.peer is not None:
                args["peer"] = e.peer
            item: dict[str, Any] = {
                "name": _event_name(e),
                "cat": e.kind.value,
                "pid": e.rank,
                "tid": tids[(e.rank, e.thread)],
                "ts": round(e.start_ns / 1000, 3),
                "args": args,
            }
            if e.kind is EventKind.REQUEST:
                item.update(ph="i", s="t")
            else:
                item.update(ph="X", dur=round(e.duration_ns / 1000, 3))
            out.append(item)
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write_chrome(self, path: str | os.PathLike[str]) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_chrome()))
        return target

    # -- picture ---------------------------------------------------------------------------------------
    def render(self, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
        """Draw one row per rank: the computing part of each FWD (solid) and BWD (hatched) execution,
        coloured by microbatch and labelled F<mb>/B<mb>, the data-parallel reduction in grey, each
        rank's step as a light band (so idle time shows as gaps). Needs matplotlib (extra ``plot``)."""
        try:
            from matplotlib import colormaps
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as exc:
            raise ImportError("drawing a timeline needs matplotlib: pip install 'mp-pipeline[plot]'") from exc
        ranks = self.ranks
        mbs = sorted({e.microbatch for e in self.events if e.kind in EXECUTIONS and e.microbatch >= 0})
        cmap = colormaps["tab10" if len(mbs) <= 10 else "tab20" if len(mbs) <= 20 else "turbo"]
        n_colors = 10 if len(mbs) <= 10 else 20 if len(mbs) <= 20 else max(len(mbs), 1)

        def color(mb: int) -> Any:
            index = mbs.index(mb) if mb in mbs else 0
            return cmap(index % n_colors if n_colors <= 20 else index / max(n_colors - 1, 1))

        end = max((e.end_ns for e in self.events), default=1)
        scale = 1e-6  # ns -> ms
        fig = Figure(figsize=(12, 1.0 + 0.75 * max(len(ranks), 1)))
        ax = fig.add_subplot(1, 1, 1)
        height = 0.7
        min_label = end * scale * 0.018
        for row, rank in enumerate(ranks):
            y = row - height / 2
            for e in self.select(EventKind.STEP, rank=rank):
                ax.broken_barh(
                    [(e.start_ns * scale, e.duration_ns * scale)],
                    (row - 0.45, 0.9),
                    facecolors="0.94",
                    zorder=0,
                )
            for e in self.select(EventKind.REDUCE, rank=rank):
                ax.broken_barh(
                    [(e.start_ns * scale, e.duration_ns * scale)],
                    (y, height),
                    facecolors="0.6",
                    edgecolor="0.3",
                    lw=0.5,
                )
                if e.duration_ns * scale >= min_label:
                    ax.text(
                        (e.start_ns + e.end_ns) / 2 * scale, row, "dp", ha="center", va="center", fontsize=7
                    )
            for e, segs in self.compute_segments(rank):
                bwd = e.kind is EventKind.BWD
                draw_action(
                    ax,
                    segs,
                    row,
                    f"{'B' if bwd else 'F'}{e.microbatch}",
                    color(e.microbatch),
                    height=height,
                    hatch="///" if bwd else None,
                    scale=scale,
                    min_label=min_label,
                )
        for origin in list(self.step_origins_ns.values())[1:]:
            ax.axvline(origin * scale, color="0.3", ls="--", lw=0.8)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels(
            [
                f"rank {r}"
                + (f"\n{self.labels[r]}" if r in self.labels else "")
                + f"\n{100 * self.busy_fraction(r):.0f}% busy"
                for r in ranks
            ],
            fontsize=8,
        )
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_xlim(0, end * scale * 1.01)
        ax.set_xlabel("time (ms)")
        handles = [
            Patch(facecolor="white", edgecolor="0.15", label="forward (Req::FWD)"),
            Patch(facecolor="white", edgecolor="0.15", hatch="///", label="backward (Req::BWD)"),
            Patch(facecolor="0.94", edgecolor="0.8", label="step (idle where empty)"),
        ]
        if self.select(EventKind.REDUCE):
            handles.append(Patch(facecolor="0.6", edgecolor="0.3", label="data-parallel allreduce (dp)"))
        handles += [Patch(facecolor=color(m), label=f"microbatch {m}") for m in mbs]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
        steps = sorted({e.step for e in self.events})
        ax.set_title(
            title or f"pipeline timeline, step{'s' if len(steps) > 1 else ''} {_ranges(steps)}", fontsize=10
        )
        fig.tight_layout()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=130)
        return target

    def write(self, path_prefix: str | os.PathLike[str], *, title: str | None = None) -> tuple[Path, ...]:
        """Write ``<prefix>.json`` (Chrome trace) and ``<prefix>.png``; returns the paths written.

        The picture is optional: without matplotlib only the trace is written (and returned), and one
        warning says how to get the picture, so that a recording inside a training run never ends it."""
        prefix = os.fspath(path_prefix)
        trace = self.write_chrome(prefix + ".json")
        try:
            return trace, self.render(prefix + ".png", title=title)
        except ImportError as exc:
            _log.warning("timeline trace written to %s; no picture: %s", trace, exc)
            return (trace,)


def _thread_order(key: tuple[int, str]) -> tuple[int, int, list[str | int]]:
    """Rank, then its main thread, then the others in natural order (w2 before w10)."""
    rank, thread = key
    natural: list[str | int] = [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", thread)]
    return rank, 0 if thread == "MainThread" else 1, natural


def _event_name(e: Event) -> str:
    if e.kind in EXECUTIONS:
        return f"{e.kind.value} mb{e.microbatch}"
    if e.kind is EventKind.REQUEST:
        return f"request {e.phase} mb{e.microbatch} -> rank {e.peer}"
    if e.kind is EventKind.WAIT:
        return f"wait {e.phase} mb{e.microbatch} on rank {e.peer}"
    if e.kind is EventKind.STEP:
        return f"step {e.step}"
    return "data-parallel allreduce"


def _ranges(values: Sequence[int]) -> str:
    if not values:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"
