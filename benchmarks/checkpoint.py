"""Checkpoint save and load throughput: mp against plain torch.save/torch.load and DCP (pp=2).

A ``--layers`` x Linear(``--hidden``, ``--hidden``) float32 model (16 x 4096: about 1 GB) on 2 ranks,
pp=2 (half of the layers on each rank), each rank writing and reading its own half:

- mp: ``smp.save_checkpoint(partial=True)`` (temporary names, fsync, agreement, atomic publication,
  manifest, ``newest``) and ``smp.resume_from_checkpoint`` (size and CRC-32 checks,
  ``torch.load(weights_only=True, mmap=True)``, agreement, ``load_state_dict``);
- torch: ``torch.save(model.local_state_dict(), part)`` per rank (no fsync, no checks) and
  ``torch.load(part, weights_only=True)`` + ``load_state_dict``;
- torch+fsync: the same, with an fsync of the file (durable, as mp and DCP are);
- DCP: ``torch.distributed.checkpoint.save`` / ``load`` of the same local state dict (its file writer
  fsyncs; loading copies into the model's tensors in place).

The background saves, on the same state and in the same rotation: ``smp.save_checkpoint(...,
async_save=True)`` and DCP's ``async_save`` (as called by default, a new stager per call; and with one
``DefaultStager`` kept across calls, which reuses its host copies as mp does). Each is timed twice: the
call (what the training loop blocks for) and the wait for it to finish (``smp.wait_checkpoint()``,
the future's ``result()``). A first, untimed call of each before the repetitions allocates their host
buffers; its blocking time is reported as ``cold``.

Each repetition runs the engines in a rotating order; a time is the slowest rank's, from a barrier to a
barrier; throughput is the bytes of both ranks' tensors over that time, median over repetitions.
Files go to ``--dir`` (default: a temporary folder on the same disk as /tmp) and are removed after each
repetition, so reads after writes come from the page cache for all three alike.

Run: ``python -m benchmarks.checkpoint`` (starts itself under ``mpiexec -n 2``); ``--quick`` for a smoke
run. Results go to benchmarks/results/checkpoint.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._launch import relaunch, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn`` on the slowest rank (barriers around it)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="training steps timed while a save is written")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, 2))
    if args.quick:
        args.layers, args.hidden, args.reps = 4, 512, 2

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    import mp as smp
    from mp_partition import set_partition

    torch.set_num_threads(1)
    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False, "default_partition": 0}
    )
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    for layer in net[args.layers // 2 :]:
        set_partition(layer, 1)
    model = smp.DistributedModel(net)

    @smp.step
    def step(x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        model.backward(out)
        return out

    step(torch.randn(1, args.hidden))  # partitions: each rank keeps (and frees the other) half
    local = {k: v for k, v in model.local_state_dict().items() if isinstance(v, torch.Tensor)}
    nbytes = torch.tensor([sum(t.numel() * t.element_size() for t in local.values())], dtype=torch.float64)
    dist.all_reduce(nbytes)
    total = float(nbytes)

    rank = smp.rank()
    base = args.dir or tempfile.gettempdir()
    root = os.path.join(base, "mp_checkpoint_bench")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()

    def mp_save(folder: str) -> None:
        smp.save_checkpoint(folder, "bench", partial=True, model=model)

    def mp_load(folder: str) -> None:
        smp.resume_from_checkpoint(folder, "bench", partial=True, load_optimizer=False)

    def torch_save(folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        torch.save(model.local_state_dict(), os.path.join(folder, f"part_{rank}"))

    def torch_load(folder: str) -> None:
        sd = torch.load(os.path.join(folder, f"part_{rank}"), weights_only=True)
        sd = {k: v for k, v in sd.items() if not k.startswith("_smp_")}
        model.module.load_state_dict(sd, strict=False)

    def torch_save_fsync(folder: str) -> None:
        torch_save(folder)
        fd = os.open(os.path.join(folder, f"part_{rank}"), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def dcp_save(folder: str) -> None:
        dcp.save({"model": local}, checkpoint_id=folder)

    def dcp_load(folder: str) -> None:
        dcp.load({"model": local}, checkpoint_id=folder)

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    kept_stager = DefaultStager(StagingOptions(False, False, False, False))  # CPU: no pinning, no streams
    futures: list[Any] = []
    # DCP's background thread runs collectives; on the default group they would meet this loop's barriers.
    dcp_group = dist.new_group(backend="gloo")

    def mp_async(folder: str) -> None:
        smp.save_checkpoint(folder, "bench", partial=True, model=model, async_save=True)

    def dcp_async(folder: str) -> None:
        futures.append(dcp.async_save({"model": local}, checkpoint_id=folder, process_group=dcp_group))

    def dcp_async_kept(folder: str) -> None:
        futures.append(
            dcp.async_save(
                {"model": local}, checkpoint_id=folder, process_group=dcp_group, async_stager=kept_stager
            )
        )

    def dcp_finish() -> None:
        futures.pop().result()

    background: dict[str, tuple[Callable[[str], None], Callable[[], None]]] = {
        "mp async": (mp_async, smp.wait_checkpoint),
        "dcp async_save": (dcp_async, dcp_finish),
        "dcp async_save, kept stager": (dcp_async_kept, dcp_finish),
    }

    engines = {
        "mp": (mp_save, mp_load),
        "torch": (torch_save, torch_load),
        "torch+fsync": (torch_save_fsync, torch_load),
        "dcp": (dcp_save, dcp_load),
    }
    times: dict[str, dict[str, list[float]]] = {e: {"save": [], "load": []} for e in engines}
    blocking: dict[str, dict[str, list[float]]] = {
        e: {"call": [], "steps": [], "finish": []} for e in background
    }
    steps_alone: list[float] = []
    batch = torch.randn(1, args.hidden)

    def train() -> None:
        for _ in range(args.steps):
            step(batch)

    cold: dict[str, float] = {}
    for name, (start, finish) in background.items():  # the first call allocates the host copies
        folder = os.path.join(root, f"cold-{name.replace(' ', '_').replace(',', '')}")
        cold[name] = _timed(lambda start=start, folder=folder: start(folder))
        finish()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    for rep in range(args.reps):
        steps_alone.append(_timed(train))
        names = [*engines, *background]
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            folder = os.path.join(root, f"{name.replace(' ', '_').replace(',', '')}{rep}")
            if name in background:
                start, finish = background[name]
                blocking[name]["call"].append(_timed(lambda start=start, folder=folder: start(folder)))
                blocking[name]["steps"].append(_timed(train))  # training goes on while the save is written
                blocking[name]["finish"].append(_timed(finish))
                os.sync()
            else:
                save, load = engines[name]
                times[name]["save"].append(_timed(lambda save=save, folder=folder: save(folder)))
                # Untimed: write back what the save left dirty, so that it is not charged to the next one.
                os.sync()
                times[name]["load"].append(_timed(lambda load=load, folder=folder: load(folder)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
    kept_stager.close()

    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        gbps = {
            e: {op: total / statistics.median(ts) / 1e9 for op, ts in ops.items()} for e, ops in times.items()
        }
        ratio = {op: gbps["mp"][op] / max(gbps["torch"][op], gbps["dcp"][op]) for op in ("save", "load")}
        med = {e: {k: statistics.median(v) for k, v in ops.items()} for e, ops in blocking.items()}
        sync_save = {
            "mp": statistics.median(times["mp"]["save"]),
            "dcp": statistics.median(times["dcp"]["save"]),
        }
        of_sync = {e: med[e]["call"] / sync_save["mp" if e.startswith("mp") else "dcp"] for e in background}
        labels = {
            "mp async": "mp save_checkpoint(async_save=True)",
            "dcp async_save": "dcp.async_save",
            "dcp async_save, kept stager": "dcp.async_save, kept stager",
        }
        alone = statistics.median(steps_alone)
        slower = {e: med[e]["steps"] / alone for e in background}
        rows: list[tuple[str, float, float | None, float, float | None, float | None]] = [
            ("mp save_checkpoint (sync)", sync_save["mp"], None, sync_save["mp"], None, None),
            ("dcp.save (sync)", sync_save["dcp"], None, sync_save["dcp"], None, None),
        ]
        for e, label in labels.items():
            until = med[e]["call"] + med[e]["steps"] + med[e]["finish"]
            rows.append((label, med[e]["call"], cold[e], until, of_sync[e], slower[e]))
        rows = [rows[0], rows[2], rows[1], rows[3], rows[4]]
        result = {
            "config": {
                "layers": args.layers,
                "hidden": args.hidden,
                "reps": args.reps,
                "ranks": 2,
                "pp": 2,
                "bytes": total,
                "dir": base,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            "seconds": times,
            "gb_per_s": gbps,
            "mp_over_best_peer": ratio,
            "background_seconds": blocking,
            "background_cold_call_seconds": cold,
            "background_call_over_sync_save": of_sync,
            "steps": args.steps,
            "steps_alone_seconds": steps_alone,
            "steps_while_writing_over_alone": slower,
        }
        lines = [
            "# Checkpoint throughput: mp vs torch.save/torch.load and DCP (pp=2)",
            "",
            f"{args.layers} x Linear({args.hidden}, {args.hidden}) float32, {total / 1e9:.2f} GB over 2 "
            f"ranks (pp=2, each rank its half), files in {base} on one host ({os.cpu_count()} CPUs). Median "
            f"of {args.reps} repetitions in rotating order; slowest rank, barrier to barrier.",
            "",
            "| engine | save (GB/s) | load (GB/s) |",
            "|---|---|---|",
            *(f"| {e} | {gbps[e]['save']:.2f} | {gbps[e]['load']:.2f} |" for e in engines),
            "",
            f"mp / the better of torch and DCP: save {ratio['save']:.2f}x, load {ratio['load']:.2f}x "
            "(target >= 0.8x).",
            "",
            "## Background saves: how long the training loop blocks",
            "",
            "Seconds (median; slowest rank). `blocks` is the call, `cold` the first call (it allocates the "
            f"host copies); then {args.steps} training steps run while the save is written, and the wait "
            "for it: `until published` is the call, the steps and the wait; `of sync` is blocks over the "
            "same engine's synchronous save (target for mp <= 0.2x); `steps` is the time of those steps "
            f"over the same steps with no save in flight ({alone:.3f} s).",
            "",
            "| save | blocks (s) | cold (s) | until published (s) | of sync | steps |",
            "|---|---|---|---|---|---|",
            *(
                f"| {name} | {call:.3f} | {'' if c is None else f'{c:.3f}'} | {total:.3f} | "
                f"{'' if r is None else f'{r:.3f}x'} | {'' if w is None else f'{w:.2f}x'} |"
                for name, call, c, total, r, w in rows
            ),
            "",
            "mp and DCP fsync what they write, plain torch.save does not: its bytes may still be in the page "
            "cache when it returns (`torch+fsync` adds the fsync). After each save, untimed, `os.sync()` "
            "writes back what it left dirty so that it is not charged to the next engine. mp's save is "
            "torch.save plus its protocol (agreement, atomic publication, manifest, `newest`); its checksums "
            "are the CRC-32s torch's zip writer computes. Its load checks every record's CRC-32 and maps the "
            "file (`torch.load(mmap=True)`) where torch.load reads it.",
        ]
        if not args.quick:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
            (RESULTS / "checkpoint.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.barrier()


if __name__ == "__main__":
    main()
