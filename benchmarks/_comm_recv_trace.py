"""Diagnostic: where the receiving thread's time goes in a stream through mp's MPI transport (not part of
the benchmark run).

    python benchmarks/_comm_recv_trace.py [bytes] [windows]      (starts itself on 2 bound ranks)

Rank 0 sends windows of 16 CPU tensors of `bytes` (default 1 MiB) back to back through
`MPITransport`, rank 1 takes them with `recv` (comm_p2p's streaming pattern). Internals of the transport
are wrapped from outside to time them (so this breaks when they are renamed; it changes no behaviour):
`_start_recv` (header decode, receive prepared and posted, and, when the payload lands at once, its
completion), `_prepare_arrival` (metadata, allocation, inline payloads), `_try_finish` (the `Testall`
that moves the payload, then delivery), `decode_header`, `allocate`, and the `_drive` calls that found
no header. A run without the wrappers comes first, for the undisturbed rate. Then the same functions
are timed in a loop of their own, for comparison. Prints µs per message.
"""

from __future__ import annotations

import sys
import time
import timeit
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

WINDOW = 16


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import relaunch, under_mpi

    if not under_mpi():
        sys.exit(relaunch(__file__, 2))
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    windows = int(sys.argv[2]) if len(sys.argv) > 2 else 40

    from mp_comm.transport.ucx import preload_before_mpi

    preload_before_mpi()
    import torch

    import mp_comm.transport.mpi as mpi_transport
    from mp_comm.message import (
        allocate,
        decode_header,
        default_device_map,
        encode_object,
        pack_header,
        wire_tensors,
    )
    from mp_comm.transport import MPITransport, TransportConfig, base
    from mp_comm.world import init_world

    world = init_world()
    rank, peer = world.rank, 1 - world.rank
    t = MPITransport(world.mpi_comm, config=TransportConfig(timeout=60.0))
    x = torch.ones(nbytes, dtype=torch.uint8)

    def stream(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                handles = [t.send(x, peer, 8) for _ in range(WINDOW)]
                t.recv(peer, 9)
                for h in handles:
                    h.wait()
            else:
                for _ in range(WINDOW):
                    t.recv(peer, 8)
                t.send(None, peer, 9)
        return (time.perf_counter() - t0) / (n * WINDOW) * 1e6

    stream(2)
    plain_us = stream(windows)

    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1

        return wrapper

    t._start_recv = timed("_start_recv", t._start_recv)  # type: ignore[method-assign]
    t._prepare_arrival = timed("_prepare_arrival", t._prepare_arrival)  # type: ignore[method-assign]
    t._try_finish = timed("_try_finish (Testall, delivery)", t._try_finish)  # type: ignore[method-assign]
    mpi_transport.decode_header = timed("decode_header", mpi_transport.decode_header)  # type: ignore[assignment]
    base.allocate = timed("allocate", base.allocate)  # type: ignore[assignment]
    drive = t._drive

    def counted_drive() -> bool:
        before = calls["_start_recv"]
        t0 = time.perf_counter()
        worked = drive()
        if calls["_start_recv"] == before:
            spent["_drive finding no header"] += time.perf_counter() - t0
            calls["_drive finding no header"] += 1
        return worked

    t._drive = counted_drive  # type: ignore[method-assign]
    stream(2)
    spent.clear()
    calls.clear()
    traced_us = stream(windows)

    messages = windows * WINDOW
    if rank == 1:
        print(f"{nbytes} bytes, {messages} messages received on rank 1")
        print(f"  per message, unwrapped: {plain_us:.1f} µs ({nbytes / plain_us / 1e3:.2f} GB/s)")
        print(f"  per message, wrapped:   {traced_us:.1f} µs")
        for name in sorted(spent, key=lambda k: -spent[k]):
            print(f"    {name:34s} {spent[name] / messages * 1e6:7.1f} µs/message ({calls[name]} calls)")
        body, tensors = encode_object(x)
        metas = tuple(wire_tensors(tensors)[1])
        header = pack_header(8, 0, 0, body, metas=metas, slot=-1, channel=0, extra=(), inline=(), blob=b"")
        n = 20_000
        alone = {
            "decode_header": timeit.timeit(lambda: decode_header(header, source=0), number=n),
            "allocate": timeit.timeit(lambda: allocate(metas, default_device_map, None), number=n),
        }
        print("  the same, in a loop of their own:")
        for name, seconds in alone.items():
            print(f"    {name:34s} {seconds / n * 1e6:7.1f} µs/call")
    t.close()
    world.shutdown()


if __name__ == "__main__":
    main()
