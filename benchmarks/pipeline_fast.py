"""Fast mode's child-to-child path: static mode vs fast mode on HF GPT-2 with per-block calls (pp=2).

HF GPT-2 (``--layers`` blocks, hidden ``--hidden``, sequence ``--seq``, vocab 2048) built from a config,
trained with SGD through smp on 2 ranks of one host (pp=2, ``--microbatches`` microbatches of a
``--batch`` batch, float32 CPU, one torch thread per rank). The automatic partition puts the second
half of the blocks (and the head) on rank 1; the model's own forward runs on rank 0 and calls those
blocks one after another, so under static mode every block's hidden state goes rank 1 -> rank 0 ->
rank 1, and its gradient the same way back. Both variants replay compact messages after their recorded
steps; fast mode, from its second step on, keeps each hidden state that the parent only passes on to
the next block on rank 1 (the parent holds a placeholder) and its gradient there too (seed 001 §4.4).

A step's time is the slowest rank's, from a barrier to the optimizer step. Each repetition builds both
variants anew (smp.reset) in alternating order and times ``--steps`` replayed steps after the recorded
ones; the ratio is paired within a repetition, median over repetitions. Reported with it: the tensor
bytes the pipeline's messages moved per step (all ranks, measured by the module servers), tensors sent
by reference and handed off per step, and the losses of both variants (they must agree: fast mode
changes where a tensor comes from, not its value).

Run: ``python -m benchmarks.pipeline_fast`` (starts itself under ``mpiexec -n 2``); ``--quick`` for a
smoke run. Results go to benchmarks/results/pipeline_fast.json and .md. ``--pp 4`` runs the same on 4
ranks (pp=4; the blocks spread over ranks 1-3 as well, so hidden states also go from rank to rank
without passing rank 0), into pipeline_fast_pp4.json and .md; with 4 ranks on 2 cores its times say
little, its bytes are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._launch import relaunch, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RECORD_STEPS = 2


def run_variant(args: argparse.Namespace, fast: bool, comm: Any) -> dict[str, Any]:
    """Step times (slowest rank), losses and shortcut counts of one freshly built model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import mp as smp

    smp.init(
        {
            "pipeline_parallel_degree": args.pp,
            "microbatches": args.microbatches,
            "pipeline": "interleaved",
            "static_mode": True,
            "fast_mode": fast,
        }
    )
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=2048,
        n_positions=args.seq,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    model = smp.DistributedModel(GPT2LMHeadModel(config))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (args.batch, args.seq), generator=gen)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    times, losses, shortcuts, handoffs, moved = [], [], [], [], []
    # fast mode learns its plan in a step of its own before recording: time both from the same step on
    warm = RECORD_STEPS + 1
    for s in range(warm + args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        out = train_step(ids)
        opt.step()
        opt.zero_grad()
        elapsed = comm.allreduce(time.perf_counter() - t0, op=_max())
        losses.append(out.reduce_mean().item())
        assert model._runtime is not None
        if s >= warm:
            stats = model._runtime.last_stats
            times.append(elapsed)
            shortcuts.append(comm.allreduce(stats["shortcuts"]))
            handoffs.append(comm.allreduce(stats["handoffs"]))
            moved.append(comm.allreduce(stats["tensor_bytes"]))
    mine = sum(1 for name, _ in model.local_named_modules() if name.count(".") == 2 and ".h." in name)
    blocks = comm.allgather(mine)
    smp.reset()
    return {
        "times": times,
        "losses": losses,
        "shortcuts": shortcuts,
        "handoffs": handoffs,
        "moved": moved,
        "blocks_per_rank": blocks,
    }


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2, help="pipeline degree = ranks")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.seq, args.steps, args.reps = 4, 64, 32, 2, 2
    if not under_mpi():
        sys.exit(relaunch(__file__, args.pp))
    os.environ["MP_PIPELINE_STATIC_STEPS"] = str(RECORD_STEPS)
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    runs: dict[str, list[dict[str, Any]]] = {"static": [], "fast": []}
    started = time.monotonic()
    for rep in range(args.reps):
        order = ["static", "fast"] if rep % 2 == 0 else ["fast", "static"]
        for name in order:
            runs[name].append(run_variant(args, name == "fast", comm))
    if comm.Get_rank() == 0:
        _report(args, runs, time.monotonic() - started)


def _report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], elapsed: float) -> None:
    med = {k: statistics.median(t for r in v for t in r["times"]) for k, v in runs.items()}
    ratios = [
        statistics.median(s["times"]) / statistics.median(f["times"])
        for s, f in zip(runs["static"], runs["fast"], strict=True)
    ]
    per_step = statistics.median(n for r in runs["fast"] for n in r["shortcuts"])
    static_shortcuts = max(n for r in runs["static"] for n in r["shortcuts"])
    handed = statistics.median(n for r in runs["fast"] for n in r["handoffs"])
    moved = {k: statistics.median(n for r in v for n in r["moved"]) for k, v in runs.items()}
    loss_diff = max(
        abs(a - b)
        for s, f in zip(runs["static"], runs["fast"], strict=True)
        for a, b in zip(s["losses"], f["losses"], strict=True)
    )
    samples = {k: args.batch / v for k, v in med.items()}
    payload = {
        "benchmark": "pipeline_fast",
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "seq": args.seq,
            "batch": args.batch,
            "microbatches": args.microbatches,
            "pp": args.pp,
            "blocks_per_rank": runs["fast"][0]["blocks_per_rank"],
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_1min": os.getloadavg()[0],
        },
        "repetitions": args.reps,
        "replayed_steps_per_rep": args.steps,
        "elapsed_s": elapsed,
        "median_step_s": med,
        "samples_per_s": samples,
        "fast_over_static_throughput": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "shortcuts_per_step": per_step,
        "static_mode_shortcuts": static_shortcuts,
        "handoffs_per_step": handed,
        "tensor_bytes_per_step": moved,
        "fast_over_static_bytes": moved["fast"] / moved["static"],
        "max_abs_loss_difference": loss_diff,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = "pipeline_fast" if args.pp == 2 else f"pipeline_fast_pp{args.pp}"
    command = "" if args.pp == 2 else f" --pp {args.pp} --reps {args.reps}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        f"# pipeline_fast: static mode vs fast mode (child-to-child path), HF GPT-2, pp={args.pp}, CPU",
        "",
        f"GPT-2 with {args.layers} blocks (hidden {args.hidden}, sequence {args.seq}, vocab 2048), batch "
        f"{args.batch} in {args.microbatches} microbatches, interleaved schedule; the automatic partition "
        f"put {payload['model']['blocks_per_rank']} blocks on ranks 0-{args.pp - 1}, called one after "
        "another from rank 0. "
        f"{args.reps} repetitions x {args.steps} replayed steps per variant (after {RECORD_STEPS} "
        "recorded, and fast mode's learning step); "
        f"host: {os.cpu_count()} CPUs, 1-minute load {payload['host']['load_1min']:.1f} at the end. "
        f"`python -m benchmarks.pipeline_fast{command}` regenerates this file.",
        "",
        "| mode | ms/step | samples/s | tensor MiB moved per step | by reference | handed off |",
        "|---|---:|---:|---:|---:|---:|",
        f"| static | {1000 * med['static']:.0f} | {samples['static']:.2f} | {moved['static'] / 2**20:.1f} | "
        f"{static_shortcuts} | 0 |",
        f"| fast | {1000 * med['fast']:.0f} | {samples['fast']:.2f} | {moved['fast'] / 2**20:.1f} | "
        f"{per_step:g} | {handed:g} |",
        "",
        f"Fast over static throughput: **{statistics.median(ratios):.2f}x** (paired per repetition; range "
        f"{min(ratios):.2f}-{max(ratios):.2f}x). Tensor bytes moved per step, fast over static: "
        f"**{moved['fast'] / moved['static']:.2f}x**. Largest loss difference between the variants: "
        f"{loss_diff:.1e}.",
        "",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
