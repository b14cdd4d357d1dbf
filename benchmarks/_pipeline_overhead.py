"""Per-call overhead of mp's pipeline runtime (part of benchmarks/pipeline_vs_torch.py).

A model whose root (on pp_rank 0) scales a small float32 (1, 16) input by a parameter, calls ``calls``
blocks one after the other and takes the sum of squares as the loss. Two kinds of block: ``nn.Identity``
(the runtime's cost alone) and ``nn.Linear(16, 16)`` (a small module with parameters, as a user's model
has). Two placements
under ``pipeline_parallel_degree`` 2 and one microbatch:

* ``remote``: every block on pp_rank 1 (a chain of calls that stays on one remote rank);
* ``alternating``: block ``i`` on pp_rank ``i % 2`` (every call crosses to the other rank);

each timed under mp's default config (``default``: fast mode, posted calls) and the full path
(``full``: ``"fast_mode": false``, a request and a response per call and per backward), against the same
model with every block on pp_rank 0 (``local``: the same step machinery, no requests) and in plain
PyTorch (``plain``, rank 0 alone). The cost per call in a training step (forward + backward) is
(step − local step) / calls for mp and (step − plain step) / calls for torch.distributed.pipelining on the
same chain and the same cut (``remote``: stage 0 the scaling, stage 1 the chain, ScheduleGPipe;
``alternating``: stage ``i`` = block ``i`` (stage 0 with the scaling) on rank ``i % 2``, ScheduleLoopedBFS,
the sum as the loss). Also measured, in every repetition between the chain's variants: the raw round
trip of the same tensor between the two ranks on mpi4py (the floor), on mp's MPI transport and on gloo,
and of a header-only message (a small control tuple, no tensor) on mp's transport; one way is half of
it.

Every variant's first step checks the scale parameter's gradient against plain PyTorch. Variants are
interleaved: each repetition runs every variant once, in a rotating order.

After the repetitions, one step of ``remote default`` is recorded per kind of block (``smp.timeline``
around one step after the warm-up, with the runtime's call paths timed) and reduced to where a call's
time goes (:func:`chain_split`): pp_rank 0's forward path per call (its Python: the guard and posting
the call), the owner's spacing between consecutive forwards and one forward's execution, pp_rank 0's
backward path per call and the owner's backward of the run.

``device="cuda"`` puts the chain, its input and every variant on each rank's GPU (torch's stages then
send through host memory when the ranks share a GPU under gloo, as mp's MPI route does); the raw round
trips then send the CUDA tensor on mp's transport and gloo (staged by hand), mpi4py its host copy.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._launch import idle_barrier, stage_cuda_p2p_through_host

__all__ = ["BLOCKS", "PLACEMENTS", "Chain", "chain_split", "measure_overhead"]

WIDTH = 16
BLOCKS = ("identity", "linear")
PLACEMENTS = ("remote", "alternating")
MP_VARIANTS = ("local", "remote default", "remote full", "alternating default", "alternating full")
TORCH_VARIANTS = ("torch remote", "torch alternating")
WARMUP = 8
"""Steps before timing: fast mode learns in the first step and posts calls from the next ones."""
WIRE_ITERS = 200
"""Round trips per timed sample of a raw message."""
WIRE_SAMPLES = 3
"""Samples of every raw message per repetition (between the repetition's chain variants)."""


def _block(kind: str) -> nn.Module:
    return nn.Identity() if kind == "identity" else nn.Linear(WIDTH, WIDTH)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Chain(nn.Module):
    def __init__(self, calls: int, kind: str, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every variant
        self.head = Scale()
        self.calls = nn.ModuleList(_block(kind) for _ in range(calls))
        self.to(_device(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for layer in self.calls:
            x = layer(x)
        return _loss(x)


def _device(device: str) -> torch.device:
    """``device`` as this rank's: "cuda" is the GPU the world chose for it (local_rank % GPUs)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def _owner(placement: str, i: int) -> int:
    if placement == "local":
        return 0
    return 1 if placement == "remote" else i % 2


Session = tuple[Callable[[], None], Callable[[], torch.Tensor | None], Callable[[], None]]
"""(one training step, the scale parameter's gradient after the last step or None off rank 0, close)."""


def _mp_session(calls: int, kind: str, placement: str, fast: bool, device: str = "cpu") -> Session:
    import mp as smp

    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 1,
            "auto_partition": False,
            "default_partition": 0,
            "fast_mode": fast,
        }
    )
    net = Chain(calls, kind, device)
    smp.set_partition(net, 0)
    for i, block in enumerate(net.calls):
        smp.set_partition(block, _owner(placement, i))
    model = smp.DistributedModel(net)
    x = torch.ones(1, WIDTH, device=_device(device))

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x)
        model.backward(loss)
        return loss  # type: ignore[no-any-return]

    def train() -> None:
        model.zero_grad(set_to_none=True)
        train_step(model, x)

    def grad() -> torch.Tensor | None:
        g = net.head.scale.grad
        return None if g is None else g.detach().clone()

    return train, grad, smp.reset


def _plain_session(calls: int, kind: str, rank: int, device: str = "cpu") -> Session:
    net = Chain(calls, kind, device)
    x = torch.ones(1, WIDTH, device=_device(device))

    def train() -> None:
        if rank == 0:
            net.zero_grad(set_to_none=True)
            net(x).backward()

    def grad() -> torch.Tensor | None:
        g = net.head.scale.grad
        return None if g is None or rank != 0 else g.detach().clone()

    return train, grad, lambda: None


class _Stage(nn.Module):
    def __init__(self, head: nn.Module | None, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.head = head
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            x = self.head(x)
        for block in self.blocks:
            x = block(x)
        # a view, so that a stage of Identity blocks does not return its received input itself: torch
        # 2.11's stage then found no gradient for that input ("[1] for chunk 0 has gradients None" on the
        # H200 machine's torch, CPU and CUDA alike); 2.13 accepts either. One view per stage, no copy.
        return x.view_as(x)


def _loss(x: torch.Tensor) -> torch.Tensor:
    # not x.sum(): its gradient is an expanded (stride 0) tensor, which torch's pipelining cannot receive
    return (x * x).sum()


def _sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return _loss(output)


def _torch_session(calls: int, kind: str, placement: str, rank: int, device: str = "cpu") -> Session:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

    net = Chain(calls, kind, device)
    where = _device(device)  # the stages' device
    if where.type == "cuda":
        stage_cuda_p2p_through_host()
    stages: list[Any]
    if placement == "remote":
        module = _Stage(net.head, []) if rank == 0 else _Stage(None, list(net.calls))
        stages = [PipelineStage(module, rank, 2, where)]
        schedule: Any = ScheduleGPipe(stages[0], 1, loss_fn=_sum_loss)
    else:
        mine = [i for i in range(calls) if i % 2 == rank]
        modules = [_Stage(net.head if i == 0 else None, [net.calls[i]]) for i in mine]
        stages = [PipelineStage(m, i, calls, where) for m, i in zip(modules, mine, strict=True)]
        schedule = ScheduleLoopedBFS(stages, 1, loss_fn=_sum_loss)
    last = 1 if placement == "remote" else (calls - 1) % 2
    x = torch.ones(1, WIDTH, device=where)
    target = torch.zeros(1, device=where)

    def train() -> None:
        net.zero_grad(set_to_none=True)
        if rank == 0 and rank == last:
            schedule.step(x, target=target)
        elif rank == 0:
            schedule.step(x)
        elif rank == last:
            schedule.step(target=target)
        else:
            schedule.step()

    def grad() -> torch.Tensor | None:
        g = net.head.scale.grad
        return None if g is None or rank != 0 else g.detach().clone()

    return train, grad, lambda: None


def chain_split(timeline: Any, calls: int) -> dict[str, float | None]:
    """One recorded step of the ``remote`` chain (an mp_pipeline Timeline with the call paths of
    benchmarks._pipeline_where.recording_mp; pp_rank 0 = rank 0, the owner rank 1) in µs: pp_rank 0's
    forward and backward path per call (``Remote.call`` and ``Link.backward``, less where the thread was
    parked or receiving; their mean), the owner's median spacing between consecutive forward executions
    and their median length, and the owner's backward executions (their number, and their total over
    ``calls``). None where the step recorded no such event."""
    from benchmarks._pipeline_where import call_paths
    from mp_pipeline.timeline import EventKind

    us = 1e-3
    paths = call_paths(timeline, 0)

    def path(what: str) -> float | None:
        times = [sum(b - a for a, b in segs) for e, segs in paths if e.module == what]
        return statistics.fmean(times) * us if times else None

    own_f = sorted(timeline.select(EventKind.FWD, rank=1), key=lambda e: e.start_ns)
    own_b = timeline.select(EventKind.BWD, rank=1)
    return {
        "pp_rank0_forward_per_call": path("Remote.call"),
        "owner_forward_spacing": statistics.median(
            (b.start_ns - a.start_ns) * us for a, b in itertools.pairwise(own_f)
        )
        if len(own_f) > 1
        else None,
        "owner_forward_execution": statistics.median(e.duration_ns * us for e in own_f) if own_f else None,
        "pp_rank0_backward_per_call": path("Link.backward"),
        "owner_backward_executions": float(len(own_b)),
        "owner_backward_per_call": sum(e.duration_ns for e in own_b) * us / calls if own_b else None,
    }


def _recorded_chain(comm: Any, calls: int, kind: str, device: str) -> dict[str, float | None] | None:
    """One recorded step of ``remote default`` after the warm-up, reduced by :func:`chain_split` (on rank
    0; None elsewhere)."""
    import mp as smp
    from benchmarks._pipeline_where import recording_mp
    from mp_pipeline.timeline import RECORDER

    train, _, close = _mp_session(calls, kind, "remote", True, device)
    try:
        for _ in range(WARMUP):
            train()
        idle_barrier(comm)
        smp.timeline.start()
        with recording_mp(RECORDER, comm.Get_rank()):
            train()
        timeline = smp.timeline.stop()
    finally:
        close()
    return None if timeline is None else chain_split(timeline, calls)


def _timed(comm: Any, fn: Callable[[], None], steps: int) -> float:
    idle_barrier(comm)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
    idle_barrier(comm)
    return float(comm.bcast((time.perf_counter() - t0) / steps, root=0))


def _repeat(fn: Callable[[], None], n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            fn()

    return run


WIRE_VARIANTS = ("mpi4py", "mp_mpi_transport", "mp_mpi_transport_header", "gloo")
"""The raw messages timed beside the chain: the tensor on mpi4py (the floor), on mp's MPI transport and on
gloo, and a header-only message (a pipeline-sized control tuple, no tensor) on mp's transport."""


class _Wire:
    """Round trips (µs) between the two ranks of the chain's input tensor: mpi4py on its (host) buffer,
    mp's MPI transport (a second instance, the pipeline's code) and gloo send/recv (a CUDA tensor staged by
    hand), and a header-only message on mp's transport. Made once; `sample` times every variant once, in
    a rotating order, so that the raw messages interleave with the chain's variants."""

    def __init__(self, comm: Any, world: Any, device: str = "cpu") -> None:
        from mp_comm.transport import MPITransport, TransportConfig

        self.comm = comm
        rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
        x = torch.ones(1, WIDTH, device=_device(device))
        into = torch.empty(1, WIDTH)
        raw = torch.ones(1, WIDTH).numpy()
        control = ("fwd", 3, (0, 7))  # the size of a pipeline's control message: a kind, a call, an id
        transport = self.transport = MPITransport(
            world.mpi_comm, config=TransportConfig(timeout=120.0).for_world(world)
        )

        def mpi4py() -> None:
            if rank == 0:
                comm.Send(raw, peer, 7)
                comm.Recv(raw, peer, 7)
            else:
                comm.Recv(raw, peer, 7)
                comm.Send(raw, peer, 7)

        def mp_transport(obj: object) -> Callable[[], None]:
            def run() -> None:
                if rank == 0:
                    transport.send(obj, peer, 11)
                    transport.recv(peer, 11)
                else:
                    transport.send(transport.recv(peer, 11).obj, peer, 11)

            return run

        def gloo() -> None:
            if rank == 0:
                dist.send(x.cpu(), peer)
                dist.recv(into, peer)
                x.copy_(into)
            else:
                dist.recv(into, peer)
                x.copy_(into)
                dist.send(x.cpu(), peer)

        self.fns: dict[str, Callable[[], None]] = {
            "mpi4py": mpi4py,
            "mp_mpi_transport": mp_transport(x),
            "mp_mpi_transport_header": mp_transport(control),
            "gloo": gloo,
        }
        self.samples: dict[str, list[float]] = {name: [] for name in self.fns}
        for fn in self.fns.values():  # warm-up
            for _ in range(10):
                fn()

    def sample(self, iters: int, rotate: int) -> None:
        names = list(self.fns)
        names = names[rotate % len(names) :] + names[: rotate % len(names)]
        for name in names:
            self.samples[name].append(_timed(self.comm, _repeat(self.fns[name], iters), 1) / iters)

    def close(self) -> dict[str, float]:
        """Median round trip per variant, µs."""
        self.transport.close()
        return {k: statistics.median(v) * 1e6 for k, v in self.samples.items()}


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a - b).abs().max())


def measure_overhead(
    comm: Any,
    world: Any,
    *,
    calls: int,
    steps: int,
    reps: int,
    device: str = "cpu",
    torch_variants: bool = True,
) -> dict[str, Any]:
    """Interleaved repetitions of every variant; per-call costs in µs (medians over repetitions of the
    paired differences). Collective over both ranks; the result is valid on rank 0."""
    rank = comm.Get_rank()
    names = ["plain", *MP_VARIANTS, *(TORCH_VARIANTS if torch_variants else ())]
    step_s: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in BLOCKS}
    grad_diff: dict[str, dict[str, float]] = {k: {} for k in BLOCKS}
    loads: list[float] = []
    import os

    wire = _Wire(comm, world, device)
    for rep in range(reps):
        loads.append(os.getloadavg()[0])
        for _ in range(WIRE_SAMPLES):
            wire.sample(WIRE_ITERS, rep)
        for kind in BLOCKS:
            order = names[rep % len(names) :] + names[: rep % len(names)]
            reference: torch.Tensor | None = None
            for name in order:
                if name == "plain":
                    train, grad, close = _plain_session(calls, kind, rank, device)
                elif name.startswith("torch"):
                    train, grad, close = _torch_session(calls, kind, name.split()[1], rank, device)
                else:
                    placement, _, path = name.partition(" ")
                    train, grad, close = _mp_session(calls, kind, placement, path != "full", device)
                for _ in range(WARMUP):
                    train()
                step_s[kind][name].append(_timed(comm, train, steps))
                g = grad()
                if name == "plain":
                    reference = g
                elif rank == 0 and reference is not None:
                    diff = _max_diff(g, reference)
                    if diff is not None:
                        grad_diff[kind][name] = max(grad_diff[kind].get(name, 0.0), diff)
                close()
    loads.append(os.getloadavg()[0])
    recorded = {kind: _recorded_chain(comm, calls, kind, device) for kind in BLOCKS}

    def per_call(kind: str, name: str, base: str) -> float:
        a, b = step_s[kind][name], step_s[kind][base]
        return statistics.median((x - y) / calls * 1e6 for x, y in zip(a, b, strict=True))

    per_call_us = {
        kind: {
            name: per_call(kind, name, "plain" if name.startswith("torch") or name == "local" else "local")
            for name in names
            if name != "plain"
        }
        for kind in BLOCKS
    }
    wire_us = wire.close()
    out = {
        "version": 2,
        "calls_per_step": calls,
        "steps_per_sample": steps,
        "repetitions": reps,
        "tensor": f"float32 (1, {WIDTH})",
        "step_ms": {
            kind: {name: statistics.median(v) * 1e3 for name, v in d.items()} for kind, d in step_s.items()
        },
        "per_call_us": per_call_us,
        "scale_grad_max_abs_diff": grad_diff,
        "wire_round_trip_us": wire_us,
        "wire_samples": WIRE_SAMPLES * reps,
        "load_average_1min": loads,
    }
    out["recorded_remote_default_us"] = recorded  # (None off rank 0)
    if device != "cpu":
        out["device"] = torch.cuda.get_device_name() if device == "cuda" else device
    return out
