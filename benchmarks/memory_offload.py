"""Activation offloading: what stays on the device and what it costs, against checkpointing alone.

A GPT-2 (``--layers`` x ``--hidden``, vocab 2048, sequence ``--seq``, ``--batch`` sequences) at pp=2 with
the simple (GPipe) schedule, ``--microbatches`` microbatches, every block checkpointed
(``smp.set_activation_checkpointing``), AdamW; each variant in a fresh ``mpiexec -n 2`` world:

- ``none``: no checkpointing (the bound checkpointing starts from);
- ``ckpt``: every block checkpointed, nothing offloaded (the baseline of the cost);
- ``offload``: the same with ``offload_activations`` and ``activation_loading_horizon`` ``--horizon``.

Per rank: the peak bytes kept for backward on the device (smp.memory_report with trace_memory_usage:
what offloading moved is not counted), the bytes offloaded in a step, on CUDA the peak of
``torch.cuda.max_memory_allocated`` over the timed steps, the peak RSS, and throughput (tokens per
second over the timed steps, the slower rank). On a CPU-only host the "host" copy is a second CPU buffer:
the device columns show what would leave a GPU, the RSS and time show the copies' cost. The trace adds a
Python call per saved tensor to every variant alike (``--no-trace`` times without it, and reports no
activation bytes). Variants run in rotating order ``--repeats`` times; the table gives medians.

Run: ``python -m benchmarks.memory_offload`` (``--quick`` for a smoke run; on a GPU host each rank takes
the GPU of its local rank, or shares one with MP_SHARE_GPUS=1). Results: benchmarks/results/
memory_offload.json and .md (``--name`` another name, e.g. memory_offload_cuda for a GPU run).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._launch import mpiexec, python_command, root_env, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VARIANTS = ["none", "ckpt", "offload"]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import mp as smp

    variant = args.worker
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": args.microbatches,
            "pipeline": "simple",
            "offload_activations": variant == "offload",
            "activation_loading_horizon": args.horizon,
        }
    )
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", smp.local_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=max(1, args.hidden // 64),
        vocab_size=2048,
        n_positions=args.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    net = transformers.GPT2LMHeadModel(config).to(device)
    model = smp.DistributedModel(net, trace_memory_usage=not args.no_trace)
    if variant != "none":
        for block in net.transformer.h:
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (args.batch, args.seq), generator=g).to(device)
    opt.zero_grad()
    train_step(ids)  # partitions, warms up
    opt.step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        opt.zero_grad()
        t0 = time.perf_counter()
        train_step(ids)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    report = smp.memory_report()
    offloader = model._offloader
    row = {
        "variant": variant,
        "rank": smp.rank(),
        "device": str(device),
        "peak_activations_mb": (report.peak_activations or 0) / 2**20,
        "offloaded_mb": (offloader.offloaded_bytes if offloader is not None else 0) / 2**20,
        "device_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times),
    }
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if smp.rank() == 0:
        Path(args.json).write_text(json.dumps(rows))
    smp.shutdown()


def _run(variant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    exe = mpiexec()
    assert exe is not None, "mpiexec not found; install it with `pip install mpich`"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [exe, "-n", "2", *python_command(__file__), "--worker", variant]
        cmd += ["--json", str(out), "--layers", str(args.layers), "--hidden", str(args.hidden)]
        cmd += ["--seq", str(args.seq), "--batch", str(args.batch), "--microbatches", str(args.microbatches)]
        cmd += ["--horizon", str(args.horizon), "--steps", str(args.steps)]
        cmd += ["--no-trace"] if args.no_trace else []
        env = {**root_env(), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, env=env, check=True, capture_output=not args.verbose)
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def _table(results: dict[str, list[list[dict[str, Any]]]], tokens: int) -> str:
    cols = ["peak_activations_mb", "offloaded_mb", "device_peak_mb", "peak_rss_mb"]
    head = " | ".join(f"{c.removesuffix('_mb').replace('_', ' ')} r{r} (MB)" for c in cols for r in (0, 1))
    lines = [f"| variant | {head} | tokens/s | vs ckpt |", "|---|" + "---|" * (2 * len(cols) + 2)]
    speed = {
        v: statistics.median(tokens / max(r["step_s"] for r in rep) for rep in reps)
        for v, reps in results.items()
    }
    for variant, reps in results.items():
        cells = [
            f"{statistics.median(next(r[c] for r in rep if r['rank'] == k) for rep in reps):.1f}"
            for c in cols
            for k in (0, 1)
        ]
        ratio = f"{speed[variant] / speed['ckpt']:.2f}x" if "ckpt" in speed else ""
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {speed[variant]:.0f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--horizon", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--name", default="memory_offload", help="results file name in benchmarks/results")
    args = parser.parse_args()
    if args.worker:
        assert under_mpi()
        _worker(args)
        return
    if args.quick:
        args.layers, args.hidden, args.seq, args.batch, args.microbatches = 4, 64, 32, 8, 4
        args.steps, args.repeats = 1, 1
    results: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for i in range(len(VARIANTS)):
            variant = VARIANTS[(i + rep) % len(VARIANTS)]
            results[variant].append(_run(variant, args))
            print(f"repeat {rep + 1}: {variant} done", file=sys.stderr)
    device = results["ckpt"][0][0]["device"]
    setup = (
        f"GPT-2 {args.layers} layers x {args.hidden}, vocab 2048, seq {args.seq}, batch {args.batch} in "
        f"{args.microbatches} microbatches, pp=2 simple schedule, AdamW, horizon {args.horizon}, on {device} "
        f"({platform.node()}), {args.steps} timed steps, median of {args.repeats} runs"
        + (", untraced" if args.no_trace else "")
        + ". peak activations: bytes kept for backward on the device (memory report); offloaded: bytes "
        "copied to host in a step; device peak: max_memory_allocated (CUDA only)."
    )
    table = _table(results, args.batch * args.seq)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"setup": setup, "results": results}, indent=1))
    (RESULTS / f"{args.name}.md").write_text(f"{setup}\n\n{table}\n")
    print(f"{setup}\n\n{table}")


if __name__ == "__main__":
    main()
