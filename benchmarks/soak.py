"""Soak: does a long pp=2 x dp=2 job hold its memory, threads and file descriptors flat? (not in CI)

Trains a small MLP through smp on 4 ranks (pipeline_parallel_degree 2, two data-parallel replicas,
4 microbatches, SGD) for ``--steps`` steps, saving a partial checkpoint every ``--checkpoint-every``
steps (keeping the last 2). Every ``--sample-every`` steps each rank samples its resident memory
(RSS, /proc/self/statm), its threads (/proc/self/task) and its open file descriptors (/proc/self/fd).
Growth is measured after the warm-up (``--warmup`` steps: first partitioning, first checkpoint,
allocator pools): (last - first) / first over the samples that follow it, per rank; the target is
< 2% for RSS and none for threads and descriptors.

To tell a leak from the allocator keeping freed memory, each sample also records glibc malloc's own
account (mallinfo2): the bytes in use, and the freed bytes it holds without returning them to the
system; with ``--trim`` the rank then calls ``malloc_trim(0)`` (which returns those free pages) and
samples RSS again (``rss_trimmed_mb``). A leak grows the bytes in use; fragmentation grows the free
bytes held, and trimming takes it back.

Run: ``python -m benchmarks.soak`` (starts itself under ``mpiexec -n 4``; 2,000 steps take a few
minutes on 2 cores); ``--steps 200 --sample-every 10`` for a smoke run. Results go to
benchmarks/results/soak.json and .md, and soak.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._launch import relaunch, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET_RSS_GROWTH = 0.02


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None


LIBC = _libc()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sample(trim: bool) -> dict[str, float]:
    row = {
        "rss_mb": _rss_mb(),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }
    if LIBC is not None:
        info = LIBC.mallinfo2()
        row["malloc_in_use_mb"] = (info.uordblks + info.hblkhd) / 2**20  # heap chunks and mmapped ones
        row["malloc_free_mb"] = info.fordblks / 2**20  # freed, still held by the allocator
        if trim:
            LIBC.malloc_trim(0)
            row["rss_trimmed_mb"] = _rss_mb()
    return row


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
            samples.append({"step": step, "seconds": time.monotonic() - start, **sample(args.trim)})
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


def mb_change(rows: list[dict[str, Any]], key: str, warmup: int) -> float:
    after = [r[key] for r in rows if r["step"] > warmup and key in r]
    return after[-1] - after[0] if len(after) >= 2 else 0.0


def report(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    keys = ("rss_mb", "threads", "fds", "rss_trimmed_mb")
    summary = [
        {
            "rank": rank,
            **{f"{k}_growth": growth(rows, k, args.warmup) for k in keys if rows and k in rows[-1]},
            "rss_mb_change": mb_change(rows, "rss_mb", args.warmup),
            "malloc_in_use_mb_change": mb_change(rows, "malloc_in_use_mb", args.warmup),
            "malloc_free_mb_change": mb_change(rows, "malloc_free_mb", args.warmup),
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
    trimmed = "rss_trimmed_mb_growth" in summary[0]
    lines = [
        f"# Soak: pp=2 x dp=2, {args.steps} steps, checkpoint every {args.checkpoint_every}"
        + (", malloc_trim(0) at each sample" if trimmed else ""),
        "",
        f"Growth after step {args.warmup} (target: RSS < {TARGET_RSS_GROWTH:.0%}, threads and fds 0); "
        "what glibc malloc holds over the same steps: in use, and freed but kept.",
        "",
        "| rank | RSS growth | RSS (MB) | malloc in use (MB) | malloc free, kept (MB) | "
        + ("RSS after trim | " if trimmed else "")
        + "RSS last (MB) | threads | fds |",
        "|---|---|---|---|---|" + ("---|" if trimmed else "") + "---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['rank']} | {s['rss_mb_growth']:+.2%} | {s['rss_mb_change']:+.1f} | "
            f"{s['malloc_in_use_mb_change']:+.1f} | {s['malloc_free_mb_change']:+.1f} | "
            + (f"{s['rss_trimmed_mb_growth']:+.2%} | " if trimmed else "")
            + f"{s['rss_mb_last']:.0f} | {s['threads_growth']:+.0%} | {s['fds_growth']:+.0%} |"
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
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each sample")
    args = parser.parse_args()
    if not under_mpi():
        return relaunch(__file__, 4)
    per_rank = run(args)
    if per_rank is not None:
        report(per_rank, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
