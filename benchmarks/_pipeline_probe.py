"""Where a pipelined step's time goes: stage compute timed in place, and the same work without overhead.

:class:`StageProbe` puts module hooks on the GPT of benchmarks/_pipeline_gpt.py, the same hooks for every
system, and records on each rank when each stage's forward and backward of a microbatch ran:

* ``f0``: ``front.wte`` starts → front's last layer ends; ``b0``: the gradient reaches front's last
  layer's output → its first layer's input gradient is done (the embedding's backward is left out);
* ``f1``: back's first layer starts → ``back.loss`` ends; ``b1``: the gradient reaches ``back.loss``'s
  output → back's first layer's input gradient is done.

(Layers: ``Front.layers()`` and ``Back.layers()``, whole blocks and the halves of a block cut in two.)

Hooks run where a module runs (mp: on its owner, since ``front``/``back`` call their children locally),
so the intervals are the compute as it happened inside the pipeline, slowed by whatever else shared the
cores. :func:`analyse` then replays the same operations, in the order each rank ran them and with the
same durations, with no time between dependent operations (no communication, no runtime): the
makespan of that replay over the measured window (first operation's start to last one's end) is the
share of the window the pipeline runtime did not lose.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from _pipeline_gpt import GPT
from torch import nn

__all__ = ["GAP_KINDS", "StageProbe", "analyse"]

GAP_KINDS = ("FF", "FB", "BF", "BB")
"""Transitions between a rank's consecutive stage operations (forward or backward, then the next)."""

_DEPENDS = {"f1": "f0", "b1": "f1", "b0": "b1"}


class StageProbe:
    def __init__(self, model: GPT) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._open: dict[str, float] = {}
        front, back = model.front.layers(), model.back.layers()
        if not front or not back:
            raise ValueError("the probe needs at least one layer in each stage")
        self._span("f0", model.front.wte, front[-1])
        self._span("f1", back[0], model.back.loss)
        self._backward_span("b0", front[-1], front[0])
        self._backward_span("b1", model.back.loss, back[0])

    def _begin(self, kind: str) -> None:
        self._open[kind] = time.perf_counter()

    def _finish(self, kind: str) -> None:
        start = self._open.pop(kind, None)
        if start is not None:
            self.events.append((kind, start, time.perf_counter()))

    def _span(self, kind: str, first: nn.Module, last: nn.Module) -> None:
        first.register_forward_pre_hook(lambda *_: self._begin(kind))
        last.register_forward_hook(lambda *_: self._finish(kind))

    def _backward_span(self, kind: str, first: nn.Module, last: nn.Module) -> None:
        first.register_full_backward_pre_hook(lambda *_: self._begin(kind))
        last.register_full_backward_hook(lambda *_: self._finish(kind))

    def take(self) -> list[tuple[str, float, float]]:
        events, self.events = self.events, []
        self._open.clear()
        return events


def analyse(per_rank: list[list[tuple[str, float, float]]]) -> dict[str, Any] | None:
    """Window, zero-overhead makespan and per-rank compute of one step (None if the events don't form
    a pipeline of f0 → f1 → b1 → b0 per microbatch)."""
    ops: list[list[tuple[str, int, float]]] = []
    counts: dict[str, int] = {}
    for events in per_rank:
        seq = []
        for kind, start, end in sorted(events, key=lambda e: e[1]):
            k = counts.get(kind, 0)
            counts[kind] = k + 1
            seq.append((kind, k, end - start))
        ops.append(seq)
    if len(set(counts.values())) != 1 or set(counts) != {"f0", "f1", "b0", "b1"}:
        return None
    done: dict[tuple[str, int], float] = {}
    pos = [0] * len(ops)
    clock = [0.0] * len(ops)
    progress = True
    while progress:
        progress = False
        for r, seq in enumerate(ops):
            while pos[r] < len(seq):
                kind, k, duration = seq[pos[r]]
                dep = _DEPENDS.get(kind)
                ready = 0.0
                if dep is not None:
                    if (dep, k) not in done:
                        break
                    ready = done[(dep, k)]
                clock[r] = max(clock[r], ready) + duration
                done[(kind, k)] = clock[r]
                pos[r] += 1
                progress = True
    if any(p < len(seq) for p, seq in zip(pos, ops, strict=True)):
        return None
    everything = [e for events in per_rank for e in events]
    window = max(e[2] for e in everything) - min(e[1] for e in everything)
    stages = {kind: sum(end - start for k, start, end in everything if k == kind) for kind in counts}
    return {
        "microbatches": counts["f0"],
        "window_s": window,
        "makespan_s": max(done.values()),
        "compute_s": [sum(d for _, _, d in seq) for seq in ops],
        "stage_compute_s": stages,
        "gaps_s": [_gaps(events) for events in per_rank],
    }


def _gaps(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """One rank's idle time between consecutive operations, summed by transition: "FF" (a forward to the
    next), "FB" (a forward to a backward), "BF", "BB"."""
    out = dict.fromkeys(GAP_KINDS, 0.0)
    ordered = sorted(events, key=lambda e: e[1])
    for (kind, _, end), (nxt, start, _) in itertools.pairwise(ordered):
        out[kind[0].upper() + nxt[0].upper()] += max(0.0, start - end)
    return out
