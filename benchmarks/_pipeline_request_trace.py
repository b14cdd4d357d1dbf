"""Diagnostic: where one remote call's round trip goes in mp's module server (not part of the benchmark run).

    mpiexec -n 2 python benchmarks/_pipeline_request_trace.py [calls] [steps]

Runs the ``nn.Identity`` chain of benchmarks/_pipeline_overhead.py (the calls on pp_rank 1) and timestamps
each request by wrapping internals of mp_pipeline and mp_comm from outside (so it breaks when they are
renamed; it changes no behaviour): the requester's ``Server.call`` (A: request built, H: worker resumed),
the MPI transport posting it (P) and matching its header (R), the mailbox delivering it (B), the owner
taking it (C: its main thread, or the thread that waits in place), ``Remote.handle`` running it (D → E),
and the same hops for the response.
Prints, per phase (FWD, BWD), the median and mean of every hop in µs over all calls of the timed steps.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOPS = (
    ("build + post request", "A", "P"),
    ("MPI: post → header matched", "P", "R"),
    ("header → mailbox", "R", "B"),
    ("mailbox → taken (main or waiting thread)", "B", "C"),
    ("taken → executing", "C", "D"),
    ("execute (Remote.handle)", "D", "E"),
    ("build + post response", "E", "P2"),
    ("MPI: post → header matched ", "P2", "R2"),
    ("header → mailbox ", "R2", "B2"),
    ("mailbox → taken by the requester", "B2", "G"),
    ("taken → requester resumed", "G", "H"),
    ("round trip", "A", "H"),
)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _pipeline_overhead import WIDTH, Chain

    import mp as smp
    from mp_comm.transport import mailbox as mailbox_mod
    from mp_comm.transport import mpi as mpi_mod
    from mp_comm.world import init_world
    from mp_pipeline import remote as remote_mod
    from mp_pipeline import server as server_mod
    from mp_pipeline.messages import Request, Response

    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    world = init_world()
    assert world.mpi_comm is not None, "run under mpiexec -n 2"
    comm = world.mpi_comm.Dup()
    rank = comm.Get_rank()
    events: list[tuple[str, float, Any]] = []  # (point, time, key)
    clock = time.perf_counter
    current: dict[int, int] = {}  # per thread: messages queued when it entered _post_sends

    def wrap(
        cls: Any, name: str, before: Callable[..., None], after: Callable[..., None] | None = None
    ) -> None:
        original = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before(*args)
            out = original(*args, **kwargs)
            if after is not None:
                after(*args)
            return out

        setattr(cls, name, wrapper)

    def key(m: Any) -> tuple[int, int, str]:
        return (m.step.step, m.request_id, type(m).__name__)

    wrap(
        server_mod.Server,
        "call",
        lambda _s, _d, req: events.append(("A", clock(), req.phase.value)),
        lambda _s, _d, req: events.append(("H", clock(), key(req))),
    )

    def dispatched(_s: Any, message: Any) -> None:
        if isinstance(message, Request | Response):
            events.append(("C" if isinstance(message, Request) else "G", clock(), key(message)))

    wrap(server_mod.Server, "_dispatch", dispatched)
    # A thread that waits in place (server.py) takes its response, or the next request, itself.
    take_in_place = server_mod.Server._take_in_place

    def taken_in_place(self: Any) -> Any:
        message = take_in_place(self)
        dispatched(self, message)
        return message

    server_mod.Server._take_in_place = taken_in_place
    wrap(
        remote_mod.Remote,
        "handle",
        lambda _r, req: events.append(("D", clock(), key(req))),
        lambda _r, req: events.append(("E", clock(), key(req))),
    )

    # The transport sees bytes, not messages: order within each direction identifies them (one call is in
    # flight at a time in this chain).
    def posted(t: Any) -> None:
        if current.pop(threading.get_ident(), 0):
            events.append(("P", clock(), None))

    wrap(
        mpi_mod.MPITransport,
        "_post_sends",
        lambda t: current.__setitem__(threading.get_ident(), len(t._outq)),
        posted,
    )
    wrap(mpi_mod.MPITransport, "_start_recv", lambda _t, _s, _raw: events.append(("R", clock(), None)))
    wrap(mailbox_mod.Mailbox, "deliver", lambda _m, _a: events.append(("B", clock(), None)))

    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False, "default_partition": 0}
    )
    net = Chain(calls)
    smp.set_partition(net, 0)
    smp.set_partition(net.calls, 1)
    model = smp.DistributedModel(net)
    x = torch.ones(1, WIDTH)

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x)
        model.backward(loss)
        return loss  # type: ignore[no-any-return]

    for _ in range(3):
        train_step(model, x)
    comm.Barrier()
    events.clear()
    t0 = clock()
    for _ in range(steps):
        train_step(model, x)
    elapsed = (clock() - t0) / steps
    gathered = comm.gather(events, root=0)
    if rank == 0:
        _print(gathered, calls, elapsed)
    smp.reset()
    comm.Free()


def _print(gathered: list[list[tuple[str, float, Any]]], calls: int, elapsed: float) -> None:
    merged = sorted(
        ((t, r, point, k) for r, evs in enumerate(gathered) for point, t, k in evs), key=lambda e: e[0]
    )
    hops: dict[str, dict[str, list[float]]] = {name: {"FWD": [], "BWD": []} for name, _, _ in HOPS}
    # Walk each call from its A (requester) to its H, picking the transport points in between by order.
    for i, (t, r, point, k) in enumerate(merged):
        if point != "A":
            continue
        phase = str(k)
        owner = 1 - r
        times: dict[str, float] = {"A": t}
        expect = [("P", r), ("R", owner), ("B", owner), ("C", owner), ("D", owner), ("E", owner)]
        expect += [("P2", owner), ("R2", r), ("B2", r), ("G", r), ("H", r)]
        j = i + 1
        for name, where in expect:
            base = name.rstrip("2")
            while j < len(merged) and not (merged[j][2] == base and merged[j][1] == where):
                j += 1
            if j == len(merged):
                break
            times[name] = merged[j][0]
        if len(times) != len(expect) + 1:
            continue
        for name, a, b in HOPS:
            hops[name][phase].append((times[b] - times[a]) * 1e6)
    print(f"{calls} remote calls per step, {elapsed * 1e3:.1f} ms per step (forward + backward)")
    for name, by_phase in hops.items():
        cells = []
        for phase in ("FWD", "BWD"):
            v = by_phase[phase]
            cells.append(
                f"{phase} median {statistics.median(v):7.0f} mean {statistics.mean(v):7.0f}" if v else phase
            )
        print(f"{name:40s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
