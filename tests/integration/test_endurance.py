"""Memory stays flat over a few hundred training steps, on every rank, on each training path
(pipeline under each schedule and mode, data parallelism, tensor parallelism).

Short tests prove equality; only a long run shows a leak. Each case trains 200 steps and compares the
rank's live tensors (counted by the garbage collector) and its resident memory at step 200 with step
20. A leak of one activation per microbatch (what the pipeline once did on pp_rank 0: received outputs
kept alive with their autograd graphs) adds thousands of tensors and ~100 MB here; the bounds leave
room only for tensors in flight and allocator noise.
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
BASELINE_STEP = 20
MAX_TENSOR_GROWTH = 24  # a step's worth of in-flight tensors, not a per-step leak (16 per step here)
MAX_RSS_GROWTH_MB = 16.0  # the leak this guards against grew ~100 MB over these steps

PATHS: dict[str, dict[str, Any]] = {
    "pp2-interleaved": {"pipeline_parallel_degree": 2, "microbatches": 4},
    "pp2-simple": {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple"},
    "pp2-static": {"pipeline_parallel_degree": 2, "microbatches": 4, "static_mode": True},
    "pp2-fast": {"pipeline_parallel_degree": 2, "microbatches": 4, "fast_mode": True},
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
    samples: dict[int, tuple[int, float]] = {}
    for i in range(1, STEPS + 1):
        optimizer.zero_grad()
        train_step(model, x, y).reduce_mean()
        optimizer.step()
        if i in (BASELINE_STEP, STEPS):
            samples[i] = (_live_tensors(), _rss_mb())
    return {"rank": smp.rank(), "samples": samples}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_memory_stays_flat(worlds: Any, path: str) -> None:
    for r in worlds.run(2, _train, PATHS[path], timeout=600):
        (t0, rss0), (t1, rss1) = r["samples"][BASELINE_STEP], r["samples"][STEPS]
        where = f"{path}, rank {r['rank']}, step {BASELINE_STEP} -> {STEPS}"
        assert t1 - t0 <= MAX_TENSOR_GROWTH, f"{where}: live tensors grew {t0} -> {t1}"
        assert rss1 - rss0 <= MAX_RSS_GROWTH_MB, f"{where}: RSS grew {rss0:.1f} -> {rss1:.1f} MB"
