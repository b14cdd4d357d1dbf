"""Predicted against measured stage times of mp's default auto-partition (pp = 2, 2 ranks, CPU).

For the models of benchmarks/models.py (by default the looped GPT and HF GPT-2; ``cnn`` is the
ResNet-style CNN whose stages are ``nn.Sequential`` containers), wrapped as users write them under the
default config (``memory_weight`` unset: time balanced), this runs ``--steps`` steps at each ``m`` of
``--microbatches`` while the pipeline timeline records, then prints the plan report: each stage's
forward + backward milliseconds per microbatch as the partitioner predicted them from the timed step
(with the remote-call overhead) and as the timeline measured them (busy time, waits cut out).

    python -m benchmarks.partition_stage_times [--models gpt gpt2 cnn] [--microbatches 4 8 16]
        [--steps 3] [--ab 3]

``--ab N`` adds N interleaved rounds of the default plan against the plan mp computed before time
balancing (memory_weight 0.8, module calls, the seed's algorithm; loaded from a partition_file).

Writes benchmarks/results/partition_stage_times.md (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._launch import relaunch, under_mpi
from benchmarks.models import make_case

RANKS = 2


def run(name: str, m: int, steps: int) -> str | None:
    import mp as smp

    case = make_case(name, smoke=False, seed=0)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": m})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(case.build())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(*batch: torch.Tensor) -> torch.Tensor:
            loss = case.user_loss(model, batch)
            model.backward(loss)
            return loss

        train_step(*case.batch)  # partitions: the timed step and the plan happen here
        opt.step()
        opt.zero_grad()
        smp.timeline.start()
        start = time.perf_counter()
        for _ in range(steps):
            train_step(*case.batch)
            opt.step()
            opt.zero_grad()
        step_s = (time.perf_counter() - start) / steps
        smp.timeline.stop()
        plan = model.plan
        if plan is None:
            return None
        return f"## {case.describe}, m = {m}: step {step_s * 1e3:.0f} ms\n\n```\n{plan.report()}```\n"
    finally:
        smp.reset()


class _Calls(torch.nn.Module):
    """A parent whose forward calls ``n`` tiny children in turn: what a remote call costs, alone."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.children_ = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self.children_:
            x = child(x)
        return x


def calibrate(m: int, steps: int, calls: int = 16) -> str:
    """Per remote call (forward and backward request): the busy time of the caller's rank and of the
    callee's, from the timeline, with every child on pp_rank 1 and the parent on pp_rank 0."""
    import mp as smp
    from mp_partition import set_partition

    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": m, "auto_partition": False, "default_partition": 0}
    )
    try:
        torch.manual_seed(0)
        net = _Calls(calls)
        for child in net.children_:
            set_partition(child, 1)
        model = smp.DistributedModel(net)
        x = torch.randn(4 * m, 8)

        @smp.step
        def train_step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            model.backward(loss)
            return loss

        train_step(x)
        smp.timeline.start()
        for _ in range(steps):
            train_step(x)
        timeline = smp.timeline.stop()
        if timeline is None:
            return ""
        caller, callee = (timeline.stage_time_s(r) or 0.0 for r in (0, 1))
        return (
            f"## Remote-call cost, m = {m}: {calls} children of the parent on pp_rank 1\n\n"
            f"caller (pp_rank 0) {caller / calls * 1e3:.3f} ms per call, callee (pp_rank 1) "
            f"{callee / calls * 1e3:.3f} ms per call (busy time per microbatch over calls; compute of a "
            "Linear(8, 8) included)\n"
        )
    finally:
        smp.reset()


def _steps_ms(case: Any, m: int, steps: int, extra: dict[str, Any]) -> tuple[float, dict[str, int]]:
    """Median step time (ms, this rank's clock) of ``steps`` steps after a first, partitioning one."""
    import mp as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, **extra})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(case.build())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(*batch: torch.Tensor) -> torch.Tensor:
            loss = case.user_loss(model, batch)
            model.backward(loss)
            return loss

        times = []
        for i in range(steps + 1):
            start = time.perf_counter()
            train_step(*case.batch)
            opt.step()
            opt.zero_grad()
            if i:
                times.append((time.perf_counter() - start) * 1e3)
        owner = dict(model.placement.assignment)
        split = {k: v for k, v in owner.items() if v and owner.get(k.rpartition(".")[0], 0) != v}
        return statistics.median(times), split
    finally:
        smp.reset()


def compare(name: str, m: int, rounds: int, steps: int) -> str:
    """The default plan against the one mp computed before time balancing (memory_weight 0.8, module
    calls, the seed's algorithm alone: loaded from a partition_file), in interleaved rounds."""
    from mp_partition import Tracer, auto_partition

    case = make_case(name, smoke=False, seed=0)
    torch.manual_seed(0)
    model = case.build()
    with Tracer(model) as tracer:
        case.user_loss(model, tuple(t.chunk(m)[0] for t in case.batch))
    old = auto_partition(model, 2, trace=tracer.result(), memory_weight=0.8)
    path = Path(tempfile.gettempdir()) / f"mp_old_plan_{name}.json"  # same host: rank 0 writes, reads
    if os.environ.get("PMI_RANK", "0") == "0":
        path.write_text(
            json.dumps(
                {"format": "mp-partition/1", "pipeline_parallel_degree": 2, "partition": dict(old.assignment)}
            )
        )
    variants = {
        "time (new default)": {},
        "calls, 0.8 (before)": {"partition_file": str(path), "load_partition": True},
    }
    results: dict[str, list[float]] = {k: [] for k in variants}
    splits: dict[str, dict[str, int]] = {}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for key in order:
            ms, splits[key] = _steps_ms(case, m, steps, variants[key])
            results[key].append(ms)
    new, before = results["time (new default)"], results["calls, 0.8 (before)"]
    ratios = [b / n for b, n in zip(before, new, strict=True)]
    lines = [f"## A/B, {case.describe}, m = {m}: {rounds} interleaved rounds of {steps} steps\n"]
    for key, values in results.items():
        moved = ", ".join(sorted(splits[key])) or "-"
        rounds_ms = ", ".join(f"{v:.0f}" for v in values)
        lines.append(
            f"- {key}: median step {statistics.median(values):.0f} ms (rounds: {rounds_ms}); "
            f"pp_rank 1 holds {moved}"
        )
    lines.append(
        f"- step time before / new, paired per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.3f}\n"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=["gpt", "gpt2"], choices=["gpt", "gpt2", "t5", "cnn"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8], help="values of m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ab", type=int, default=0, help="also compare with the old plan: this many rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, RANKS))
    torch.set_num_threads(1)
    sections = [calibrate(args.microbatches[0], args.steps)]
    sections += [run(name, m, args.steps) for name in args.models for m in args.microbatches]
    if args.ab:
        sections += [compare(name, m, args.ab, args.steps) for name in args.models for m in args.microbatches]
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
        text = "# Predicted and measured stage times (benchmarks/partition_stage_times.py)\n\n" + "\n".join(
            s for s in sections if s is not None
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "partition_stage_times.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
