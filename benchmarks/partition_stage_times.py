"""Predicted against measured stage times of mp's default auto-partition (pp = 2, 2 ranks, CPU).

For the looped GPT and HF GPT-2 of benchmarks/_pipeline_users_models.py, wrapped as users write them
under the default config (``memory_weight`` unset: time balanced), this runs ``--steps`` steps at
``m`` microbatches while the pipeline timeline records, then prints the plan report: each stage's
forward + backward milliseconds per microbatch as the partitioner predicted them from the timed step
(with the remote-call overhead) and as the timeline measured them (busy time, waits cut out).

    python benchmarks/partition_stage_times.py [--models gpt gpt2] [--microbatches 8] [--steps 3]

Writes benchmarks/results/partition_stage_times.md (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import relaunch, under_mpi
from _pipeline_users_models import make_case

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=["gpt", "gpt2"], choices=["gpt", "gpt2", "t5", "cnn"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, RANKS))
    torch.set_num_threads(1)
    sections = [calibrate(args.microbatches, args.steps)]
    sections += [run(name, args.microbatches, args.steps) for name in args.models]
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
        text = "# Predicted and measured stage times (benchmarks/partition_stage_times.py)\n\n" + "\n".join(
            s for s in sections if s is not None
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "partition_stage_times.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
