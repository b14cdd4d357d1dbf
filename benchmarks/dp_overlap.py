"""Data parallelism: gradient all-reduces overlapped with the backward vs after it (pp=1, dp=2).

An MLP of ``--layers`` Linear(hidden, hidden) + ReLU layers, trained with SGD through smp on 2 ranks of
one host (pp=1, dp=2, ``--microbatches`` microbatches of a ``--batch`` per-rank batch, float32 CPU,
one torch thread per rank). ``overlapping_allreduce=True`` launches each gradient bucket's all-reduce
(MPI ``Iallreduce``) during the last microbatch's backward as soon as its gradients are final;
``False`` reduces all buckets after the step (blocking ``Allreduce``). Both give bitwise the same
gradients (tests/integration/test_dp_overlap.py).

A step's time is the slowest rank's, from a barrier to the step function's return + optimizer step.
Each repetition builds both variants anew (smp.reset) in alternating order and times ``--steps``
steps after 2 warm-up steps; the ratio is paired within a repetition, median over repetitions. For
scale, the steps that do not reduce at all (``backward_passes_per_step=2``: every other step only
accumulates).

Run: ``python -m benchmarks.dp_overlap`` (starts itself under ``mpiexec -n 2``); ``--quick`` for a
smoke run. Results go to benchmarks/results/dp_overlap.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._launch import relaunch, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def run_variant(args: argparse.Namespace, overlap: bool, bpps: int, comm: Any) -> list[float]:
    """Per-step times (slowest rank) of one freshly built model."""
    import torch
    from torch import nn

    import mp as smp

    smp.init({"microbatches": args.microbatches, "ddp": True})
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = smp.DistributedModel(
        nn.Sequential(*layers),
        overlapping_allreduce=overlap,
        bucket_cap_mb=args.bucket_mb,
        backward_passes_per_step=bpps,
    )
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(1 + smp.dp_rank())
    x = torch.randn(args.batch, args.hidden, generator=gen)

    @smp.step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    times: list[float] = []
    for s in range(2 + args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        train_step(x)
        if (s + 1) % bpps == 0:
            opt.step()
            opt.zero_grad()
        dt = comm.allreduce(time.perf_counter() - t0, op=_mpi_max())
        if s >= 2:
            times.append(dt)
    early = model.replicas.overlap.early if model.replicas.overlap is not None else 0
    smp.reset()
    if overlap and early == 0:
        raise RuntimeError("no bucket was launched during the backward")
    return times


def _mpi_max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, 2))
    if args.quick:
        args.layers, args.hidden, args.batch, args.steps, args.reps = 4, 256, 16, 3, 1

    import torch

    from mp_comm.world import init_world

    world = init_world()  # owns torch.distributed's default group; smp.init adopts it
    assert world.mpi_comm is not None, "started by mpiexec: the world has an MPI communicator"
    comm = world.mpi_comm.Dup()
    torch.set_num_threads(1)

    on: list[float] = []
    off: list[float] = []
    ratios: list[float] = []
    for rep in range(args.reps):
        order = [True, False] if rep % 2 == 0 else [False, True]
        med: dict[bool, float] = {}
        for overlap in order:
            med[overlap] = statistics.median(run_variant(args, overlap, 1, comm))
        on.append(med[True])
        off.append(med[False])
        ratios.append(med[False] / med[True])
    # The reduction's own cost: with backward_passes_per_step=2 every other step does not reduce.
    acc = run_variant(args, False, 2, comm)
    no_reduce = statistics.median(acc[0::2])  # steps 2, 4, ...: no reduction

    if comm.Get_rank() == 0:
        params = args.layers * (args.hidden * args.hidden + args.hidden)
        result = {
            "config": {
                **{k: v for k, v in vars(args).items() if k != "quick"},
                "ranks": 2,
                "pp": 1,
                "dp": 2,
                "params": params,
                "gradient_mb": params * 4 / 2**20,
                "threads_per_rank": 1,
                "host": platform.node(),
                "cpus": __import__("os").cpu_count(),
            },
            "step_s_overlap": on,
            "step_s_after_step": off,
            "step_s_without_reduction": no_reduce,
            "median_step_s_overlap": statistics.median(on),
            "median_step_s_after_step": statistics.median(off),
            "speedup_overlap": statistics.median(ratios),
        }
        if not args.quick:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "dp_overlap.json").write_text(json.dumps(result, indent=2) + "\n")
        cfg = result["config"]
        after_ms, overlap_ms = 1e3 * result["median_step_s_after_step"], 1e3 * result["median_step_s_overlap"]
        lines = [
            "# Data parallelism: all-reduce overlapped with the backward (pp=1, dp=2)",
            "",
            f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}) ({cfg['gradient_mb']:.0f} MB "
            f"of float32 gradients, buckets of {args.bucket_mb:g} MB), per-rank batch {args.batch} in "
            f"{args.microbatches} microbatches, SGD; 2 ranks on one host ({cfg['cpus']} CPUs, "
            "1 torch thread per rank, MPICH). Median step time (slowest rank) of "
            f"{args.steps} steps, {args.reps} repetitions alternating the order.",
            "",
            "| variant | step (ms) |",
            "|---|---|",
            f"| reduction after the step (`overlapping_allreduce=False`) | {after_ms:.1f} |",
            f"| overlapped with the last backward (`overlapping_allreduce=True`) | {overlap_ms:.1f} |",
            f"| no reduction (accumulating step, for reference) | {1e3 * no_reduce:.1f} |",
            "",
            f"after-step / overlapped: {result['speedup_overlap']:.3f}x (paired per repetition, median)",
        ]
        if not args.quick:
            (RESULTS / "dp_overlap.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
