"""Collectives benchmark: mp's autograd-aware collectives against raw gloo (the peer) and raw MPI.

Times all-reduce, all-gather, reduce-scatter and all-to-all of float32 CPU tensors, 1 KB to 64 MB, on 2
and 4 ranks of one host. Variants, interleaved in one run:

* ``mp``     - ``mp_comm.collectives`` (``all_reduce``, ``all_gather(dim=0)``, ``reduce_scatter(dim=0)``,
  ``all_to_all(0, 0)``) on a group made by ``World.new_groups`` (the whole world): CPU tensors go over
  the group's MPI twin (MPICH through mpi4py), a fresh output per call, as the functional,
  autograd-aware API returns one (the forward path; the inputs do not require grad);
* ``gloo``   - the raw ``torch.distributed`` call on the same group into preallocated buffers (all-reduce
  in place, ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``): the peer;
* ``mpi4py`` - MPI's ``Allreduce`` (in place), ``Allgather``, ``Reduce_scatter_block``, ``Alltoall`` on
  numpy views of preallocated buffers: the other raw path (MPICH, the launcher's MPI).

Size is the largest buffer of the operation, as in nccl-tests: the tensor (all-reduce), the gathered
output (all-gather), the input that is reduced and scattered (reduce-scatter), the send buffer
(all-to-all). GB/s is algorithm bandwidth: size / time of one call, the time being the slowest rank's.
Each cell is the median over repetitions of the mean time of a batch of calls; ratios are paired within
a repetition (the variants ran seconds apart), median over repetitions. Results go to
benchmarks/results/comm_collectives.json and .md.

Run: ``python -m benchmarks.comm_collectives`` (starts itself under ``mpiexec -n 2`` and ``-n 4``), or
``mpiexec -n N python -m benchmarks.comm_collectives`` for one world size. Options: ``--quick`` (fewer
sizes and repetitions), ``--reps N``, ``--ranks 2,4``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._launch import mpiexec as find_mpiexec
from benchmarks._launch import python_command, root_env, rotated, sweep_parser, under_mpi

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
KB = 1024
MB = KB * KB
SIZES = [KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [KB, 64 * KB, MB, 16 * MB]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
VARIANTS = ["mp", "gloo", "mpi4py"]
RAW = ["gloo", "mpi4py"]


def _iterations(nbytes: int) -> int:
    if nbytes <= 64 * KB:
        return 40
    if nbytes <= MB:
        return 12
    if nbytes <= 16 * MB:
        return 3
    return 2


def main() -> None:
    parser = sweep_parser(__doc__)
    parser.add_argument("--ranks", default="2,4", help="world sizes to run, comma-separated")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child writes its samples here
    args = parser.parse_args()
    if under_mpi():
        part = _measure(args)
        if part is None:  # not rank 0
            return
        if args.part:
            Path(args.part).write_text(json.dumps(part))
        else:
            _report([part])
        return
    sys.exit(_launch(args))


def _launch(args: argparse.Namespace) -> int:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print("mpiexec not found; install it with `pip install mpich`", file=sys.stderr)
        return 2
    env = root_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(r) for r in args.ranks.split(",")):
            out = Path(tmp) / f"part{n}.json"
            cmd = [mpiexec, "-n", str(n), *python_command(__file__), "--part", str(out)]
            if args.quick:
                cmd.append("--quick")
            if args.reps:
                cmd += ["--reps", str(args.reps)]
            rc = subprocess.call(cmd, env=env)
            if rc != 0:
                print(f"the {n}-rank run failed with exit status {rc}", file=sys.stderr)
                return rc
            parts.append(json.loads(out.read_text()))
    _report(parts)
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from mp_comm import collectives as C
    from mp_comm.world import init_world

    world = init_world()
    rank, size = world.rank, world.size
    mpi = world.mpi_comm.Dup()
    from mpi4py import MPI

    group = world.new_groups([list(range(size))])[0]  # with its MPI twin, as smp's groups
    assert group is not None
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    sizes = QUICK_SIZES if args.quick else SIZES
    reps = args.reps or (2 if args.quick else 7)

    def floats(nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes // 4, dtype=torch.float32)  # zeros: sums stay finite however often

    def repeat(call: Callable[[], object]) -> Callable[[int], None]:
        def run(k: int) -> None:
            for _ in range(k):
                call()

        return run

    def bench(op: str, nbytes: int) -> dict[str, Callable[[int], None]]:
        """The three variants of `op` at `nbytes`, on buffers made once (outside the timing)."""
        if op == "all_reduce":
            x, buf = floats(nbytes), floats(nbytes)
            xb = buf.numpy()
            return {
                "mp": repeat(lambda: C.all_reduce(x, group)),
                "gloo": repeat(lambda: dist.all_reduce(buf, group=group)),
                "mpi4py": repeat(lambda: mpi.Allreduce(MPI.IN_PLACE, xb)),
            }
        if op == "all_gather":  # each rank contributes size / n
            x, out = floats(nbytes // size), floats(nbytes)
            xn, on = x.numpy(), out.numpy()
            return {
                "mp": repeat(lambda: C.all_gather(x, 0, group)),
                "gloo": repeat(lambda: all_gather_single(out, x, group=group)),
                "mpi4py": repeat(lambda: mpi.Allgather(xn, on)),
            }
        if op == "reduce_scatter":  # each rank keeps size / n of the sum
            x, out = floats(nbytes), floats(nbytes // size)
            xn, on = x.numpy(), out.numpy()
            return {
                "mp": repeat(lambda: C.reduce_scatter(x, 0, group)),
                "gloo": repeat(lambda: reduce_scatter_single(out, x, group=group)),
                "mpi4py": repeat(lambda: mpi.Reduce_scatter_block(xn, on, op=MPI.SUM)),
            }
        assert op == "all_to_all"
        x, out = floats(nbytes), floats(nbytes)
        xn, on = x.numpy(), out.numpy()
        return {
            "mp": repeat(lambda: C.all_to_all(x, 0, 0, group)),
            "gloo": repeat(lambda: dist.all_to_all_single(out, x, group=group)),
            "mpi4py": repeat(lambda: mpi.Alltoall(xn, on)),
        }

    # Correctness first: our collectives give what the raw calls give (on non-trivial data).
    probe = torch.arange(4 * size, dtype=torch.float32) + rank
    expect = probe.clone()
    dist.all_reduce(expect, group=group)
    assert torch.equal(C.all_reduce(probe, group), expect), "all_reduce disagrees with gloo"
    gathered = torch.empty(4 * size * size)
    all_gather_single(gathered, probe, group=group)
    assert torch.equal(C.all_gather(probe, 0, group), gathered), "all_gather disagrees with gloo"
    scattered = torch.empty(4)
    reduce_scatter_single(scattered, probe, group=group)
    assert torch.equal(C.reduce_scatter(probe, 0, group), scattered), "reduce_scatter disagrees with gloo"
    exchanged = torch.empty_like(probe)
    dist.all_to_all_single(exchanged, probe, group=group)
    assert torch.equal(C.all_to_all(probe, 0, 0, group), exchanged), "all_to_all disagrees with gloo"

    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        op: {v: {n: [] for n in sizes} for v in VARIANTS} for op in OPS
    }
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    for rep in range(-1, reps):  # rep -1 is the warm-up
        order = rotated(VARIANTS, rep)
        for op in OPS:
            for n in sizes:
                fns = bench(op, n)
                iters = 1 if rep < 0 else _iterations(n)
                for name in order:
                    mpi.Barrier()
                    t0 = time.perf_counter()
                    fns[name](iters)
                    per_call = (time.perf_counter() - t0) / iters
                    slowest = mpi.allreduce(per_call, op=MPI.MAX)
                    if rep >= 0:
                        samples[op][name][n].append(slowest)
                del fns
    elapsed = time.monotonic() - started
    load_after = os.getloadavg()[0]
    mpi.Free()
    world.destroy_groups([group])
    world.shutdown()
    if rank != 0:
        return None
    return {
        "ranks": size,
        "reps": reps,
        "sizes": sizes,
        "elapsed_s": elapsed,
        "load": [load_before, load_after],
        "samples": {
            op: {v: {str(n): s for n, s in by.items()} for v, by in d.items()} for op, d in samples.items()
        },
    }


def _report(parts: list[dict[str, Any]]) -> None:
    results: dict[str, Any] = {}
    lines = [
        "# comm_collectives: mp's collectives vs raw gloo and raw MPI (CPU, one host)",
        "",
        "float32 tensors; size = the operation's largest buffer (all-reduce: the tensor; all-gather: the "
        "gathered output; reduce-scatter: the input; all-to-all: the send buffer); GB/s = algorithm "
        "bandwidth, size / time of one call on the slowest rank. mp = `mp_comm.collectives` (fresh output "
        "per call, autograd Function; CPU tensors over the group's MPI communicator); gloo = raw "
        "`torch.distributed` into preallocated buffers; mpi4py = "
        "MPICH's collectives on the same buffers. Median over interleaved repetitions; (x) = bandwidth "
        "ratio paired within each repetition, median over repetitions. The host is shared and "
        "noisy (4 ranks oversubscribe its 2 cores): compare ratios, not absolute numbers. `python "
        "benchmarks/comm_collectives.py` regenerates this file.",
        "",
    ]
    summary: list[str] = []
    for part in parts:
        ranks, sizes, reps = part["ranks"], part["sizes"], part["reps"]
        samples = part["samples"]
        res_r: dict[str, Any] = {}
        lines += [
            f"## {ranks} ranks",
            "",
            f"{reps} repetitions, {part['elapsed_s']:.0f} s; 1-minute load average {part['load'][0]:.1f} at "
            f"the start and {part['load'][1]:.1f} at the end.",
            "",
        ]
        for op in OPS:
            res_op: dict[str, Any] = {}
            lines += [
                f"### {op.replace('_', '-')}",
                "",
                "| size | mp GB/s | gloo GB/s | mpi4py GB/s | mp/gloo | mp/best raw "
                "| mp µs | gloo µs | mpi4py µs |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for n in sizes:
                key = str(n)
                t = {v: statistics.median(samples[op][v][key]) for v in VARIANTS}
                gbps = {v: n / t[v] / 1e9 for v in VARIANTS}
                best = max(RAW, key=lambda v: gbps[v])

                vs_gloo = _paired(samples[op], "mp", "gloo", key)
                vs_best = _paired(samples[op], "mp", best, key)
                res_op[key] = {
                    "time_us": {v: t[v] * 1e6 for v in VARIANTS},
                    "gb_per_s": gbps,
                    "ratio_mp_to_gloo": vs_gloo,
                    "best_raw": best,
                    "ratio_mp_to_best_raw": vs_best,
                }
                lines.append(
                    f"| {_human(n)} | {gbps['mp']:.3f} | {gbps['gloo']:.3f} | {gbps['mpi4py']:.3f} | "
                    f"{vs_gloo:.2f}x | {vs_best:.2f}x ({best}) | {t['mp'] * 1e6:.0f} | "
                    f"{t['gloo'] * 1e6:.0f} | {t['mpi4py'] * 1e6:.0f} |"
                )
            big = [k for k in res_op if int(k) >= MB]
            worst = min(big, key=lambda k: res_op[k]["ratio_mp_to_gloo"]) if big else None
            if worst is not None:
                summary.append(
                    f"{ranks} ranks, {op.replace('_', '-')}: mp/gloo at >= 1 MB between "
                    f"{res_op[worst]['ratio_mp_to_gloo']:.2f}x ({_human(int(worst))}) and "
                    f"{max(res_op[k]['ratio_mp_to_gloo'] for k in big):.2f}x; mp/best raw at >= 1 MB "
                    f"{min(res_op[k]['ratio_mp_to_best_raw'] for k in big):.2f}x to "
                    f"{max(res_op[k]['ratio_mp_to_best_raw'] for k in big):.2f}x"
                )
            res_r[op] = res_op
            lines.append("")
        results[str(ranks)] = {
            "repetitions": reps,
            "elapsed_s": part["elapsed_s"],
            "load_average_1min": {"start": part["load"][0], "end": part["load"][1]},
            "sizes": sizes,
            "ops": res_r,
            "samples_s": samples,
        }
    lines += ["## Summary", ""] + [f"- {s}" for s in summary] + [""]
    payload = {
        "benchmark": "comm_collectives",
        "method": "mp_comm.collectives vs raw torch.distributed (gloo) vs mpi4py (MPICH) on float32 CPU "
        "tensors; size = largest buffer; algorithm bandwidth; slowest rank's time per call; median over "
        "interleaved repetitions; ratios paired per repetition",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "comm_collectives.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / "comm_collectives.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _paired(samples: dict[str, dict[str, list[float]]], a: str, b: str, key: str) -> float:
    """Bandwidth ratio a/b within each repetition (they ran seconds apart), median over repetitions."""
    pairs = zip(samples[a][key], samples[b][key], strict=True)
    return statistics.median(tb / ta for ta, tb in pairs)


def _human(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // KB} KB"


if __name__ == "__main__":
    main()
