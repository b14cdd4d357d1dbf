"""The full pipeline equivalence grid, with step times against plain PyTorch.

Every model of tests/mp_pipeline/models.py (an MLP, a CNN, the reuse-and-branch model, GPT-2 and T5
from transformers configs) x pp in {1, 2, 4} x microbatches in {1, 2, 4, 8} x both schedules, without
and with data parallelism (2 replicas), plus static and fast mode for pp > 1 at 2 and 8 microbatches
(static: one recorded step, two replayed; fast: one learning step, one recorded, one replayed, with
outputs handed child to child in the last two): 3 optimizer steps, then the losses and every parameter
are compared with plain single-process PyTorch running the same microbatches (fp32, rtol 1e-5, atol
1e-6). Also times a step (median of steps 2-3) against the plain PyTorch step on the same data.

    python -m benchmarks.pipeline_grid            # starts mpiexec -n 2 and -n 4 itself
Writes benchmarks/results/pipeline_grid.{json,md}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def cases(ranks: int) -> list[dict[str, Any]]:
    out = []
    for name in ("mlp", "cnn", "reuse", "gpt2", "t5"):
        for pp in (1, 2, 4):
            if pp > ranks:
                continue
            for mb in (1, 2, 4, 8):
                for sched in ("simple", "interleaved"):
                    if pp == 1 and sched == "interleaved":
                        continue  # one schedule is enough without a pipeline
                    modes = ["dynamic"] + (["static", "fast"] if pp > 1 and mb in {2, 8} else [])
                    for mode in modes:
                        out.append(
                            {
                                # static and fast mode need a flow that is the same in every step: the
                                # reuse model's branch then depends on the row, not the step
                                "name": "reuse_static" if name == "reuse" and mode != "dynamic" else name,
                                "pp": pp,
                                "microbatches": mb,
                                "pipeline": sched,
                                "mode": mode,
                                "ranks": ranks,
                            }
                        )
    return out


def worker(ranks: int) -> None:
    import torch

    import mp as smp
    from mp.model import DistributedModel
    from mp.optimizer import DistributedOptimizer
    from mp.step import step
    from tests.mp_pipeline.models import (
        STEPS,
        batch,
        build,
        first_difference,
        loss_of,
        make_optimizer,
        manual_marks,
        reference,
    )

    rows = []
    os.environ["MP_PIPELINE_STATIC_STEPS"] = "1"  # static mode replays steps 2-3, fast mode step 3
    for case in cases(ranks):
        name, pp, mbs = case["name"], case["pp"], case["microbatches"]
        cfg: dict[str, Any] = {
            "pipeline_parallel_degree": pp,
            "microbatches": mbs,
            "pipeline": case["pipeline"],
            "static_mode": case["mode"] == "static",
            "fast_mode": case["mode"] == "fast",
        }
        if name == "reuse":
            cfg.update(auto_partition=False, default_partition=0)
        smp.init(cfg)
        layers = 4 if pp == 4 else 2
        net = build(name, layers=layers)
        manual_marks(name, net, pp)
        model = DistributedModel(net)
        opt = DistributedOptimizer(make_optimizer(name, model.parameters()))

        @step
        def train_step(*data: torch.Tensor) -> torch.Tensor:
            loss = loss_of(name, model, data)  # noqa: B023 - the step runs within this iteration
            model.backward(loss)  # noqa: B023
            return loss

        losses, times = [], []
        stats: dict[str, int] = {}
        error = None
        try:
            for s in range(STEPS):
                data = batch(name, s, smp.dp_rank())
                smp.barrier()
                t0 = time.perf_counter()
                out = train_step(*data)
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t0)
                losses.append(out.reduce_mean().item())
                if model._runtime is not None:
                    for k, v in model._runtime.last_stats.items():
                        stats[k] = stats.get(k, 0) + v
            got = model.state_dict()
            ref_losses, ref_state = reference(name, microbatches=mbs, replicas=smp.dp_size(), layers=layers)
            diff = first_difference(got, ref_state)
            for s, want in enumerate(ref_losses):
                w = want[smp.dp_rank()]
                if abs(losses[s] - w) > 1e-6 + 1e-5 * abs(w):
                    diff = diff or f"step {s} loss {losses[s]} != {w}"
        except Exception as exc:  # recorded, the grid goes on
            diff = f"{type(exc).__name__}: {exc}"
        # plain PyTorch step on the same replica batch, for the time comparison
        ref = build(name, layers=layers)
        ref_opt = make_optimizer(name, ref.parameters())
        ref_times = []
        for s in range(STEPS):
            data = batch(name, s, 0)
            t0 = time.perf_counter()
            parts = [t.chunk(mbs) for t in data]
            for mb in range(mbs):
                (loss_of(name, ref, tuple(p[mb] for p in parts)) / mbs).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_times.append(time.perf_counter() - t0)
        if smp.rank() == 0:
            print(f"{case} {'equal' if diff is None else diff}", file=sys.stderr, flush=True)
        all_diffs = smp.allgather(diff, smp.WORLD)
        all_stats = smp.allgather(stats, smp.WORLD)
        error = next((f"rank {r}: {d}" for r, d in enumerate(all_diffs) if d), None)
        if smp.rank() == 0:
            rows.append(
                {
                    **case,
                    "dp": smp.dp_size(),
                    "equal": error is None,
                    "first_difference": error,
                    "compact_sent": sum(st.get("compact_sent", 0) for st in all_stats),
                    "shortcuts": sum(st.get("shortcuts", 0) for st in all_stats),
                    "handoffs": sum(st.get("handoffs", 0) for st in all_stats),
                    "step_s": statistics.median(times[1:]) if len(times) > 1 else float("nan"),
                    "plain_step_s": statistics.median(ref_times[1:]),
                }
            )
        smp.reset()
    if rows:
        print("GRID-JSON " + json.dumps(rows), flush=True)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
        return 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    rows: list[dict[str, Any]] = []
    for ranks in (2, 4):
        mpiexec = Path(sys.executable).with_name("mpiexec")
        cmd = [
            str(mpiexec),
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "benchmarks.pipeline_grid",
            "--worker",
            str(ranks),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        found = [line for line in proc.stdout.splitlines() if line.startswith("GRID-JSON ")]
        if proc.returncode != 0 or not found:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        rows += json.loads(found[0][len("GRID-JSON ") :])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_grid.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Pipeline equivalence grid (3 optimizer steps vs plain PyTorch, fp32, rtol 1e-5, atol 1e-6)",
        "",
        f"{sum(r['equal'] for r in rows)} of {len(rows)} configurations equal. "
        "Step times: CPU, 2 cores shared "
        "by all ranks, median of steps 2-3 (noisy; for orientation only).",
        "",
        "Static mode records step 1 and replays steps 2-3 (MP_PIPELINE_STATIC_STEPS=1); fast mode learns "
        "its plan in step 1, records step 2 and replays step 3. *compact*: messages sent compact over all "
        "ranks and steps; *shortcuts*: inputs sent by reference (fast mode); *handoffs*: outputs and "
        "gradients handed straight to the next module's rank (fast mode, steps 2-3).",
        "",
        "| ranks | model | pp | dp | microbatches | schedule | mode | equal | compact | shortcuts | handoffs "
        "| step ms | plain PyTorch ms |",
        "|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        eq = "yes" if r["equal"] else f"NO: {r['first_difference'][:80]}"
        lines.append(
            f"| {r['ranks']} | {r['name']} | {r['pp']} | {r['dp']} | {r['microbatches']} | {r['pipeline']} | "
            f"{r['mode']} | {eq} | {r['compact_sent']} | {r['shortcuts']} | {r['handoffs']} | "
            f"{1000 * r['step_s']:.1f} | "
            f"{1000 * r['plain_step_s']:.1f} |"
        )
    (RESULTS / "pipeline_grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
