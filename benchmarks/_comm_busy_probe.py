"""Diagnostic: what a busy rank's polling costs the compute beside it (not part of the benchmark run;
docs/comm.md, "Busy ranks").

    python benchmarks/_comm_busy_probe.py [--reps N | --quick]   (one process, bound to one core)

A long-lived thread (as a module-server worker) runs the forward and backward of the benchmark GPT on
one microbatch of 2 sequences while an MPI transport of the same process is marked busy with nothing
in flight, its progress thread making a round every

* `poll_busy` (5 ms: what a busy rank did before `poll_busy_idle`),
* `poll_busy_idle` (the default with nothing in flight),
* never (no rounds: the compute alone),

interleaved over `--reps` repetitions (30; 8 with `--quick`). Prints each variant's median time, its
progress rounds per microbatch, and its time over the no-rounds run's, paired within a repetition.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import rotated, sweep_parser

    args = sweep_parser(__doc__).parse_args()
    reps = args.reps or (8 if args.quick else 30)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the worker and the progress thread share it
    import torch
    from _pipeline_gpt import GPT, GPTConfig, make_batch

    from mp_comm.transport import MPITransport, TransportConfig
    from mp_comm.transport.mpi import import_mpi

    torch.set_num_threads(1)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = make_batch(cfg, 2, seed=0)
    transport = MPITransport(import_mpi().COMM_SELF, config=TransportConfig(timeout=60.0))
    default = transport.config
    jobs: queue.Queue[bool] = queue.Queue()
    done: queue.Queue[float] = queue.Queue()

    def worker() -> None:
        while jobs.get():
            t0 = time.perf_counter()
            model(x, y).backward()
            done.put(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)

    thread = threading.Thread(target=worker, name="worker")
    thread.start()
    never, busy, quiet = 3600.0, default.poll_busy, default.poll_busy_idle
    variants = {
        f"every poll_busy ({busy * 1e3:g} ms)": (busy, busy),
        f"every poll_busy_idle ({quiet * 1e3:g} ms)": (busy, quiet),
        "no rounds": (never, never),
    }

    def run(polls: tuple[float, float]) -> tuple[float, int]:
        transport.config = dataclasses.replace(default, poll_busy=polls[0], poll_busy_idle=polls[1])
        transport.set_busy(True)
        time.sleep(0.01)  # the progress thread has begun its busy rest
        rounds = transport.stats["rounds"]
        jobs.put(True)
        elapsed = done.get()
        rounds = transport.stats["rounds"] - rounds
        transport.set_busy(False)
        return elapsed, rounds

    for polls in variants.values():
        run(polls)
    got: dict[str, list[tuple[float, int]]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        for name in rotated(names, rep):
            got[name].append(run(variants[name]))
    jobs.put(False)
    thread.join()
    transport.close()
    alone = got["no rounds"]
    print(f"GPT forward + backward on 2 sequences, {reps} interleaved repetitions, one core:")
    for name, samples in got.items():
        ratio = statistics.median(a / b for (a, _), (b, _) in zip(samples, alone, strict=True))
        print(
            f"  {name:32s} {statistics.median(t for t, _ in samples) * 1e3:7.1f} ms, "
            f"{statistics.median(r for _, r in samples):4.0f} rounds, {ratio:.3f}x the compute alone"
        )


if __name__ == "__main__":
    main()
