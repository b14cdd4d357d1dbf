"""The UCX transport and the persistent-buffer manager of the D2D path.

UCX tests skip cleanly where ucxx is missing or cannot start; the buffer manager is tested always.
On CPU machines the D2D path (handshake, persistent buffers, MPI fallback) runs on host memory by
listing "cpu" in `UCXConfig.buffered_devices`.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from mp_comm.buffers import BufferManager
from mp_comm.errors import MessageEncodeError, PeerLostError, TransportUnavailableError
from mp_comm.transport import (
    ANY_SOURCE,
    ANY_TAG,
    LoopbackHub,
    MPITransport,
    ThreadBootstrap,
    TransportConfig,
)
from mp_comm.transport import ucx as ucx_mod
from mp_comm.transport.ucx import UCXConfig, UCXTransport, import_ucxx
from tests.mp_comm._payloads import bitwise_equal, rich_payload, same_message
from tests.mp_comm._ucx_cases import (
    D2D_ON_CPU,
    FAST,
    close_all,
    in_threads,
    needs_ucx,
    ucx_conflict,
    ucx_pair,
    ucx_problem,
)

# -- the buffer manager (always) -----------------------------------------------------------------------


def test_buffer_manager_first_fit_alignment_and_coalescing() -> None:
    m = BufferManager(4096, "cpu", alignment=256)
    assert not m.allocated and m.free == 4096
    a = m.reserve(100)
    b = m.reserve(600)
    c = m.reserve(256)
    assert a is not None and b is not None and c is not None
    assert (a.offset, b.offset, c.offset) == (0, 256, 1024) and a.nbytes == 100 and b.reserved == 768
    assert not m.allocated  # the memory comes with the first view, not with bookkeeping
    assert m.view(b).numel() == 600 and m.allocated and m.used == 1280
    assert m.reserve(4096) is None
    m.release(b)
    assert m.reserve(700) is not None  # first fit takes b's hole again
    m.release(a)
    m.release(c)
    assert m.largest_free < 4096  # the 700-byte region still splits the buffer
    with pytest.raises(ValueError, match="twice"):
        m.release(c)


def test_buffer_manager_reserves_all_or_nothing_and_returns_to_empty() -> None:
    m = BufferManager(2048, "cpu")
    assert m.reserve_all([1000, 1000, 1000]) is None and m.used == 0
    regions = m.reserve_all([512, 256, 1024])
    assert regions is not None and m.free == 256
    for r in reversed(regions):
        m.release(r)
    assert m.used == 0 and m.largest_free == 2048
    assert BufferManager(0, "cpu").reserve(1) is None
    with pytest.raises(ValueError, match="power of two"):
        BufferManager(10, "cpu", alignment=3)


def test_buffer_views_write_into_the_persistent_buffer() -> None:
    m = BufferManager(1024, "cpu")
    r = m.reserve(8)
    assert r is not None
    m.view(r).copy_(torch.arange(8, dtype=torch.uint8))
    assert m.buffer[r.offset : r.offset + 8].tolist() == list(range(8))


def test_missing_ucxx_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ucxx._lib", None)
    monkeypatch.setitem(sys.modules, "ucxx._lib.arr", None)
    with pytest.raises(TransportUnavailableError, match=r"mp-comm\[ucx\]"):
        import_ucxx()
    assert not ucx_mod.ucx_available()


# -- two ranks in one process --------------------------------------------------------------------------


@needs_ucx
def test_objects_round_trip_over_ucx() -> None:
    a, b = ucx_pair()
    h = a.send(rich_payload(0), 1, tag="p")
    b.send(rich_payload(1), 0, tag="p")
    assert same_message(b.recv(0, "p").obj, rich_payload(0))
    assert same_message(a.recv(ANY_SOURCE, ANY_TAG).obj, rich_payload(1))
    h.wait()
    assert a.same_node == [True, True]
    close_all([a, b])
    assert not [th for th in threading.enumerate() if th.name.startswith("mp-comm-ucx")]


@needs_ucx
def test_d2d_path_lands_in_the_persistent_buffer_or_goes_direct_when_full() -> None:
    a, b = ucx_pair(D2D_ON_CPU)
    small = torch.randn(20_000)  # 80 KB: fits the 1 MB receive buffer
    large = torch.randn(400_000)  # 1.6 MB: does not; without a fallback transport it goes direct
    for x in (small, large, small.reshape(100, 200).T):
        a.send({"x": x, "tiny": torch.ones(3)}, 1, tag="d2d")
        got = b.recv(0, "d2d").obj
        assert bitwise_equal(got["x"], x) and got["x"].stride() == x.stride()
    a.send([small, small * 2, large], 1, tag="mixed")
    got = b.recv(0, "mixed").obj
    assert bitwise_equal(got[2], large) and bitwise_equal(got[1], small * 2)
    assert a.stats["d2d_buffered"] == 2 and a.stats["d2d_direct"] == 2
    buf = b.recv_buffer("cpu")
    assert buf is not None and buf.used == 0  # every region went back
    sendbuf = a._send_buffers.get("cpu")
    assert sendbuf is None or sendbuf.used == 0
    close_all([a, b])


def _buffered_to_a_peer(node_keys: tuple[str, str]) -> dict[str, int]:
    ucx = UCXConfig(buffered_devices=("cpu",), host="127.0.0.1")  # default buffered_peers: cross-node
    boot = ThreadBootstrap.group(2)
    a, b = in_threads(lambda r: UCXTransport(boot[r], config=FAST, ucx=ucx, node_key=node_keys[r]), 2)
    x = torch.randn(20_000)
    a.send(x, 1, tag="b")
    assert bitwise_equal(b.recv(0, "b").obj, x)
    stats = {k: v for k, v in a.stats.items() if k.startswith("d2d")}
    close_all([a, b])
    return stats


@needs_ucx
def test_the_handshake_runs_for_peers_on_other_nodes_only_by_default() -> None:
    assert _buffered_to_a_peer(("n", "n")) == {}  # same node: UCX reads the tensor where it is
    assert _buffered_to_a_peer(("n0", "n1")) == {"d2d_buffered": 1}
    with pytest.raises(ValueError, match=r"buffered_peers='some'.*'cross-node' or 'all'"):
        UCXConfig(buffered_peers="some")  # type: ignore[arg-type]


@needs_ucx
def test_d2d_path_falls_back_to_the_other_transport_when_the_buffer_is_full() -> None:
    hub = LoopbackHub(2, config=FAST)  # stands in for MPI: any MessageTransport can be the fallback
    fallbacks = [hub.transport(0), hub.transport(1)]
    boot = ThreadBootstrap.group(2)
    a, b = in_threads(
        lambda r: UCXTransport(boot[r], config=FAST, ucx=D2D_ON_CPU, node_key="n", fallback=fallbacks[r]), 2
    )
    small, large = torch.randn(20_000), torch.randn(400_000)
    for x in (large, small, large):
        a.send({"x": x, "again": x}, 1, tag="fb")
        got = b.recv(0, "fb").obj
        assert bitwise_equal(got["x"], x) and got["again"] is got["x"]
    a.send([large, small], 1, tag="two").wait()  # large does not fit: the whole message falls back
    got = b.recv(0, "two").obj
    assert bitwise_equal(got[0], large) and bitwise_equal(got[1], small)
    assert (a.stats["d2d_fallback"], a.stats["d2d_buffered"]) == (3, 1)
    assert fallbacks[1].stats["received"] == 3 and b.stats["received"] == 4
    buf = b.recv_buffer("cpu")
    assert buf is not None and buf.used == 0
    close_all([a, b])
    for f in fallbacks:
        f.close()


@needs_ucx
def test_static_mode_over_ucx() -> None:
    a, b = ucx_pair(config=TransportConfig(timeout=20.0, static_shapes=True))
    for step in range(4):
        a.send(torch.full((64, 64), float(step)), 1, tag="act")
        assert float(b.recv(0, "act").obj[0, 0]) == step
    assert a.stats["static_hits"] == 3
    close_all([a, b])


@needs_ucx
def test_a_peer_that_goes_away_fails_the_waiting_thread_by_name() -> None:
    a, b = ucx_pair()
    a.send("hello", 1, tag=0)
    assert b.recv(0, 0).obj == "hello"
    start = time.monotonic()
    a.abort()  # endpoints closed without the closing handshake: b sees rank 0 go away
    with pytest.raises(PeerLostError, match="rank 0") as info:
        b.recv(0, "more", timeout=15.0)
    assert info.value.peer == 0 and time.monotonic() - start < 10.0
    b.abort()


@needs_ucx
def test_too_many_tensors_for_the_tag_space_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = ucx_pair()
    monkeypatch.setattr(ucx_mod, "MAX_TENSORS", 2)
    with pytest.raises(MessageEncodeError, match="at most 2"):
        a.send([torch.ones(1), torch.ones(2), torch.ones(3)], 1)
    close_all([a, b])


# -- a peer process that dies --------------------------------------------------------------------------


class _PipeBootstrap:
    """Two ranks in two processes, meeting over a multiprocessing pipe."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self.size = 2

    def allgather(self, obj: Any) -> list[Any]:
        self.conn.send(obj)
        other = self.conn.recv()
        return [obj, other] if self.rank == 0 else [other, obj]

    def barrier(self, timeout: float) -> bool:
        self.conn.send("barrier")
        return self.conn.poll(timeout) and self.conn.recv() == "barrier"

    def close(self) -> None:
        return None


def _child_that_dies(conn: Connection) -> None:
    import os

    t = UCXTransport(_PipeBootstrap(conn, 1), config=FAST, node_key="n")
    t.send("alive", 0, tag="hi").wait()
    time.sleep(0.2)
    os._exit(3)  # dies without closing anything


@needs_ucx
def test_a_peer_process_that_dies_is_detected_within_bounded_time() -> None:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child_that_dies, args=(there,))
    child.start()
    t = UCXTransport(_PipeBootstrap(here, 0), config=FAST, node_key="n")
    try:
        assert t.recv(1, "hi", timeout=60).obj == "alive"
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 1"):
            t.recv(1, "never", timeout=30.0)
        assert time.monotonic() - start < 20.0
    finally:
        t.abort()
        child.join(10)
    assert child.exitcode == 3


# -- real ranks: UCX with the MPI fallback ------------------------------------------------------------


def _ucx_with_fallback(world: Any) -> dict[str, Any]:
    problem = ucx_conflict()
    if problem is not None:
        return {"skip": problem}
    mpi = MPITransport(world.mpi_comm, config=FAST)
    t = UCXTransport.from_world(world, config=FAST, ucx=D2D_ON_CPU, fallback=mpi)
    peer = 1 - world.rank
    sizes = [10_000, 600_000, 50_000, 300_000, 10]  # 40 KB .. 2.4 MB against a 1 MB receive buffer
    for i, n in enumerate(sizes):
        x = torch.arange(n, dtype=torch.float32) * (world.rank + 1)
        t.send({"i": i, "x": x, "pair": [x[:5], x]}, peer, tag="f")
    for i, n in enumerate(sizes):
        got = t.recv(peer, "f").obj
        expected = torch.arange(n, dtype=torch.float32) * (peer + 1)
        assert got["i"] == i and torch.equal(got["x"], expected) and got["pair"][1] is got["x"]
    t.send(rich_payload(world.rank), peer, tag="all")
    assert same_message(t.recv(peer, "all").obj, rich_payload(peer))
    stats = dict(t.stats)
    t.close()
    mpi.close()
    return stats


def test_ucx_falls_back_to_mpi_when_the_persistent_buffer_is_full(worlds: Any) -> None:
    if ucx_problem() is not None:
        pytest.skip("ucxx is not installed or cannot start here")
    for stats in worlds.run(2, _ucx_with_fallback, timeout=90):
        if "skip" in stats:
            pytest.skip(stats["skip"])
        assert stats["d2d_buffered"] >= 2 and stats["d2d_fallback"] >= 2, stats


def _ucx_many_to_one(world: Any) -> Any:
    problem = ucx_conflict()
    if problem is not None:
        return {"skip": problem}
    t = UCXTransport.from_world(world, config=FAST)
    if world.rank:
        for i in range(20):
            t.send((world.rank, i, torch.full((i * 1000,), float(i))), 0, tag=i % 2)
        got: list[tuple[int, int]] = []
    else:
        got = []
        for _ in range(3 * 20):
            source, _, (rank, i, x) = t.recv(ANY_SOURCE, ANY_TAG)
            assert source == rank and x.numel() == i * 1000
            got.append((rank, i))
        for r in (1, 2, 3):
            assert [i for rank, i in got if rank == r] == list(range(20))  # each sender's order
    t.close()
    return sorted(got)


def test_ucx_any_source_from_three_senders(worlds: Any) -> None:
    if ucx_problem() is not None:
        pytest.skip("ucxx is not installed or cannot start here")
    got = worlds.run(4, _ucx_many_to_one, timeout=90)[0]
    if isinstance(got, dict):
        pytest.skip(got["skip"])
    assert got == [(r, i) for r in (1, 2, 3) for i in range(20)]


def _ucx_cuda(world: Any) -> Any:
    problem = ucx_conflict()
    if problem is not None:
        return problem
    mpi = MPITransport(world.mpi_comm, config=FAST)
    ucx = UCXConfig(recv_buffer_bytes=1 << 20, buffered_peers="all")  # the handshake within the node too
    t = UCXTransport.from_world(world, config=FAST, ucx=ucx, fallback=mpi)
    peer = 1 - world.rank
    small = torch.randn(1000, device="cuda")
    big = torch.randn(1 << 20, device="cuda")  # 4 MB: falls back to MPI
    t.send([small, big], peer, tag="c")
    got = t.recv(peer, "c").obj
    t.send([got[0], got[1]], peer, tag="back")
    back = t.recv(peer, "back").obj
    ok = (
        all(g.device.type == "cuda" for g in got)
        and torch.equal(back[0], small)
        and torch.equal(back[1], big)
    )
    t.close()
    mpi.close()
    return bool(ok)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_d2d_path_with_fallback(worlds: Any) -> None:
    if ucx_problem() is not None:
        pytest.skip("ucxx is not installed or cannot start here")
    result = worlds.run(2, _ucx_cuda, timeout=120)
    if isinstance(result[0], str):
        pytest.skip(result[0])
    assert result == [True, True]


# -- bootstraps ----------------------------------------------------------------------------------------


def _bootstraps(world: Any) -> list[Any]:
    from mp_comm.transport import MPIBootstrap, TorchBootstrap, bootstrap_for_world

    out = []
    for boot in (MPIBootstrap(world.mpi_comm), TorchBootstrap(), bootstrap_for_world(world)):
        out.append((boot.rank, boot.size, boot.allgather(("r", world.rank)), boot.barrier(10.0)))
        boot.close()
    return out


def test_bootstraps_gather_in_rank_order_and_meet(worlds: Any) -> None:
    for rank, result in enumerate(worlds.run(2, _bootstraps, timeout=60)):
        assert result == [(rank, 2, [("r", 0), ("r", 1)], True)] * 3


def test_thread_bootstrap_barrier_times_out_alone() -> None:
    boots = ThreadBootstrap.group(2)
    assert boots[0].barrier(0.05) is False
    assert in_threads(lambda r: boots[r].allgather(r * 10), 2) == [[0, 10], [0, 10]]
    assert in_threads(lambda r: boots[r].barrier(5.0), 2) == [True, True]
