"""Soak: does a long pp=2 x dp=2 job hold its memory, threads and file descriptors flat? (not in CI)

Trains a small MLP through smp on 4 ranks (pipeline_parallel_degree 2, two data-parallel replicas,
4 microbatches, SGD) for ``--steps`` steps, saving a partial checkpoint every ``--checkpoint-every``
steps (keeping the last 2). Every ``--sample-every`` steps each rank samples its resident memory
(RSS, /proc/self/statm), its threads (/proc/self/task) and its open file descriptors (/proc/self/fd).
Growth is measured after the warm-up (``--warmup`` steps: first partitioning, first checkpoint,
allocator pools): (last - first) / first over the samples that follow it, per rank; the target is
< 2% for RSS and none for threads and descriptors.

Run: ``python benchmarks/soak.py`` (starts itself under ``mpiexec -n 4``; 2,000 steps take a few
minutes on 2 cores); ``--steps 200 --sample-every 10`` for a smoke run. Results go to
benchmarks/results/soak.json and .md, and soak.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _launch import relaunch, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET_RSS_GROWTH = 0.02


def sample() -> dict[str, float]:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import mp as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True})
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = smp.DistributedModel(nn.Sequential(*layers, nn.Linear(args.hidden, 1)))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    samples: list[dict[str, Any]] = []
    folder = smp.allgather(tempfile.mkdtemp(prefix="mp-soak-") if smp.rank() == 0 else None, smp.WORLD)[0]
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.hidden)
        train(x, x.sum(dim=1, keepdim=True))
        optimizer.step()
        optimizer.zero_grad()
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            smp.save_checkpoint(
                folder,
                f"step{step}",
                partial=True,
                model=model,
                optimizer=optimizer,
                num_kept_partial_checkpoints=2,
            )
        if step % args.sample_every == 0:
            samples.append({"step": step, "seconds": time.monotonic() - start, **sample()})
    gathered = smp.allgather(samples, smp.WORLD)  # also: every rank is past its last save
    if smp.rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        return gathered
    return None


def growth(rows: list[dict[str, Any]], key: str, warmup: int) -> float:
    after = [r[key] for r in rows if r["step"] > warmup]
    if len(after) < 2 or after[0] == 0:
        return 0.0
    return (after[-1] - after[0]) / after[0]


def report(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    summary = [
        {
            "rank": rank,
            **{f"{k}_growth": growth(rows, k, args.warmup) for k in ("rss_mb", "threads", "fds")},
            "rss_mb_last": rows[-1]["rss_mb"] if rows else 0.0,
        }
        for rank, rows in enumerate(per_rank)
    ]
    ok = all(
        s["rss_mb_growth"] < TARGET_RSS_GROWTH and s["threads_growth"] <= 0 and s["fds_growth"] <= 0
        for s in summary
    )
    doc = {
        "args": vars(args),
        "host": platform.node(),
        "samples": per_rank,
        "summary": summary,
        "target_rss_growth": TARGET_RSS_GROWTH,
        "flat": ok,
    }
    (RESULTS / "soak.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"# Soak: pp=2 x dp=2, {args.steps} steps, checkpoint every {args.checkpoint_every}",
        "",
        f"Growth after step {args.warmup} (target: RSS < {TARGET_RSS_GROWTH:.0%}, threads and fds 0).",
        "",
        "| rank | RSS growth | RSS last (MB) | threads growth | fds growth |",
        "|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['rank']} | {s['rss_mb_growth']:+.2%} | {s['rss_mb_last']:.0f} | "
            f"{s['threads_growth']:+.0%} | {s['fds_growth']:+.0%} |"
        )
    lines += ["", f"Flat: {'yes' if ok else 'no'}."]
    (RESULTS / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for rank, rows in enumerate(per_rank):
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes, ("rss_mb", "threads", "fds"), strict=True):
            ax.plot(steps, [r[key] for r in rows], label=f"rank {rank}")
            ax.set_title(key)
            ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if not under_mpi():
        return relaunch(__file__, 4)
    per_rank = run(args)
    if per_rank is not None:
        report(per_rank, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
