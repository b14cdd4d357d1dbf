"""`smp.timeline`: record what every rank executes, requests and waits for during pipelined steps.

    with smp.timeline.record("out/timeline") as rec:    # on every rank, around one or more steps
        loss = train_step(model, data).reduce_mean()
    if smp.rank() == 0:
        print(rec.paths)     # out/timeline.json (Chrome trace: https://ui.perfetto.dev), out/timeline.png
                             # (the picture only where matplotlib is installed)

or ``smp.timeline.start()`` ... ``smp.timeline.stop("out/timeline")``. Every rank records its own events
(mp_pipeline.timeline); at the end of the block (or at ``stop``) they are gathered to global rank 0
over the world group, which merges them and writes the files. Recording costs a few microseconds per
event; outside a recording each hook returns after one attribute check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from mp.comm import CommGroup, gather
from mp.errors import SMPValidationError
from mp.state import state
from mp_pipeline import RECORDER, Timeline

__all__ = ["Recording", "is_recording", "record", "start", "stop"]


@dataclass
class Recording:
    """What :func:`record` yields; filled on global rank 0 when the block ends."""

    timeline: Timeline | None = None
    """The merged timeline of every rank (None on other ranks and until the block ends)."""
    paths: tuple[Path, ...] | None = None
    """The files rank 0 wrote: the Chrome trace (``<prefix>.json``), then the picture (``<prefix>.png``)
    where matplotlib is installed (without it, a warning says how to get the picture and the run goes
    on)."""


def is_recording() -> bool:
    return RECORDER.enabled


def start() -> None:
    """Start recording on this rank (call on every rank, before the steps to record)."""
    state.require()
    if RECORDER.enabled:
        raise SMPValidationError(
            "smp.timeline.start() was called while a timeline is already recording; "
            "call smp.timeline.stop() first"
        )
    RECORDER.start()


def stop(path_prefix: str | os.PathLike[str] | None = None, *, title: str | None = None) -> Timeline | None:
    """Stop recording and gather every rank's events to global rank 0. Collective over the world:
    call it on every rank. Rank 0 gets the merged :class:`~mp_pipeline.Timeline` (and, with
    ``path_prefix``, writes ``<prefix>.json`` and ``<prefix>.png``); the other ranks get None."""
    cfg, world, topo = state.require()
    if not RECORDER.enabled:
        raise SMPValidationError(
            "smp.timeline.stop() was called without a recording; call smp.timeline.start() first "
            "(on every rank)"
        )
    c = topo.coords(world.rank)
    label = f"pp {c.pp_rank}, dp {c.dp_rank}" + (f", tp {c.tp_rank}" if cfg.tp > 1 else "")
    trace = replace(RECORDER.stop(), labels={world.rank: label})
    traces = gather(trace, CommGroup.WORLD)
    if traces is None:
        return None
    timeline = Timeline.merge(traces)
    if state.model is not None:  # the plan report's measured stage times
        state.model.note_timeline(timeline)
    if path_prefix is not None:
        timeline.write(path_prefix, title=title)
    return timeline


@contextlib.contextmanager
def record(path_prefix: str | os.PathLike[str] | None, *, title: str | None = None) -> Iterator[Recording]:
    """Record the steps run in the block; at its end rank 0 writes ``<prefix>.json`` and ``.png``.
    Call on every rank. If the block raises, the recording is dropped without communicating."""
    start()
    recording = Recording()
    try:
        yield recording
    except BaseException:
        RECORDER.stop()
        raise
    recording.timeline = stop(None)
    if recording.timeline is not None and path_prefix is not None:
        recording.paths = recording.timeline.write(path_prefix, title=title)
