"""Per-request overhead of mp's module server (part of benchmarks/pipeline_vs_torch.py).

A model whose root (on rank 0) scales a small input by a parameter and then calls ``calls`` ``nn.Identity``
modules one after the other. Two placements of the same model, each under ``pipeline_parallel_degree`` 2
and one microbatch:

* ``remote``: the Identity modules on pp_rank 1: every call is a FWD request to rank 1 and its answer,
  and in a training step every call's backward is a BWD request;
* ``local``: everything on pp_rank 0: the same step machinery (module server, step start and end), no
  requests.

The per-call difference is the cost of one request round trip. A forward-only step (``torch.no_grad``)
gives the FWD cost; a training step minus the forward-only step gives the BWD cost. Also measured:
the same model in plain PyTorch (no mp: the cost of a local call and of the step itself), and a raw
round trip of the same tensor on mp's MPI transport and on gloo (what the wire alone costs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _pipeline_runners import idle_barrier
from torch import nn

from mp_pipeline.static import default_record_steps

__all__ = ["Chain", "measure_overhead"]

WIDTH = 16


class Chain(nn.Module):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.calls = nn.ModuleList(nn.Identity() for _ in range(calls))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for layer in self.calls:
            x = layer(x)
        return x.sum()


def _mp_session(
    calls: int, remote: bool, static: bool = False
) -> tuple[Callable[[], None], Callable[[], None]]:
    import mp as smp

    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 1,
            "auto_partition": False,
            "default_partition": 0,
            "static_mode": static,
        }
    )
    net = Chain(calls)
    smp.set_partition(net, 0)
    if remote:
        smp.set_partition(net.calls, 1)
    model = smp.DistributedModel(net)
    x = torch.ones(1, WIDTH)

    @smp.step
    def fwd_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x)
        model.backward(loss)
        return loss  # type: ignore[no-any-return]

    def fwd() -> None:
        with torch.no_grad():
            fwd_step(model, x)

    def train() -> None:
        train_step(model, x)
        model.zero_grad(set_to_none=True)

    return fwd, train


def _plain_session(calls: int, rank: int) -> tuple[Callable[[], None], Callable[[], None]]:
    net = Chain(calls)
    x = torch.ones(1, WIDTH)

    def fwd() -> None:
        if rank == 0:
            with torch.no_grad():
                net(x)

    def train() -> None:
        if rank == 0:
            net(x).backward()
            net.zero_grad(set_to_none=True)

    return fwd, train


def _timed(comm: Any, fn: Callable[[], None], steps: int) -> float:
    idle_barrier(comm)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    idle_barrier(comm)
    return float(comm.bcast((time.perf_counter() - t0) / steps, root=0))


def _repeat(fn: Callable[[], None], n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            fn()

    return run


def _wire_round_trips(comm: Any, world: Any, iters: int) -> dict[str, float]:
    """Round trip (µs) of the Identity's input tensor: mp's MPI transport (a second instance, same
    code as the pipeline's) and gloo send/recv."""
    from mp_comm.transport import MPITransport, TransportConfig

    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    x = torch.ones(1, WIDTH)
    into = torch.empty(1, WIDTH)
    transport = MPITransport(world.mpi_comm, config=TransportConfig(timeout=120.0))

    def mp_transport() -> None:
        if rank == 0:
            transport.send(x, peer, 11)
            transport.recv(peer, 11)
        else:
            transport.send(transport.recv(peer, 11).obj, peer, 11)

    def gloo() -> None:
        if rank == 0:
            dist.send(x, peer)
            dist.recv(into, peer)
        else:
            dist.recv(into, peer)
            dist.send(into, peer)

    out: dict[str, list[float]] = {"mp_mpi_transport": [], "gloo": []}
    for fn in (mp_transport, gloo):  # warm-up
        for _ in range(10):
            fn()
    for _ in range(5):
        for name, fn in (("mp_mpi_transport", mp_transport), ("gloo", gloo)):
            out[name].append(_timed(comm, _repeat(fn, iters), 1) / iters)
    transport.close()
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def measure_overhead(comm: Any, world: Any, *, calls: int, steps: int, reps: int) -> dict[str, Any]:
    """Interleaved repetitions of the three placements; per-call costs in µs (medians over repetitions
    of the paired differences). Collective over both ranks; the result is valid on rank 0."""
    import mp as smp

    rank = comm.Get_rank()
    names = ["remote", "local", "plain", "remote_static"]
    raw: dict[str, dict[str, list[float]]] = {n: {"fwd": [], "train": []} for n in names}
    for rep in range(reps):
        order = names[rep % 4 :] + names[: rep % 4]
        for name in order:
            if name == "plain":
                fwd, train = _plain_session(calls, rank)
            else:
                fwd, train = _mp_session(calls, remote=name != "local", static=name == "remote_static")
            if name == "remote_static":
                # static mode replays only a repeated flow: training steps only, after the recorded ones
                for _ in range(default_record_steps() + 1):
                    train()
                raw[name]["train"].append(_timed(comm, train, steps))
                smp.reset()
                continue
            fwd()  # the first step partitions the model
            train()
            raw[name]["fwd"].append(_timed(comm, fwd, steps))
            raw[name]["train"].append(_timed(comm, train, steps))
            if name != "plain":
                smp.reset()

    def per_call(a: list[float], b: list[float]) -> float:
        return statistics.median((x - y) / calls * 1e6 for x, y in zip(a, b, strict=True))

    rf, rt = raw["remote"]["fwd"], raw["remote"]["train"]
    lf, lt = raw["local"]["fwd"], raw["local"]["train"]
    pf, pt = raw["plain"]["fwd"], raw["plain"]["train"]
    st = raw["remote_static"]["train"]
    remote_bwd = [t - f for t, f in zip(rt, rf, strict=True)]
    local_bwd = [t - f for t, f in zip(lt, lf, strict=True)]
    wire = _wire_round_trips(comm, world, iters=200)
    return {
        "calls_per_step": calls,
        "steps_per_sample": steps,
        "repetitions": reps,
        "tensor": f"float32 (1, {WIDTH})",
        "step_ms": {
            name: {kind: statistics.median(v) * 1e3 for kind, v in d.items() if v} for name, d in raw.items()
        },
        "fwd_bwd_pair_us": per_call(rt, lt),
        "fwd_bwd_pair_static_us": per_call(st, lt),
        "fwd_request_us": per_call(rf, lf),
        "bwd_request_us": per_call(remote_bwd, local_bwd),
        "local_fwd_call_us": statistics.median(f / calls * 1e6 for f in lf),
        "plain_fwd_call_us": statistics.median(f / calls * 1e6 for f in pf),
        "local_bwd_call_us": statistics.median(b / calls * 1e6 for b in local_bwd),
        "plain_bwd_call_us": statistics.median((t - f) / calls * 1e6 for t, f in zip(pt, pf, strict=True)),
        "wire_round_trip_us": wire,
    }
