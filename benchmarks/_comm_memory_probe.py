"""Diagnostic: what receive memory costs a ping-pong (not part of the benchmark run; docs/comm.md,
"Recycled receive memory from 1 MiB").

    python benchmarks/_comm_memory_probe.py [bytes] [--reps N | --quick]   (starts itself on 2 bound ranks)

Two measurements of a ping-pong of `bytes` (default 1 MiB), interleaved over `--reps` repetitions (7;
3 with `--quick`):

* raw mpi4py `Send`/`Recv`, one-way time, by where the receiver puts the message: one buffer reused
  (what comm_p2p's baseline does), the received buffer sent back, 3 or 8 buffers in rotation, or a
  fresh `torch.empty` per message (what any receiver that hands each message's tensor to its caller
  must do);
* mp's MPI transport, one-way time and the minor page faults per round trip on each rank, where rank
  1 sends back the tensor it received (a reply, or an activation kept for the backward).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import relaunch, sweep_parser, under_mpi

    parser = sweep_parser(__doc__)
    parser.add_argument("bytes", type=int, nargs="?", default=1 << 20, help="message size (default 1 MiB)")
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, 2))
    nbytes, reps = args.bytes, args.reps or (3 if args.quick else 7)
    # ucxx's UCX libraries must be loaded before MPI loads the mpich wheel's own copy.
    from mp_comm.transport.ucx_setup import preload_before_mpi

    preload_before_mpi()
    import torch

    from mp_comm.message import numpy_bytes
    from mp_comm.transport import MPITransport, TransportConfig
    from mp_comm.world import init_world

    world = init_world()
    rank, peer = world.rank, 1 - world.rank
    comm = world.mpi_comm.Dup()
    transport = MPITransport(world.mpi_comm, config=TransportConfig(timeout=60.0))
    out = torch.ones(nbytes, dtype=torch.uint8)
    buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(8)]

    def raw(rotation: int, echo: bool = False, fresh: bool = False) -> Callable[[int], None]:
        def run(n: int) -> None:
            for i in range(n):
                into = torch.empty(nbytes, dtype=torch.uint8) if fresh else buffers[i % rotation]
                if rank == 0:
                    comm.Send(numpy_bytes(out), peer, 5)
                    comm.Recv(numpy_bytes(into), peer, 5)
                else:
                    comm.Recv(numpy_bytes(into), peer, 5)
                    comm.Send(numpy_bytes(into if echo else out), peer, 5)

        return run

    def ours(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                transport.send(out, peer, 5)
                transport.recv(peer, 5)
            else:
                got = transport.recv(peer, 5).obj
                transport.send(got, peer, 5)

    variants = {
        "raw, one buffer": raw(1),
        "raw, received buffer sent back": raw(1, echo=True),
        "raw, 3 buffers in rotation, sent back": raw(3, echo=True),
        "raw, 8 buffers in rotation, sent back": raw(8, echo=True),
        "raw, fresh torch.empty, sent back": raw(1, echo=True, fresh=True),
        "mp-mpi, received tensor sent back": ours,
    }
    iters = 20
    one_way: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, int] = dict.fromkeys(variants, 0)
    for _ in range(reps):
        for name, fn in variants.items():
            fn(2)
            comm.Barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn(iters)
            elapsed = comm.bcast(time.perf_counter() - t0, root=0)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            one_way[name].append(elapsed / (2 * iters) * 1e6)
    per_trip = comm.gather({name: f / (reps * iters) for name, f in faults.items()}, root=0)
    if rank == 0:
        assert per_trip is not None
        print(f"{nbytes} bytes, ping-pong, median of {reps} interleaved repetitions of {iters} round trips")
        print(f"  {'':40s} {'one-way µs':>10s}   minor faults per round trip (rank 0 / rank 1)")
        for name, samples in one_way.items():
            print(
                f"  {name:40s} {statistics.median(samples):10.1f}   "
                f"{per_trip[0][name]:6.1f} / {per_trip[1][name]:6.1f}"
            )
    transport.close()
    comm.Free()
    world.shutdown()


if __name__ == "__main__":
    main()
