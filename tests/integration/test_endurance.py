"""Memory stays flat over a few hundred training steps, on every rank, on each training path
(pipeline under each schedule and mode, data parallelism, tensor parallelism).

Short tests prove equality; only a long run shows a leak. Each case trains 200 steps on 2 ranks and
compares, per rank:

* live tensors (counted by the garbage collector): the fewest seen over steps 191-200 against the fewest
  over steps 20-29. The minimum over a window leaves out tensors in flight at the moment of a count
  (up to ~40 here); a leak of one tensor every 20 steps still fails. The pipeline once leaked 16 tensors
  a step on pp_rank 0 (received outputs kept alive with their autograd graphs): +2,900 here.
* resident memory at step 200 against step 100: the allocators' warm-up is over by then (it grows RSS by
  ~15 MB over the first ~400 steps, then holds), and a leak of 160 KB a step or more fails (the
  pipeline's leak was ~600 KB a step at this width).
* garbage in reference cycles left by one step (found by a full collection with ``gc.DEBUG_SAVEALL``):
  none. Such garbage is freed only by a full collection, which runs rarely once a process holds many
  objects, so it piles up between them: pp_rank 0's step driver and its server referred to each other,
  and each step's 48 objects (12 tensors) waited for one, growing RSS by ~3.6% over 2,000 steps of
  benchmarks/soak.py through the allocator's fragmentation.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

WIDTH = 256
BATCH = 32
STEPS = 200
EARLY = range(20, 30)
LATE = range(STEPS - 9, STEPS + 1)
RSS_FROM = 100
MAX_TENSOR_GROWTH = 8
MAX_RSS_GROWTH_MB = 16.0
CYCLES_AT = 150
WEIGHT_HALVES = ("weights_idle", "weights_early", "weights_end")
"""The runtime's per-step counts of deferred weight halves run (zero_bubble's split backward)."""
REPLAYED = {"pp2-interleaved", "pp2-zero_bubble"}
"""The paths whose steady state is per-rank replay (the default config's path): most of their 200 steps
must replay, so the flat memory holds for it, not for a fallback."""

PATHS: dict[str, dict[str, Any]] = {
    "pp2-interleaved": {"pipeline_parallel_degree": 2, "microbatches": 4},
    "pp2-simple": {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple"},
    "pp2-static": {"pipeline_parallel_degree": 2, "microbatches": 4, "static_mode": True},
    "pp2-fast": {"pipeline_parallel_degree": 2, "microbatches": 4, "fast_mode": True},
    "pp2-zero_bubble": {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "zero_bubble"},
    "dp2": {"pipeline_parallel_degree": 1, "microbatches": 2, "ddp": True},
    "tp2": {"tensor_parallel_degree": 2, "microbatches": 2, "ddp": True},
}


class Blocks(nn.Module):
    """A model as users write it: a loop over its blocks, partitioned automatically."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _cyclic_garbage(step: Any) -> list[str]:
    """The types of what ``step()`` leaves in reference cycles (freed only by the cyclic collector)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return sorted(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _train(world: Any, config: dict[str, Any]) -> dict[str, Any]:
    smp.init(config)
    torch.manual_seed(0)
    tp = config.get("tensor_parallel_degree", 1) > 1
    with smp.tensor_parallelism() if tp else contextlib.nullcontext():
        net = Blocks()
    model = smp.DistributedModel(net)
    assert not tp or any(model.distributed_modules()), "tp2 must train distributed layers"
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        optimizer.zero_grad()
        train_step(model, x, y).reduce_mean()
        optimizer.step()

    tensors: dict[int, int] = {}
    rss: dict[int, float] = {}
    cycles: list[str] = []
    replayed_steps = split_steps = 0
    for i in range(1, STEPS + 1):
        if i == CYCLES_AT:
            cycles = _cyclic_garbage(step)
        else:
            step()
        runtime = model.runtime
        if runtime is not None:  # which path the step took: per-rank replay, split backward
            replayed_steps += runtime.last_stats.get("replayed", 0) > 0
            split_steps += sum(runtime.last_stats.get(k, 0) for k in WEIGHT_HALVES) > 0
        if i in EARLY or i in LATE:
            tensors[i] = _live_tensors()
        if i in (RSS_FROM, STEPS):
            rss[i] = _rss_mb()
    return {
        "rank": smp.rank(),
        "tensors": tensors,
        "rss": rss,
        "cycles": cycles,
        "replayed_steps": replayed_steps,
        "split_steps": split_steps,
    }


@pytest.mark.parametrize("path", sorted(PATHS))
def test_memory_stays_flat(worlds: Any, path: str) -> None:
    for r in worlds.run(2, _train, PATHS[path], timeout=600):
        t0 = min(r["tensors"][i] for i in EARLY)
        t1 = min(r["tensors"][i] for i in LATE)
        where = f"{path}, rank {r['rank']}"
        assert t1 - t0 <= MAX_TENSOR_GROWTH, (
            f"{where}: live tensors grew {t0} -> {t1} (fewest, steps 20-29 -> 191-200)"
        )
        assert not r["cycles"], f"{where}: step {CYCLES_AT} left garbage in reference cycles: {r['cycles']}"
        if path in REPLAYED:
            assert r["replayed_steps"] >= STEPS - 10, f"{where}: only {r['replayed_steps']} steps replayed"
        if path == "pp2-zero_bubble" and r["rank"] == 1:
            assert r["split_steps"] >= STEPS - 10, f"{where}: weight halves ran in {r['split_steps']} steps"
        rss0, rss1 = r["rss"][RSS_FROM], r["rss"][STEPS]
        assert rss1 - rss0 <= MAX_RSS_GROWTH_MB, (
            f"{where}: RSS {rss0:.1f} -> {rss1:.1f} MB (steps 100 -> 200)"
        )
