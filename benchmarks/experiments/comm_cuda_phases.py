"""Where one CUDA message's time goes on the UCX D2D path: each phase stamped, 2 ranks on one node.

Needs a GPU and ucxx. Ping-pong of one float32 CUDA tensor over `UCXTransport` with the handshake
(`buffered_peers="all"`) and without it (the default within a node), against the MPI transport's
host staging; for 64 KB and 1 MB it prints the median time of each phase of a rank 0 -> rank 1
message. Both ranks stamp with `time.perf_counter_ns` (CLOCK_MONOTONIC, one clock for the node), so
differences across ranks are real. Prints only (the numbers are quoted in docs/gpu.md).

Run: ``python -m benchmarks.experiments.comm_cuda_phases`` (starts itself under ``mpiexec -n 2``); with
``--cpu`` the same path runs on host memory (`buffered_devices=("cpu",)`), for machines without a GPU.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from benchmarks._launch import relaunch, under_mpi

KB = 1024
SIZES = [KB, 64 * KB, 256 * KB, KB * KB, 4 * KB * KB, 16 * KB * KB]
TRACED = (64 * KB, KB * KB)
PHASES = [  # (rank that stamps it, stamp): the path of one message from rank 0 to rank 1
    (0, "submit"),
    (0, "start_send"),
    (1, "start_recv"),
    (1, "answered"),
    (0, "on_answer"),
    (0, "payload_posted"),
    (1, "arrived"),
    (1, "recv_returned"),
]


def main() -> None:
    if not under_mpi():
        sys.exit(relaunch(__file__, 2))
    from mp_comm.transport.ucx_setup import preload_before_mpi

    preload_before_mpi()
    import torch

    from mp_comm.transport import MPITransport, TransportConfig
    from mp_comm.transport.base import MessageTransport
    from mp_comm.transport.ucx import UCXConfig, UCXTransport
    from mp_comm.world import init_world

    device = "cpu" if "--cpu" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --cpu); nothing to measure here", file=sys.stderr)
        sys.exit(0)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    stamps: list[tuple[str, int]] = []

    def stamp(name: str) -> None:
        stamps.append((name, time.perf_counter_ns()))

    class Stamped(UCXTransport):
        def _submit(self, out: Any) -> None:
            stamp("submit")
            super()._submit(out)

        def _start_send(self, op: Any) -> None:
            stamp("start_send")
            super()._start_send(op)

        def _start_recv(self, source: int, header: Any) -> None:
            stamp("start_recv")
            super()._start_recv(source, header)
            stamp("answered")

        def _on_ctrl(self, source: int, wire: int, decision: str) -> None:
            stamp("on_answer")
            super()._on_ctrl(source, wire, decision)
            stamp("payload_posted")

        def _arrived(self, source: int, header: Any, tensors: Any, metas: Any) -> None:
            stamp("arrived")
            super()._arrived(source, header, tensors, metas)

    world = init_world()
    rank, peer = world.rank, 1 - world.rank

    def one_way(t: MessageTransport, n: int, iters: int) -> float:
        x = torch.ones(n // 4, device=device)
        times = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            if rank == 0:
                t.send(x, peer, tag=3)
                t.recv(peer, 3)
            else:
                y = t.recv(peer, 3).obj
                stamp("recv_returned")
                t.send(y, peer, tag=3)
            sync()
            times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times[iters // 4 :])

    config = TransportConfig(timeout=60.0)
    handshake = UCXConfig(buffered_devices=(device,), buffered_peers="all")
    straight = UCXConfig(buffered_devices=(device,))
    transports = {
        "ucx, handshake": lambda: Stamped.from_world(world, config=config, ucx=handshake),
        "ucx, straight": lambda: Stamped.from_world(world, config=config, ucx=straight),
        "mpi, staged": lambda: MPITransport.from_world(world, config=config),
    }
    rows: dict[str, dict[int, float]] = {}
    traces: dict[int, list[list[tuple[str, int]]]] = {}
    for name, make in transports.items():
        t = make()
        rows[name] = {}
        for n in SIZES:
            one_way(t, n, 5)
            stamps.clear()
            rows[name][n] = one_way(t, n, 40 if n <= KB * KB else 10)
            if name == "ucx, handshake" and n in TRACED:
                traces[n] = world.mpi_comm.allgather(list(stamps))
        t.close()
    if rank == 0:
        print("one-way time, µs (median):")
        print(f"{'':16}" + "".join(f"{n // KB:>9} KB" for n in SIZES))
        for name, row in rows.items():
            print(f"{name:16}" + "".join(f"{row[n] * 1e6:12.0f}" for n in SIZES))
        for n, logs in traces.items():
            seqs = [[ts for nm, ts in logs[r] if nm == what] for r, what in PHASES]
            k = min(map(len, seqs))
            parts = []
            for (_, a), (_, b), sa, sb in zip(PHASES, PHASES[1:], seqs, seqs[1:], strict=False):
                gap = statistics.median((sb[i] - sa[i]) / 1e3 for i in range(k // 4, k))
                parts.append(f"{a}->{b} {gap:.0f}")
            print(f"phases of a {n // KB} KB message with the handshake, µs: " + ", ".join(parts))
    world.shutdown()


if __name__ == "__main__":
    main()
