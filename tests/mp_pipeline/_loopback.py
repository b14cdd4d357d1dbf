"""Two pipeline "ranks" as threads of one process over the loopback transport (the mp_pipeline runtime
tests and the timeline test)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mp_comm.transport import LoopbackHub, TransportConfig
from mp_pipeline import ExecState, PipelineRuntime, Scheduler


def owner_of(assignment: dict[str, int], name: str) -> int:
    path = name.rsplit(".", 1)[0] if "." in name else ""
    while path not in assignment:
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return assignment[path]


def run_two_ranks(
    make: Callable[[], nn.Module],
    assignment: dict[str, int],
    body: Callable[[nn.Module, int], Any],
    microbatches: int,
    kind: str,
    *,
    checkpointed: frozenset[str] = frozenset(),
    steps: int = 1,
    keep: list[PipelineRuntime] | None = None,
    before: Callable[[list[nn.Module], list[Any]], None] | None = None,
    scheduler: Callable[[], Scheduler] | None = None,
    **options: Any,
) -> tuple[list[nn.Module], list[Any]]:
    """The last of ``steps`` steps' results on each rank; ``keep`` receives the runtimes; ``before``
    sees each rank's model and transport before the first step; ``scheduler`` makes each step's scheduler
    (default: ``kind`` over ``microbatches``); ``options`` go to each PipelineRuntime."""
    # no busy polling: both "ranks" share this process's GIL
    hub = LoopbackHub(2, config=TransportConfig(timeout=30.0, spin_time=0.0, poll_min=5e-4, poll_max=5e-4))
    transports = [hub.transport(r) for r in range(2)]
    models = [make() for _ in range(2)]
    for r, m in enumerate(models):
        with torch.no_grad():
            for name, p in m.named_parameters():
                if owner_of(assignment, name) != r:
                    p.fill_(float("nan"))
    runtimes = [
        PipelineRuntime(transport=transports[r], rank=r, peers=(0, 1), model_id=1, timeout=30.0, **options)
        for r in range(2)
    ]
    for r in range(2):
        runtimes[r].install(models[r], assignment)
        runtimes[r].remote.checkpointed = set(checkpointed)
    if before is not None:
        before(models, transports)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            for _ in range(steps):
                out[r] = runtimes[r].run_step(
                    lambda mb: body(models[0], mb),
                    Scheduler(kind, microbatches) if scheduler is None else scheduler(),
                    ExecState(True),  # type: ignore[arg-type]
                )
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if keep is not None:
        keep.extend(runtimes)
    return models, out
