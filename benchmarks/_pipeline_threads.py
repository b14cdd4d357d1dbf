"""Does compute run slower in a fresh thread? (part of benchmarks/pipeline_vs_torch.py)

mp's module servers run every microbatch's forward and every request in worker threads that live for
one step (mp_pipeline/server.py). This times one forward + backward of the GPT on one microbatch on
rank 0 (rank 1 sleeps), interleaved: in the main thread, in a new thread each time (as mp's workers), and
in one long-lived thread, with the minor page faults of the computing thread (``RUSAGE_THREAD``).
"""

from __future__ import annotations

import queue
import resource
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from _pipeline_common import idle_barrier
from _pipeline_gpt import GPT

__all__ = ["measure_fresh_threads"]

Result = tuple[float, int]


def _work(model: GPT, x: torch.Tensor, y: torch.Tensor) -> Result:
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0 = time.perf_counter()
    model(x, y).backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults


def measure_fresh_threads(
    comm: Any, model: GPT, x: torch.Tensor, y: torch.Tensor, *, reps: int
) -> dict[str, Any] | None:
    """Medians over ``reps`` interleaved repetitions (rank 0; None elsewhere). Collective."""
    if comm.Get_rank() != 0:
        idle_barrier(comm)
        return None
    jobs: queue.Queue[int] = queue.Queue()
    done: queue.Queue[Result] = queue.Queue()

    def serve() -> None:
        while jobs.get() >= 0:
            done.put(_work(model, x, y))

    keeper = threading.Thread(target=serve, name="long-lived", daemon=True)
    keeper.start()

    def main() -> Result:
        return _work(model, x, y)

    def fresh() -> Result:
        out: list[Result] = []
        t = threading.Thread(target=lambda: out.append(_work(model, x, y)), name="fresh")
        t.start()
        t.join()
        return out[0]

    def long_lived() -> Result:
        jobs.put(1)
        return done.get()

    variants: dict[str, Callable[[], Result]] = {
        "main thread": main,
        "fresh thread": fresh,
        "long-lived thread": long_lived,
    }
    for fn in variants.values():
        fn()
    got: dict[str, list[Result]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        for name in names[rep % 3 :] + names[: rep % 3]:
            got[name].append(variants[name]())
    jobs.put(-1)
    keeper.join()
    idle_barrier(comm)
    out: dict[str, Any] = {
        name: {
            "ms": statistics.median(t * 1e3 for t, _ in v),
            "min_ms": min(t * 1e3 for t, _ in v),
            "minor_faults": statistics.median(f for _, f in v),
        }
        for name, v in got.items()
    }
    out["fresh_over_long_lived"] = statistics.median(  # time ratio, paired within a repetition
        a[0] / b[0] for a, b in zip(got["fresh thread"], got["long-lived thread"], strict=True)
    )
    out["sequences"] = int(x.shape[0])
    out["repetitions"] = reps
    return out
