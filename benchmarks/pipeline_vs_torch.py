"""mp's pipeline against torch.distributed.pipelining and single-process training (2 ranks, CPU).

One GPT model (benchmarks/_pipeline_gpt.py: 8 pre-LN blocks, hidden 256, 8 heads, vocab 2048, seq 128,
untied head), one global batch of token ids (16 sequences) and the same initial weights for every
system; the model is split by hand into the same two stages for both pipelines (``front``: embeddings,
blocks 0-3 and block 4's attention on rank 0; ``back``: block 4's MLP, blocks 5-7, final LayerNorm, head
and loss on rank 1: the cut inside block 4 balances the stages, which a cut between blocks 3 and 4 does
not, by about a fifth; ``--whole-blocks`` restores that cut, which the runs before 2026-11-24 used). A
training step is forward, backward and AdamW's step. This hand-cut model is a diagnostic of the
runtime's cost on its best path (one request per microbatch crosses the ranks), not a model as users
write it: a model whose ``forward`` loops over its blocks makes a round trip through pp_rank 0 per
remote block (docs/pipeline.md, Limits). Variants:

* ``single``: one process (rank 0; rank 1 sleeps), no pipeline: the full batch at once with 1 and with
  2 threads, and the batch as ``m`` accumulated microbatches on 1 thread, run stage by stage (front,
  back, back's backward, front's backward) so that the time of each stage is known; and the same
  accumulation on both ranks at once, each training its own copy with no communication (``accumulate,
  both ranks``): the control for how much two processes computing at once slow each other on this host;
* ``mp``: ``smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": ...})`` with the
  ``simple`` (all forwards, then all backwards: GPipe's order) and ``interleaved`` (a ready backward
  first: 1F1B-like) schedules, each also with ``static_mode`` (``simple static``, ``interleaved static``:
  timed after the steps static mode records, MP_PIPELINE_STATIC_STEPS, default 5), and at m = 8 also
  ``interleaved active 5`` (``active_microbatches`` pp + 3 instead of smp's default pp + 2; not one of
  the targets' default-config pairs);
  manual partitioning
  (``smp.set_partition(model.front, 0)``, ``smp.set_partition(model.back, 1)``,
  ``auto_partition: false``); ``@smp.step`` with
  ``model.backward(loss)``; ``smp.DistributedOptimizer``;
* ``torch``: ``torch.distributed.pipelining.PipelineStage`` on ``model.front`` / ``model.back`` (its
  manual stage API: no tracing) with ``ScheduleGPipe`` and ``Schedule1F1B``, the same ``m``, the loss as
  the schedule's ``loss_fn``, gradients averaged over microbatches (``scale_grads``) as mp does.

Every rank runs with one torch thread (OMP_NUM_THREADS=1) and, started by this script, is bound to a
core of its own, as mp-launch binds ranks by default (``mpiexec -bind-to user:0,1``; see _launch.py): the
2 ranks of a pipeline get the 2 cores, one each. The single process with 2 threads runs on both.
Each variant is set up from the initial weights and runs a first step (partitioning, shape inference,
optimizer state; the warm-up) whose loss and gradients are compared with single-process PyTorch on the
same batch (the fairness check). Timing is interleaved at the step level, because the host is shared and
noisy: per repetition and per ``m``, the torch (GPipe, 1F1B) and single-process runners stay alive while
the mp sessions (the two schedules, with and without static mode, and the one with more active
microbatches; only one smp session can exist at a time) run beside them in turn; each such group runs
``--steps`` rounds, a round being one step of every runner in a rotating order. A step is timed between
two barriers that sleep while they wait (MPI's barrier spins and would take a core from the rank still
computing). Ratios are paired within a round (adjacent steps), then the median over rounds is taken.

Pipeline efficiency = ideal / measured step time, with two ideals:

* the bubble bound of the brief: ``T1 / p * (m + p - 1) / m`` where ``T1`` is the single-process step
  on the same ``m`` microbatches (same per-microbatch work) on one core, ``p`` = 2;
* the split bound: ``(m - 1) * max(s0, s1) + s0 + s1 + max(o0, o1)`` from the measured per-microbatch
  stage times ``s`` (forward + backward) and optimizer times ``o`` of the single-process run, i.e. the
  bubble bound for the actual, not perfectly balanced, split.

Both assume each rank has a core to itself. Where the time goes instead is measured too:

* ``StageProbe`` (benchmarks/_pipeline_gpt.py): each stage's compute timed in place by module hooks (the
  same for every system), replayed without communication to separate what the pipeline runtime loses
  (messages, hand-offs, waiting) from compute that ran slower than in the single process (cores shared),
  and each rank's gaps between its consecutive stage operations summed by transition (forward to
  forward, forward to backward, ...), which say where a runtime's idle time sits;
* the CPU each rank spends per step (in all, in its main thread, in mp's MPI progress thread);
* benchmarks/_pipeline_overhead.py: the runtime's cost per call in a training step (a chain of
  ``nn.Identity`` and of small ``nn.Linear`` blocks on one remote rank and alternating between the
  ranks, under the default config and the full path, against torch.distributed.pipelining on the same
  chain) and the raw round trip on mpi4py, mp's transport and gloo. ``--overhead-only`` runs only this
  part and writes it into the saved JSON (``--out``'s or results/) and its markdown.

    python -m benchmarks.pipeline_vs_torch [--reps 3 --steps 2 --micro 4 8 --batch 16]

starts itself under ``mpiexec -n 2`` (or ``mpiexec -n 2 python -m benchmarks.pipeline_vs_torch``).
Writes benchmarks/results/pipeline_vs_torch.json and .md (rank 0; ``--out`` elsewhere). ``--quick`` runs a
small model once and writes to a temporary folder; ``--rerender results/pipeline_vs_torch.json`` rebuilds
the markdown from a saved JSON without running anything.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._launch import relaunch, rotated, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RANKS = 2
LR = 1e-4
SEED = 1234


def _code_state() -> dict[str, Any]:
    """The commit measured and the files under packages/ that differed from it (shared working tree)."""

    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "modified_under_packages": git("status", "--porcelain", "packages").splitlines(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--steps", type=int, default=2, help="rounds (timed steps of each variant) per group")
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="microbatch counts")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--whole-blocks",
        action="store_true",
        help="split between blocks (the runs before 2026-11-24), not inside the middle block",
    )
    parser.add_argument("--calls", type=int, default=32, help="blocks per step (overhead part)")
    parser.add_argument("--overhead-reps", type=int, default=3)
    parser.add_argument(
        "--overhead-steps", type=int, default=5, help="timed steps per variant (overhead part)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small model and one repetition, results in a temporary folder"
    )
    parser.add_argument(
        "--overhead-only",
        action="store_true",
        help="only the per-call overhead: written into the saved JSON and its markdown",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: results/; with --quick a temporary one)",
    )
    parser.add_argument(
        "--rerender",
        type=Path,
        metavar="JSON",
        help="run nothing: rebuild the markdown (and the JSON's derived fields) beside a saved JSON",
    )
    args = parser.parse_args()
    if args.rerender is not None:
        from benchmarks._pipeline_report import rerender

        rerender(args.rerender)
        return
    if not under_mpi():
        sys.exit(relaunch(__file__, RANKS))
    if args.quick:
        args.reps, args.steps, args.layers, args.hidden, args.batch = 1, 1, 4, 128, 8
        args.overhead_reps = 2

    import torch

    from benchmarks._launch import idle_barrier
    from benchmarks._pipeline_gpt import GPT, GPTConfig, analyse, make_batch
    from benchmarks._pipeline_overhead import measure_overhead
    from benchmarks._pipeline_runners import CpuMeter, Runner, make_runner
    from benchmarks._pipeline_variants import BOTH_RANKS, Spec, make_specs, mp_schedules
    from mp_comm.world import init_world

    world = init_world()  # owns torch.distributed's default group; smp.init adopts it
    assert world.mpi_comm is not None, "started by mpiexec: the world has an MPI communicator"
    comm = world.mpi_comm.Dup()
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        hidden=args.hidden, layers=args.layers, split=args.layers // 2, mid_block=not args.whole_blocks
    )
    torch.manual_seed(SEED)
    base = {k: v.clone() for k, v in GPT(cfg).state_dict().items()}
    x, y = make_batch(cfg, args.batch, SEED)
    checksum = float(sum(v.double().sum() for v in base.values()))
    sums = comm.allgather(checksum)
    assert sums[0] == sums[1], f"the ranks built different initial weights: {sums}"
    rank_cpus = comm.gather(sorted(os.sched_getaffinity(0)), root=0)  # where the launcher let each run

    # Reference: single-process loss and gradients of the first step on the full batch.
    ref = GPT(cfg)
    ref.load_state_dict(base)
    ref_loss_t = ref(x, y)
    ref_loss_t.backward()
    ref_loss = float(ref_loss_t.detach())
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    del ref
    n_params = {
        "front": sum(v.numel() for k, v in base.items() if k.startswith("front.")),
        "back": sum(v.numel() for k, v in base.items() if k.startswith("back.")),
    }

    if args.overhead_only:
        out = measure_overhead(
            comm, world, calls=args.calls, steps=args.overhead_steps, reps=args.overhead_reps
        )
        if rank == 0:
            print(json.dumps(out, indent=2))
            saved = (args.out or RESULTS) / "pipeline_vs_torch.json"
            md = saved.with_suffix(".md")
            if saved.exists() and md.exists() and not args.quick:
                from benchmarks._pipeline_report import replace_overhead

                payload = json.loads(saved.read_text())
                payload["overhead"] = out
                saved.write_text(json.dumps(payload, indent=2) + "\n")
                md.write_text(replace_overhead(md.read_text(), out))
        comm.Free()
        return
    specs = make_specs(args.micro)
    records: list[dict[str, Any]] = []
    checks: dict[str, list[dict[str, Any]]] = {s.key: [] for s in specs}
    load = [os.getloadavg()[0]]
    started = time.monotonic()
    meter = CpuMeter()

    def build(spec: Spec) -> Runner:
        runner: Runner = make_runner(spec, cfg=cfg, base=base, x=x, y=y, rank=rank, lr=LR)
        loss, grads = runner.first_step()  # also the warm-up: partitioning, shapes, optimizer state
        if runner.probe is not None:
            runner.probe.take()
        diff = max((float((g - ref_grads[n]).abs().max()) for n, g in grads.items()), default=0.0)
        scale = max((float(ref_grads[n].abs().max()) for n in grads), default=0.0)
        got = comm.gather((loss, diff, scale, len(grads)), root=0)
        if rank == 0:
            first = next(g[0] for g in got if g[0] is not None)
            checks[spec.key].append(
                {
                    "loss": first,
                    "loss_abs_diff": abs(first - ref_loss),
                    "grad_max_abs_diff": max(g[1] for g in got),
                    "grad_max_abs": max(g[2] for g in got),
                    "grads_compared": sum(g[3] for g in got),
                }
            )
        return runner

    def timed(spec: Spec, runner: Runner, group: int, rnd: int) -> None:
        idle_barrier(comm)
        meter.start()
        t0 = time.perf_counter()
        runner.step()
        idle_barrier(comm)
        elapsed = time.perf_counter() - t0
        cpus = comm.gather(asdict(meter.stop()), root=0)
        events = comm.gather(runner.probe.take() if runner.probe is not None else [], root=0)
        # Every rank's stage times: only the single-process control computes on both.
        by_rank = comm.gather({k: v[-1] for k, v in runner.stage_times.items() if v}, root=0)
        if rank == 0:
            stages = by_rank[0]
            pipe = analyse(events) if runner.probe is not None else None
            records.append(
                {
                    "key": spec.key,
                    "group": group,
                    "round": rnd,
                    "step_s": elapsed,
                    "cpu": cpus,
                    "stage_s": stages,
                    "stage_s_by_rank": by_rank,
                    "pipe": pipe,
                }
            )
            print(f"{spec.key:28s} group {group:2d} round {rnd}: {elapsed * 1e3:7.0f} ms", flush=True)

    # A group: one mp session (m, schedule) beside live torch and single-process runners of the same m;
    # rounds run one step of each, in a rotating order, so that every ratio compares adjacent steps.
    group = 0
    for rep in range(args.reps):
        for m in rotated(args.micro, rep):
            others = [
                Spec("torch", "GPipe", m),
                Spec("torch", "1F1B", m),
                Spec("single", "accumulate", m),
                Spec("single", BOTH_RANKS, m),
                Spec("single", "full batch", 1, 1),
            ]
            if m == args.micro[0]:
                others.append(Spec("single", "full batch", 1, 2))
            live = [(spec, build(spec)) for spec in others]
            schedules = mp_schedules(m)
            for schedule in rotated(schedules, rep):
                spec = Spec("mp", schedule, m)
                members = [(spec, build(spec)), *live]
                for rnd in range(args.steps):
                    k = (rnd + group) % len(members)
                    for s, runner in members[k:] + members[:k]:
                        timed(s, runner, group, rnd)
                members[0][1].close()
                del members
                gc.collect()
                group += 1
            for _, runner in live:
                runner.close()
            del live
            gc.collect()
        load.append(os.getloadavg()[0])
    elapsed_main = time.monotonic() - started
    overhead = measure_overhead(
        comm, world, calls=args.calls, steps=args.overhead_steps, reps=args.overhead_reps
    )
    load.append(os.getloadavg()[0])
    if rank == 0:
        from benchmarks._pipeline_report import report

        folder = args.out or (Path(tempfile.mkdtemp(prefix="pipeline_vs_torch_")) if args.quick else RESULTS)
        report(
            args={k: v for k, v in vars(args).items() if k not in ("out", "rerender")},
            cfg=asdict(cfg),
            specs=specs,
            records=records,
            checks=checks,
            ref_loss=ref_loss,
            n_params=n_params,
            overhead=overhead,
            host={
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "rank_cpus": rank_cpus,
                "bound": world.info.bound,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "load_average_1min": load,
                "code": _code_state(),
            },
            elapsed_s=elapsed_main,
            results=folder,
        )
        print(f"wrote {folder / 'pipeline_vs_torch.json'} and .md")
    comm.Free()


if __name__ == "__main__":
    main()
