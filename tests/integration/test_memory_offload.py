"""smp's offload_activations on real worlds: training with the checkpointed blocks' inputs offloaded to host
memory equals plain single-process PyTorch (every step's loss, every gradient of the first step, every
parameter after 3 SGD steps, rtol 1e-5) alone, at pp=2 (simple and interleaved schedules, fast mode) and
at tp=2; and on every rank the recorded schedule loads each microbatch's activations back exactly
``activation_loading_horizon`` backward tasks ahead (mp_memory.offload; the single-process order tests
are in tests/mp_memory/test_offload.py).

On a CPU-only machine the "host" copy is a separate CPU buffer: the scheduling is what is tested here;
docs/gpu.md says how to measure the device-memory drop on a GPU.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp_partition import set_partition

STEPS, MICROBATCHES, ROWS = 3, 4, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Deep(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(Block(), Block(), Block(), Block())
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = smp.checkpoint(block, x) if self.checkpointed else block(x)
        return self.out(x)


def _data(step: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS * replicas, 8, generator=g), torch.randn(ROWS * replicas, 4, generator=g)


def _reference(replicas: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Deep(checkpointed=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, grads = [], {}
    for s in range(STEPS):
        x, y = _data(s, replicas)
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)  # equal microbatches and replicas: the mean of their means
        loss.backward()
        if s == 0:
            grads = {k: p.grad.detach().clone() for k, p in net.named_parameters()}  # type: ignore[union-attr]
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,
        "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
    }


def _train(world: Any, config: dict[str, Any]) -> dict[str, Any]:
    smp.init({"microbatches": MICROBATCHES, "offload_activations": True, **config})
    os.environ["MP_PIPELINE_STATIC_STEPS"] = "1"  # static/fast mode: steps 2 and 3 replay the recording
    try:
        torch.manual_seed(0)
        tp = config.get("tensor_parallel_degree", 1) > 1
        if tp:
            with smp.tensor_parallelism():
                net = Deep(checkpointed=True)
        else:
            net = Deep(checkpointed=True)
        if config.get("pipeline_parallel_degree", 1) > 1:
            for m in (net.blocks[2], net.blocks[3], net.out):
                set_partition(m, 1)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        alive = _watch_offloaded(model._offloader)

        @smp.step
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        dp, mine = smp.dp_size(), slice(smp.dp_rank() * ROWS, (smp.dp_rank() + 1) * ROWS)
        losses, grads = [], {}
        for s in range(STEPS):
            x, y = _data(s, dp)
            opt.zero_grad()
            local = train_step(x[mine], y[mine]).reduce_mean().item()
            losses.append(sum(smp.allgather(local, smp.DP_GROUP)) / dp if dp > 1 else local)
            if s == 0 and not tp:  # tp: shards; the parameters after the steps cover them
                grads = {
                    k.removeprefix("module."): p.grad.detach().clone()
                    for k, p in model.named_parameters()
                    if p.grad is not None
                }
            opt.step()
        if tp:
            from mp_tensor import gather_state_dict

            params = {k: v.detach().clone() for k, v in gather_state_dict(model.module).items()}
        else:
            params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        offloader = model._offloader
        return {
            "rank": smp.rank(),
            "pp_rank": smp.pp_rank(),
            "dp": dp,
            "losses": losses,
            "grads": grads,
            "params": params,
            "events": list(offloader.events),
            "offloaded_bytes": offloader.offloaded_bytes,
            "alive_at_backward": alive,
        }
    finally:
        os.environ.pop("MP_PIPELINE_STATIC_STEPS", None)
        smp.reset()


def _watch_offloaded(offloader: Any) -> list[int]:
    """Per step, how many of the tensors offloaded before this rank's first backward of the step are
    still alive when it starts: offloading frees device memory only if nothing else (the pipeline
    runtime's kept inputs and outputs, say) holds them."""
    refs: list[weakref.ReferenceType[torch.Tensor]] = []
    alive: list[int] = []
    to_host, unpack = offloader._to_host, offloader._unpack

    def watched_to_host(t: torch.Tensor, mb: int) -> Any:
        refs.append(weakref.ref(t))
        return to_host(t, mb)

    def watched_unpack(p: Any) -> torch.Tensor:
        if refs:  # the step's first backward here: count, then start over for the next step
            gc.collect()
            alive.append(sum(r() is not None for r in refs))
            refs.clear()
        return unpack(p)  # type: ignore[no-any-return]

    offloader._to_host, offloader._unpack = watched_to_host, watched_unpack
    return alive


def _first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> str | None:
    for k, value in got.items():
        if k not in want:
            return f"{what} {k}: not in the reference"
        if not torch.allclose(value, want[k], rtol=1e-5, atol=1e-6):
            return f"{what} {k}: max |diff| {(value - want[k]).abs().max().item()}"
    return None


def _assert_equal_to_torch(results: list[dict[str, Any]]) -> None:
    ref = _reference(results[0]["dp"])
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), r["rank"]
        assert set(r["params"]) == set(ref["params"]), r["rank"]
        assert _first_difference(r["params"], ref["params"], "parameter") is None, r["rank"]
        assert _first_difference(r["grads"], ref["grads"], "gradient") is None, r["rank"]


def _assert_loaded_horizon_ahead(events: list[tuple[str, int]], horizon: int, blocks: int) -> None:
    """Each microbatch's checkpointed inputs (one per block this rank runs) were offloaded, or kept when
    their load was already due; each load k was issued when backward max(0, k - horizon) started."""
    for mb in range(MICROBATCHES):
        assert events.count(("offload", mb)) + events.count(("keep", mb)) == blocks, (mb, events)
        assert ("backward", mb) in events, (mb, events)
        if ("offload", mb) not in events:
            continue
        i = events.index(("load", mb))
        last_backward = next(e for e in reversed(events[:i]) if e[0] == "backward")
        assert last_backward == ("backward", max(0, mb - horizon)), (mb, events)
        kept = [m for kind, m in events[:i] if kind == "keep"]
        assert mb not in kept, (mb, events)
    assert any(kind == "offload" for kind, _ in events), events


def test_alone_equals_torch_and_loads_horizon_ahead(worlds: Any) -> None:
    (r,) = worlds.run(1, _train, {"activation_loading_horizon": 1}, timeout=60)
    _assert_equal_to_torch([r])
    # one process runs microbatch after microbatch: only microbatch 0 waits in host memory (smp: offloading
    # pays off with a pipeline); microbatch k's load is due at backward k - 1, before its own forward
    _assert_loaded_horizon_ahead(r["events"], 1, blocks=4)
    assert r["events"].count(("offload", 0)) == 4 and r["events"].count(("keep", 3)) == 4, r["events"]


@pytest.mark.parametrize("pipeline", ["simple", "interleaved", "fast"])
def test_pp2_equals_torch_and_loads_horizon_ahead(worlds: Any, pipeline: str) -> None:
    config = {
        "pipeline_parallel_degree": 2,
        "auto_partition": False,
        "default_partition": 0,
        "pipeline": "interleaved" if pipeline == "fast" else pipeline,
        "fast_mode": pipeline == "fast",  # recorded messages replayed, child-to-child shortcuts
        "activation_loading_horizon": 1,
    }
    results = worlds.run(2, _train, config, timeout=120)
    _assert_equal_to_torch(results)
    for r in results:  # each rank runs 2 of the 4 checkpointed blocks, pp_rank 1 for remote callers
        _assert_loaded_horizon_ahead(r["events"], 1, blocks=2)
    if pipeline == "simple":  # all forwards before the backwards: microbatches wait in host memory
        for r in results:
            assert r["offloaded_bytes"] >= 2 * (MICROBATCHES - 2) * (ROWS // MICROBATCHES) * 16 * 4, r
    for r in results:  # what was offloaded left the device: no rank (its runtime) held on to it
        assert r["alive_at_backward"] and not any(r["alive_at_backward"]), r["alive_at_backward"]


def test_tp2_equals_torch(worlds: Any) -> None:
    config = {"tensor_parallel_degree": 2, "ddp": True, "activation_loading_horizon": 2}
    results = worlds.run(2, _train, config, timeout=120)
    _assert_equal_to_torch(results)
    for r in results:
        _assert_loaded_horizon_ahead(r["events"], 2, blocks=4)
