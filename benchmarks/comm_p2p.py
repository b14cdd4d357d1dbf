"""Point-to-point benchmark: mp's transports against raw MPI (the bound) and gloo (the peer).

Two measurements of one CPU tensor between two ranks, for sizes from 1 KB to 64 MB:

* ping-pong (latency): rank 0 sends, rank 1 sends it back; one-way time = round trip / 2. Each message
  waits for the previous one, so every microsecond of per-message overhead is on the clock;
* streaming (bandwidth, as OSU's osu_bw measures it): rank 0 sends a window of messages back to back,
  rank 1 receives them all and answers with one small acknowledgement; bandwidth = bytes / time. Several
  messages are in flight at once, so a transport's per-message work can overlap the transfers. Sizes
  from 256 KB; the window holds 16 messages, fewer above 4 MB (at most 64 MB in flight).

Ping-pong variants:

* ``mpi4py``  - blocking ``Send``/``Recv`` of the tensor's buffer into a preallocated buffer: the bound
  (what MPI itself moves, with no message format, no allocation, no threads);
* ``mpi4py-2msg`` - the least a receiver that does not know the message in advance must do, in plain
  Python on one thread: a small header (the payload's size) and the payload as two messages; the
  receiver probes any source for the header, reads the size, then receives the payload (into a
  preallocated buffer), polling. What this loses against ``mpi4py`` is the cost of the protocol and of
  Python itself; what ``mp-mpi`` loses against it is mp's own machinery (objects, mailbox, threads);
* ``mp-mpi``  - mp's MPI transport: any object, receiver allocates, progress thread, mailbox;
* ``mp-mpi-static`` - the same with ``send(..., static=True)`` (static mode: repeated shapes send no
  metadata, and the receiver lands them in buffers made while it waited);
* ``mp-ucx``  - mp's UCX transport (when ucxx is installed);
* ``gloo``    - ``torch.distributed.send``/``recv`` into a preallocated tensor: the peer.

Streaming variants: ``mpi4py`` (a window of ``Isend``s, the receiver's ``Irecv``s into preallocated
buffers posted at once, ``Waitall``), ``mp-mpi``, ``mp-mpi-static``, ``mp-ucx`` (``send`` a window, the
receiver ``recv``s each: it allocates every tensor) and ``gloo`` (``isend``/``irecv`` windows).

The variants are interleaved (each repetition runs every variant at every size, in a rotating order),
because this host is noisy; each cell is the median over repetitions (of the mean one-way time of a
batch of round trips, or of the bandwidth of a few windows). Results go to
benchmarks/results/comm_p2p.json and .md.

Per-message cost, reported beside the table:

* object layer: CPU time (of the calling thread) of one send + recv of a 1 KB tensor through a one-rank
  ``LoopbackTransport``: the whole message path (stubs, pickling, header, metadata, allocation, inline
  copy, ordered delivery, mailbox, rebuild) without MPI and without threads;
* per hop: mp-mpi's one-way time minus mpi4py's at the smallest size, paired within each repetition:
  what the object layer, the MPI transport's own calls and its thread hand-offs add to MPI's latency.

Targets (the issue's): at >= 1 MB, mp-mpi's bandwidth >= 0.9x the better raw path (mpi4py or gloo),
reported for both measurements (ping-pong bandwidth = size / one-way time); object layer < 50 us per
message for a small tensor. The report says whether each is met.

Run: ``python -m benchmarks.comm_p2p`` (starts itself under ``mpiexec -n 2``), or
``mpiexec -n 2 python -m benchmarks.comm_p2p``. Options: ``--quick`` (fewer sizes and repetitions),
``--reps N``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._launch import relaunch, rotated, sweep_parser, under_mpi

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
KB = 1024
SIZES = [KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, KB * KB, 4 * KB * KB, 16 * KB * KB, 64 * KB * KB]
QUICK_SIZES = [KB, 64 * KB, KB * KB, 16 * KB * KB]
STREAM_MIN = 256 * KB
STREAM_WINDOWS = 8  # windows per measurement (fewer left single windows' noise in the ratios)


def _window(nbytes: int) -> int:
    """Messages in flight per streaming window: 16, fewer above 4 MB (at most 64 MB in flight)."""
    return max(2, min(16, (64 * KB * KB) // nbytes))


def _iterations(nbytes: int) -> int:
    if nbytes <= 64 * KB:
        return 40
    if nbytes <= KB * KB:
        return 15
    if nbytes <= 16 * KB * KB:
        return 4
    return 2


def main() -> None:
    parser = sweep_parser(__doc__)
    parser.add_argument("--no-ucx", action="store_true", help="skip the UCX transport")
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, 2))

    # ucxx's UCX libraries must be loaded before MPI loads the mpich wheel's own copy.
    from mp_comm.transport.ucx import preload_before_mpi, ucx_available

    preload_before_mpi()
    import torch
    import torch.distributed as dist

    from mp_comm.message import numpy_bytes
    from mp_comm.transport import MPITransport, TransportConfig
    from mp_comm.transport.mpi import import_mpi
    from mp_comm.world import init_world

    world = init_world()
    rank, peer = world.rank, 1 - world.rank
    comm = world.mpi_comm.Dup()
    mpi = import_mpi()
    config = TransportConfig(timeout=120.0)
    ours_mpi = MPITransport(world.mpi_comm, config=config)
    ours_ucx = None
    if not args.no_ucx and ucx_available():
        from mp_comm.transport import UCXTransport

        try:
            ours_ucx = UCXTransport.from_world(world, config=config)
        except Exception as exc:
            if rank == 0:
                print(f"UCX transport unavailable: {exc}", file=sys.stderr)

    object_layer = _object_layer_us(reps=5 if args.quick else 15)
    sizes = QUICK_SIZES if args.quick else SIZES
    reps = args.reps or (3 if args.quick else 7)
    tensors = {n: torch.ones(n, dtype=torch.uint8) for n in sizes}
    inbox = {n: torch.empty(n, dtype=torch.uint8) for n in sizes}

    def raw_mpi(n: int, iters: int) -> None:
        out, into = numpy_bytes(tensors[n]), numpy_bytes(inbox[n])
        for _ in range(iters):
            if rank == 0:
                comm.Send(out, peer, 5)
                comm.Recv(into, peer, 5)
            else:
                comm.Recv(into, peer, 5)
                comm.Send(out, peer, 5)

    header = bytearray(16)
    probe_status = mpi.Status()

    def two_message_send(n: int) -> None:
        struct.pack_into("<qq", header, 0, n, 0)
        reqs = [comm.Isend([header, mpi.BYTE], peer, 6), comm.Isend(numpy_bytes(tensors[n]), peer, 7)]
        mpi.Request.Waitall(reqs)

    def two_message_recv() -> None:
        while (msg := comm.Improbe(mpi.ANY_SOURCE, 6, probe_status)) is None:
            pass
        source = probe_status.Get_source()
        got = bytearray(probe_status.Get_count(mpi.BYTE))
        msg.Recv([got, mpi.BYTE])
        size = struct.unpack_from("<q", got)[0]
        req = comm.Irecv([numpy_bytes(inbox[size]), mpi.BYTE], source, 7)
        while not req.Test():
            pass

    def two_message(n: int, iters: int) -> None:
        for _ in range(iters):
            if rank == 0:
                two_message_send(n)
                two_message_recv()
            else:
                two_message_recv()
                two_message_send(n)

    def transport(t: Any, static: bool = False) -> Callable[[int, int], None]:
        def run(n: int, iters: int) -> None:
            x = tensors[n]
            for _ in range(iters):
                if rank == 0:
                    t.send(x, peer, 5, static=static)
                    t.recv(peer, 5)
                else:
                    got = t.recv(peer, 5).obj
                    t.send(got, peer, 5, static=static)

        return run

    def gloo(n: int, iters: int) -> None:
        x, into = tensors[n], inbox[n]
        for _ in range(iters):
            if rank == 0:
                dist.send(x, peer)
                dist.recv(into, peer)
            else:
                dist.recv(into, peer)
                dist.send(x, peer)

    Run = Callable[[int, int], None]

    def paths(raw: Run, ours: Callable[..., Run], peer_path: Run, **more: Run) -> dict[str, Run]:
        """The variants of one measurement, by name: raw MPI, `more`, mp's transports, gloo."""
        out = {"mpi4py": raw, **more, "mp-mpi": ours(ours_mpi), "mp-mpi-static": ours(ours_mpi, static=True)}
        out["gloo"] = peer_path
        if ours_ucx is not None:
            out["mp-ucx"] = ours(ours_ucx)
        return out

    variants = paths(raw_mpi, transport, gloo, **{"mpi4py-2msg": two_message})

    stream_sizes = [n for n in sizes if n >= STREAM_MIN]
    into = {n: [torch.empty(n, dtype=torch.uint8) for _ in range(_window(n))] for n in stream_sizes}
    ack_out, ack_in = torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)

    def raw_mpi_stream(n: int, windows: int) -> None:
        out = numpy_bytes(tensors[n])
        for _ in range(windows):
            if rank == 0:
                mpi.Request.Waitall([comm.Isend(out, peer, 8) for _ in range(_window(n))])
                comm.Recv(numpy_bytes(ack_in), peer, 9)
            else:
                mpi.Request.Waitall([comm.Irecv(numpy_bytes(b), peer, 8) for b in into[n]])
                comm.Send(numpy_bytes(ack_out), peer, 9)

    def transport_stream(t: Any, static: bool = False) -> Callable[[int, int], None]:
        def run(n: int, windows: int) -> None:
            x = tensors[n]
            for _ in range(windows):
                if rank == 0:
                    handles = [t.send(x, peer, 8, static=static) for _ in range(_window(n))]
                    t.recv(peer, 9)
                    for handle in handles:
                        handle.wait()
                else:
                    for _ in range(_window(n)):
                        t.recv(peer, 8)
                    t.send(None, peer, 9)

        return run

    def gloo_stream(n: int, windows: int) -> None:
        for _ in range(windows):
            if rank == 0:
                for work in [dist.isend(tensors[n], peer) for _ in range(_window(n))]:
                    work.wait()
                dist.recv(ack_in, peer)
            else:
                for work in [dist.irecv(b, peer) for b in into[n]]:
                    work.wait()
                dist.send(ack_out, peer)

    streams = paths(raw_mpi_stream, transport_stream, gloo_stream)

    # Warm-up: every path once at every size.
    for fn in variants.values():
        for n in sizes:
            fn(n, 2)
    for fn in streams.values():
        for n in stream_sizes:
            fn(n, 1)
    samples: dict[str, dict[int, list[float]]] = {v: {n: [] for n in sizes} for v in variants}
    stream_samples: dict[str, dict[int, list[float]]] = {v: {n: [] for n in stream_sizes} for v in streams}
    names, stream_names = list(variants), list(streams)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    for rep in range(reps):
        order = rotated(names, rep)
        for n in sizes:
            for name in order:
                iters = _iterations(n)
                comm.Barrier()
                t0 = time.perf_counter()
                variants[name](n, iters)
                one_way = (time.perf_counter() - t0) / (2 * iters)
                samples[name][n].append(comm.bcast(one_way, root=0))
        order = rotated(stream_names, rep)
        for n in stream_sizes:
            for name in order:
                comm.Barrier()
                t0 = time.perf_counter()
                streams[name](n, STREAM_WINDOWS)
                gb_per_s = STREAM_WINDOWS * _window(n) * n / (time.perf_counter() - t0) / 1e9
                stream_samples[name][n].append(comm.bcast(gb_per_s, root=0))
    elapsed = time.monotonic() - started
    load = (load_before, os.getloadavg()[0])

    if ours_ucx is not None:
        ours_ucx.close()
    ours_mpi.close()
    comm.Free()
    if rank == 0:
        _report(
            samples,
            sizes,
            reps,
            elapsed,
            load,
            stream_samples=stream_samples,
            object_layer=object_layer,
            bound=world.info.bound,
        )
    world.shutdown()


def _object_layer_us(reps: int, batch: int = 500) -> list[float]:
    """CPU microseconds per send + recv of a 1 KB tensor over a one-rank loopback transport, per batch."""
    import torch

    from mp_comm.transport import LoopbackTransport

    t = LoopbackTransport.single()
    x = torch.ones(KB, dtype=torch.uint8)
    for _ in range(batch):  # warm-up
        t.send(x, 0, 5)
        t.recv(0, 5)
    out = []
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(batch):
            t.send(x, 0, 5)
            t.recv(0, 5)
        out.append((time.thread_time() - t0) / batch * 1e6)
    t.close()
    return out


def _report(
    samples: dict[str, dict[int, list[float]]],
    sizes: list[int],
    reps: int,
    elapsed: float,
    load: tuple[float, float],
    *,
    stream_samples: dict[str, dict[int, list[float]]],
    object_layer: list[float],
    bound: bool,
) -> None:
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_size in samples.items():
        results[name] = {}
        for n in sizes:
            t = statistics.median(by_size[n])
            best = min(by_size[n])
            results[name][str(n)] = {
                "one_way_us": t * 1e6,
                "gb_per_s": n / t / 1e9,
                "best_one_way_us": best * 1e6,
                "best_gb_per_s": n / best / 1e9,
            }

    def paired(name: str, other: str, n: int) -> float:
        # Bandwidth ratio name/other within each repetition (they ran seconds apart), median over reps:
        # robust to the host's load changing between repetitions.
        return statistics.median(o / s for s, o in zip(samples[name][n], samples[other][n], strict=True))

    def ratio(name: str, n: int) -> float:
        return paired(name, "mpi4py", n)

    ratios = {name: {str(n): ratio(name, n) for n in sizes} for name in results if name != "mpi4py"}
    decision = "mpi"
    reason = "UCX transport not measured (ucxx missing or not startable)"
    if "mp-ucx" in results:
        rel = [paired("mp-ucx", "mp-mpi", n) for n in sizes]
        geo = statistics.geometric_mean(rel)
        wins = sum(r > 1 for r in rel)
        decision = "ucx" if geo > 1.0 and wins > len(sizes) // 2 else "mpi"
        reason = (
            f"mp-ucx/mp-mpi bandwidth: geometric mean {geo:.2f} over {len(sizes)} sizes, UCX faster at "
            f"{wins} of them"
        )
    small = sizes[0]
    hop = [(m - r) * 1e6 for m, r in zip(samples["mp-mpi"][small], samples["mpi4py"][small], strict=True)]
    per_message = {
        "object_layer_cpu_us": statistics.median(object_layer),
        "object_layer_cpu_us_range": [min(object_layer), max(object_layer)],
        "hop_overhead_us": statistics.median(hop),
        "hop_overhead_us_range": [min(hop), max(hop)],
        "hop_size_bytes": small,
    }
    large = [n for n in sizes if n >= KB * KB]
    raws = [v for v in ("mpi4py", "gloo") if v in results]
    best_raw = {str(n): max(raws, key=lambda v: results[v][str(n)]["gb_per_s"]) for n in large}
    vs_best = {str(n): paired("mp-mpi", best_raw[str(n)], n) for n in large}
    static_vs_best = {str(n): paired("mp-mpi-static", best_raw[str(n)], n) for n in large}
    floor = {
        str(n): {
            "floor_vs_mpi4py": ratio("mpi4py-2msg", n),
            "mp_vs_floor": paired("mp-mpi", "mpi4py-2msg", n),
        }
        for n in large
    }
    targets = {
        "bandwidth_ge_0.9x_best_raw_at_1MB_plus": {
            "met": all(r >= 0.9 for r in vs_best.values()),
            "ratio_by_size": vs_best,
            "best_raw_by_size": best_raw,
        },
        "static_bandwidth_ge_0.9x_best_raw_at_1MB_plus": {
            "met": all(r >= 0.9 for r in static_vs_best.values()),
            "ratio_by_size": static_vs_best,
        },
        "object_layer_lt_50us": {"met": per_message["object_layer_cpu_us"] < 50.0},
    }
    stream_sizes = [n for n in sizes if n >= STREAM_MIN]
    streaming = {
        name: {str(n): statistics.median(by_size[n]) for n in stream_sizes}
        for name, by_size in stream_samples.items()
    }

    def stream_paired(name: str, other: str, n: int) -> float:
        return statistics.median(
            a / b for a, b in zip(stream_samples[name][n], stream_samples[other][n], strict=True)
        )

    stream_ratios = {
        name: {str(n): stream_paired(name, "mpi4py", n) for n in stream_sizes}
        for name in streaming
        if name != "mpi4py"
    }
    stream_large = [n for n in stream_sizes if n >= KB * KB]
    stream_raws = [v for v in ("mpi4py", "gloo") if v in streaming]
    stream_best = {str(n): max(stream_raws, key=lambda v: streaming[v][str(n)]) for n in stream_large}
    for key, name in (("streaming", "mp-mpi"), ("streaming_static", "mp-mpi-static")):
        by_size = {str(n): stream_paired(name, stream_best[str(n)], n) for n in stream_large}
        targets[f"{key}_bandwidth_ge_0.9x_best_raw_at_1MB_plus"] = {
            "met": all(r >= 0.9 for r in by_size.values()),
            "ratio_by_size": by_size,
            "best_raw_by_size": stream_best,
        }
    payload = {
        "benchmark": "comm_p2p",
        "method": "ping-pong of one CPU uint8 tensor between 2 ranks on one host; one-way time = round "
        "trip / 2; median over interleaved repetitions. Streaming: windows of messages sent back to back "
        "and one acknowledgement (osu_bw style); GB/s = bytes / time",
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "rank0_cpus": sorted(os.sched_getaffinity(0)),
            "bound": bound,
            "python": platform.python_version(),
            "load_average_1min": {"start": load[0], "end": load[1]},
        },
        "repetitions": reps,
        "elapsed_s": elapsed,
        "sizes": sizes,
        "results": results,
        "ratio_to_mpi4py": ratios,
        "streaming": {
            "window_by_size": {str(n): _window(n) for n in stream_sizes},
            "gb_per_s": streaming,
            "ratio_to_mpi4py": stream_ratios,
        },
        "cpu_default_route": decision,
        "cpu_default_reason": reason,
        "per_message": per_message,
        "two_message_floor": floor,
        "targets": targets,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "comm_p2p.json").write_text(json.dumps(payload, indent=2) + "\n")
    order = ("mpi4py", "mpi4py-2msg", "mp-mpi", "mp-mpi-static", "mp-ucx", "gloo")
    names = [n for n in order if n in results]
    lines = [
        "# comm_p2p: point-to-point ping-pong and streaming, 2 ranks, one host (CPU tensors)",
        "",
        f"Median of {reps} interleaved repetitions; GB/s = size / one-way time; (x) = bandwidth ratio to "
        "mpi4py (the bound), paired within each repetition, median over repetitions. The host is shared "
        "and noisy: compare ratios, not absolute numbers. `python -m benchmarks.comm_p2p` regenerates "
        "this file.",
        "",
        f"Host: {os.cpu_count()} CPUs, 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at "
        "the end (other processes shared the host). "
        + (
            "Each rank is bound to a core of its own, as mp-launch binds ranks by default."
            if bound
            else "The ranks are not bound to cores."
        ),
        "",
        "| size | "
        + " | ".join(f"{n} GB/s" for n in names)
        + " | "
        + " | ".join(f"{n} µs" for n in names)
        + " |",
        "|---:|" + "---:|" * (2 * len(names)),
    ]
    for n in sizes:
        cells = []
        for name in names:
            gbps = results[name][str(n)]["gb_per_s"]
            cells.append(f"{gbps:.2f}" if name == "mpi4py" else f"{gbps:.2f} ({ratio(name, n):.2f}x)")
        cells += [f"{results[name][str(n)]['one_way_us']:.0f}" for name in names]
        lines.append(f"| {_human(n)} | " + " | ".join(cells) + " |")
    snames = [n for n in order if n in streaming]
    lines += [
        "",
        "Streaming (bandwidth as osu_bw measures it): windows of messages back to back, one acknowledgement "
        f"per window, {STREAM_WINDOWS} windows per cell; GB/s = bytes / time; (x) = ratio to mpi4py, paired "
        "within each repetition.",
        "",
        "| size | window | " + " | ".join(f"{n} GB/s" for n in snames) + " |",
        "|---:|---:|" + "---:|" * len(snames),
    ]
    for n in stream_sizes:
        cells = [
            f"{streaming[name][str(n)]:.2f}"
            if name == "mpi4py"
            else f"{streaming[name][str(n)]:.2f} ({stream_ratios[name][str(n)]:.2f}x)"
            for name in snames
        ]
        lines.append(f"| {_human(n)} | {_window(n)} | " + " | ".join(cells) + " |")

    def verdict(key: str) -> str:
        target = targets[key]
        met = "**met**" if target["met"] else "**not met**"
        sizes_ = ", ".join(f"{_human(int(n))} {r:.2f}x" for n, r in target["ratio_by_size"].items())
        return f"{met} ({sizes_})"

    lines += [
        "",
        f"CPU default route: **{decision}** ({reason}).",
        "",
        "Per message: object layer (1 KB tensor, send + recv over a one-rank loopback transport, CPU time "
        f"of the thread) **{per_message['object_layer_cpu_us']:.0f} µs** (batches: "
        f"{min(object_layer):.0f}-{max(object_layer):.0f}); per hop over MPI (mp-mpi minus mpi4py one-way "
        f"at {_human(small)}) **{per_message['hop_overhead_us']:.0f} µs** (repetitions: "
        f"{min(hop):.0f}-{max(hop):.0f}).",
        "",
        "Where the gap is, at >= 1 MB: the two-message protocol in plain Python (mpi4py-2msg) reaches "
        + ", ".join(f"{_human(n)} {floor[str(n)]['floor_vs_mpi4py']:.2f}x" for n in large)
        + " of mpi4py; mp-mpi reaches "
        + ", ".join(f"{_human(n)} {floor[str(n)]['mp_vs_floor']:.2f}x" for n in large)
        + " of mpi4py-2msg (what mp's objects, mailbox and threads cost).",
        "",
        "Targets: mp-mpi >= 0.9x the better raw path at >= 1 MB (better raw path: "
        + ", ".join(f"{_human(n)} {best_raw[str(n)]}" for n in large)
        + "), in ping-pong: "
        + verdict("bandwidth_ge_0.9x_best_raw_at_1MB_plus")
        + ", with static sends: "
        + verdict("static_bandwidth_ge_0.9x_best_raw_at_1MB_plus")
        + "; streaming: "
        + verdict("streaming_bandwidth_ge_0.9x_best_raw_at_1MB_plus")
        + ", with static sends: "
        + verdict("streaming_static_bandwidth_ge_0.9x_best_raw_at_1MB_plus")
        + ". Object layer < 50 µs: "
        + ("**met**" if targets["object_layer_lt_50us"]["met"] else "**not met**")
        + ".",
        "",
    ]
    (RESULTS / "comm_p2p.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _human(n: int) -> str:
    return f"{n // (KB * KB)} MB" if n >= KB * KB else f"{n // KB} KB"


if __name__ == "__main__":
    main()
