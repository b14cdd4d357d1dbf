"""Point-to-point of CUDA tensors between two ranks: the UCX device path against MPI host staging.

Needs a GPU (two ranks on one GPU use CUDA IPC on that device). Ping-pong of one float32 CUDA tensor,
1 KB to 64 MB, through mp's router forced onto each route:

* ``mp-ucx`` - the device-to-device path (persistent registered receive buffers, Appendix G);
* ``mp-mpi`` - the MPI transport, which stages device tensors through host memory;
* ``staged-mpi4py`` - the bound for staging: copy to a pinned host buffer, raw ``Send``/``Recv``, copy
  back, with preallocated buffers and nothing else.

Each cell is the median over repetitions of the mean one-way time; the router's own choice for CUDA
tensors is printed beside. Results go to benchmarks/results/comm_p2p_cuda.json and .md.

Run: ``python -m benchmarks.comm_p2p_cuda`` (starts itself under ``mpiexec -n 2``).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks._launch import relaunch, under_mpi

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
KB = 1024
SIZES = [KB, 64 * KB, 256 * KB, KB * KB, 2 * KB * KB, 4 * KB * KB, 16 * KB * KB, 64 * KB * KB]


def main() -> None:
    if not under_mpi():
        sys.exit(relaunch(__file__, 2))
    from mp_comm.transport.ucx_setup import preload_before_mpi

    preload_before_mpi()
    import torch

    from mp_comm import Route, Router, RouterConfig, TransportConfig
    from mp_comm.message import numpy_bytes
    from mp_comm.world import init_world

    if not torch.cuda.is_available():
        print("needs CUDA; nothing to measure here", file=sys.stderr)
        sys.exit(0)
    world = init_world()
    rank, peer = world.rank, 1 - world.rank
    router = Router.create(world, config=RouterConfig(), transport_config=TransportConfig(timeout=120.0))
    chosen = {n: router.route({"cuda"}, peer, 1, n).value for n in SIZES}
    comm = world.mpi_comm.Dup()
    tensors = {n: torch.ones(n // 4, device="cuda") for n in SIZES}
    host_out = {n: torch.empty(n // 4, pin_memory=True) for n in SIZES}
    host_in = {n: torch.empty(n // 4, pin_memory=True) for n in SIZES}
    dev_in = {n: torch.empty(n // 4, device="cuda") for n in SIZES}

    def over(route: Route) -> Callable[[int, int], None]:
        def run(n: int, iters: int) -> None:
            for _ in range(iters):
                if rank == 0:
                    router.send(tensors[n], peer, 3, route=route)
                    router.recv(peer, 3).obj.sum()  # touch the data on the device
                else:
                    got = router.recv(peer, 3).obj
                    router.send(got, peer, 3, route=route)
            torch.cuda.synchronize()

        return run

    def staged(n: int, iters: int) -> None:
        out, into = numpy_bytes(host_out[n]), numpy_bytes(host_in[n])
        for _ in range(iters):
            if rank == 0:
                host_out[n].copy_(tensors[n])
                comm.Send(out, peer, 4)
                comm.Recv(into, peer, 4)
                dev_in[n].copy_(host_in[n])
            else:
                comm.Recv(into, peer, 4)
                dev_in[n].copy_(host_in[n])
                host_out[n].copy_(dev_in[n])
                comm.Send(out, peer, 4)
        torch.cuda.synchronize()

    variants: dict[str, Callable[[int, int], None]] = {"staged-mpi4py": staged, "mp-mpi": over(Route.MPI)}
    if Route.UCX in router.transports:
        variants["mp-ucx"] = over(Route.UCX)
    times: dict[str, dict[int, list[float]]] = {v: {n: [] for n in SIZES} for v in variants}
    for n in SIZES:  # warm up every path and size (registration, IPC handles, allocator)
        for run in variants.values():
            run(n, 2)
    for _ in range(5):
        for name, run in variants.items():
            for n in SIZES:
                iters = 20 if n <= KB * KB else 5
                comm.Barrier()
                t0 = time.perf_counter()
                run(n, iters)
                times[name][n].append((time.perf_counter() - t0) / (2 * iters))
    router.close()
    if rank != 0:
        return
    table = {name: {n: statistics.median(ts) for n, ts in per.items()} for name, per in times.items()}
    lines = [
        f"# CUDA point-to-point, 2 ranks ({torch.cuda.get_device_name()}, {platform.node()})",
        "",
        "The router's route for one CUDA tensor of each size is in the last column.",
        "",
        "| size | " + " | ".join(f"{v} GB/s" for v in variants) + " | mp-ucx / mp-mpi | route |",
        "|---|" + "---|" * (len(variants) + 2),
    ]
    for n in SIZES:
        bw = {v: n / table[v][n] / 1e9 for v in variants}
        ratio = f"{bw['mp-ucx'] / bw['mp-mpi']:.2f}x" if "mp-ucx" in bw else "-"
        cells = " | ".join(f"{bw[v]:.2f}" for v in variants)
        lines.append(f"| {n // KB} KB | {cells} | {ratio} | {chosen[n]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "comm_p2p_cuda.md").write_text(text)
    payload = {
        "route": {str(n): r for n, r in chosen.items()},
        "seconds_one_way": {v: {str(n): t for n, t in d.items()} for v, d in table.items()},
    }
    (RESULTS / "comm_p2p_cuda.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
