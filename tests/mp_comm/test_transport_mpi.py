"""The MPI transport between real processes (the reused mpiexec worlds of tests/_harness.py)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from mp_comm.errors import MessageDecodeError, PeerTimeoutError, TransportUnavailableError
from mp_comm.transport import ANY_SOURCE, ANY_TAG, MPITransport, TransportConfig
from mp_comm.transport.mpi import check_thread_level
from tests.mp_comm._payloads import BoomOnLoad, rich_payload, same_message


def _open(world: Any, **config: Any) -> MPITransport:
    return MPITransport(world.mpi_comm, config=TransportConfig(timeout=20.0, **config))


def _exchange_both_ways(world: Any) -> bool:
    t = _open(world)
    peer = 1 - world.rank
    handle = t.send(rich_payload(world.rank), peer, tag="payload")
    source, tag, got = t.recv(peer, "payload")
    handle.wait()
    t.close()
    assert (source, tag) == (peer, "payload")
    assert isinstance(got["param"], torch.nn.Parameter)
    assert got["views"][0].stride() == rich_payload(peer)["views"][0].stride()
    return same_message(got, rich_payload(peer))


def test_objects_round_trip_both_ways_at_once(worlds: Any) -> None:
    assert worlds.run(2, _exchange_both_ways, timeout=60) == [True, True]


def _order_and_tags(world: Any) -> list[Any]:
    t = _open(world)
    rng = random.Random(1)
    sizes = [rng.choice([0, 3, 2000, 300_000]) for _ in range(40)]
    if world.rank == 0:
        handles = [t.send((i, torch.ones(n)), 1, tag=f"t{i % 4}") for i, n in enumerate(sizes)]
        for tag in [3, 1, 0, 2]:
            t.send(tag, 1, tag=("late", tag))
        for h in handles:
            h.wait()
        result: list[Any] = []
    else:
        # One sender's messages come in send order, whatever their sizes (large payloads finish later).
        got = [t.recv(0, ANY_TAG) for _ in range(40)]
        assert [obj[0] for _, _, obj in got] == list(range(40))
        assert [obj[1].numel() for _, _, obj in got] == sizes
        # Taken by tag, in an order the sender did not use.
        result = [t.recv(0, ("late", tag)).obj for tag in range(4)]
    t.close()
    return result


def test_send_order_is_kept_and_tags_are_taken_in_any_order(worlds: Any) -> None:
    assert worlds.run(2, _order_and_tags, timeout=60)[1] == [0, 1, 2, 3]


def _many_to_one(world: Any, per_sender: int) -> Any:
    t = _open(world)
    if world.rank != 0:
        rng = random.Random(world.rank)
        handles = []
        for i in range(per_sender):
            n = rng.choice([1, 10, 50_000])
            handles.append(t.send((world.rank, i, torch.full((n,), float(i))), 0, tag=rng.randrange(3)))
        for h in handles:
            h.wait()
        t.close()
        return None
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    total = (world.size - 1) * per_sender

    def take(count: int) -> None:
        try:
            for _ in range(count):
                source, _, (rank, i, x) = t.recv(ANY_SOURCE, ANY_TAG)
                assert source == rank and bool((x == float(i)).all())
                with lock:
                    seen.append((rank, i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(total // 3,)) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    t.close()
    if errors:
        raise errors[0]
    return sorted(seen)


def test_many_senders_to_one_receiver_with_several_threads(worlds: Any) -> None:
    per_sender = 30
    result = worlds.run(4, _many_to_one, per_sender, timeout=90)[0]
    assert result == [(r, i) for r in range(1, 4) for i in range(per_sender)]


def _progress_while_computing(world: Any) -> float:
    t = _open(world)
    big = torch.ones(8 << 20, dtype=torch.uint8)
    world.mpi_comm.Barrier()
    if world.rank == 0:
        start = time.monotonic()
        t.send(big, 1, tag="big").wait(timeout=10.0)  # rank 1 is "computing" all this while
        waited = time.monotonic() - start
        world.mpi_comm.Barrier()
    else:
        time.sleep(2.0)  # no transport call here: only the progress thread can take the payload
        world.mpi_comm.Barrier()
        assert t.recv(0, "big").obj.numel() == big.numel()
        waited = 0.0
    t.close()
    return waited


def test_progress_thread_moves_data_while_the_receiver_computes(worlds: Any) -> None:
    waited = worlds.run(2, _progress_while_computing, timeout=60)[0]
    assert waited < 1.8  # the send completed before the receiver returned from its computation


def _busy_rank(world: Any) -> dict[str, float]:
    t = _open(world, poll_busy=0.05)
    big = torch.ones(8 << 20, dtype=torch.uint8)
    out: dict[str, float] = {}
    if world.rank == 1:

        def rounds_in(seconds: float) -> int:
            before = t.stats["rounds"]
            time.sleep(seconds)
            return t.stats["rounds"] - before

        out["idle_rounds"] = rounds_in(0.5)  # nothing in flight: naps of at most poll_max (1 ms)
        t.set_busy(True)
        out["busy_rounds"] = rounds_in(0.5)
        world.mpi_comm.Barrier()  # rank 0 sends now; this rank stays busy, out of the transport
        time.sleep(1.5)
        world.mpi_comm.Barrier()
        t.set_busy(False)
        out["resumed_rounds"] = rounds_in(0.5)
        assert t.recv(0, "big").obj.numel() == big.numel()
    else:
        world.mpi_comm.Barrier()
        start = time.monotonic()
        t.send(big, 1, tag="big").wait(timeout=10.0)
        out["send_s"] = time.monotonic() - start
        world.mpi_comm.Barrier()
    t.close()
    return out


def test_a_busy_rank_polls_rarely_and_still_makes_progress(worlds: Any) -> None:
    sender, busy = worlds.run(2, _busy_rank, timeout=60)
    assert busy["idle_rounds"] > 50  # ~500 on an idle host
    assert busy["busy_rounds"] <= 0.5 / 0.05 + 3  # one round per poll_busy
    assert busy["resumed_rounds"] > 50
    assert sender["send_s"] < 1.4  # taken by a busy round, before the rank's "compute" ended


def _busy_with_a_send_in_flight(world: Any) -> dict[str, int]:
    # Rank 1 is busy throughout. Rank 0 is busy too and looks in only every 5 s, so rank 1's large send
    # stays in flight (MPI's rendezvous waits for the receiver) until rank 0 is back.
    t = _open(world, poll_busy=0.01, poll_busy_idle=0.1 if world.rank == 1 else 5.0)
    big = torch.ones(8 << 20, dtype=torch.uint8)
    out: dict[str, int] = {}
    t.set_busy(True)
    time.sleep(0.05)  # the progress thread is in its busy rest now
    world.mpi_comm.Barrier()
    if world.rank == 1:

        def rounds_in(seconds: float) -> int:
            before = t.stats["rounds"]
            time.sleep(seconds)
            return t.stats["rounds"] - before

        out["quiet_rounds"] = rounds_in(0.5)  # nothing in flight: a round per poll_busy_idle
        handle = t.send(big, 0, tag="big")
        out["in_flight_rounds"] = rounds_in(0.5)  # its send may need it: a round per poll_busy
        world.mpi_comm.Barrier()
        handle.wait(timeout=10.0)
    else:
        world.mpi_comm.Barrier()
        t.set_busy(False)
        assert t.recv(1, "big").obj.numel() == big.numel()
    t.close()
    return out


def test_a_busy_rank_polls_often_only_while_a_transfer_of_its_own_is_in_flight(worlds: Any) -> None:
    busy = worlds.run(2, _busy_with_a_send_in_flight, timeout=60)[1]
    assert busy["quiet_rounds"] <= 0.5 / 0.1 + 3
    assert busy["in_flight_rounds"] >= 15  # ~50 on an idle host (0.5 s / 10 ms)


def _timeout_and_decode_errors(world: Any) -> list[str]:
    t = _open(world)
    messages: list[str] = []
    if world.rank == 1:
        start = time.monotonic()
        try:
            t.recv(0, "never", timeout=0.3)
        except PeerTimeoutError as exc:
            messages.append(str(exc))
            assert time.monotonic() - start < 3.0
        t.send([torch.ones(3), BoomOnLoad()], 0, tag=("req", 9))
        t.send("fine", 0, tag="after")
    else:
        try:
            t.recv(1, ("req", 9))
        except MessageDecodeError as exc:
            messages.append(str(exc))
            assert exc.peer == 1
        assert t.recv(1, "after").obj == "fine"
    t.close()
    return messages


def test_timeouts_and_unpicklable_messages_name_the_peer_and_tag(worlds: Any) -> None:
    rank0, rank1 = worlds.run(2, _timeout_and_decode_errors, timeout=60)
    assert "rank 0 with tag 'never' within 0.3 s" in rank1[0]
    assert "rank 1 with tag ('req', 9)" in rank0[0] and "cannot rebuild" in rank0[0]


def _static_mode(world: Any) -> tuple[int, int]:
    t = _open(world, static_shapes=True)
    peer = 1 - world.rank
    for step in range(6):
        shape = (4, 8) if step < 4 else (5, 8)
        x = torch.full(shape, float(step + world.rank))
        t.send({"act": x, "mb": step}, peer, tag="fwd")
        got = t.recv(peer, "fwd").obj
        assert got["mb"] == step and torch.equal(got["act"], torch.full(shape, float(step + peer)))
    hits = t.stats["static_hits"]
    t.close()
    return hits, t.stats["received"]


def test_static_mode_skips_metadata_for_repeated_shapes(worlds: Any) -> None:
    assert worlds.run(2, _static_mode, timeout=60) == [(4, 6), (4, 6)]


def _pooled_receives(world: Any) -> dict[str, Any]:
    from mp_comm.transport.base import POOL_MIN_BYTES

    t = _open(world)
    assert t.pool is not None
    peer = 1 - world.rank
    shape = (POOL_MIN_BYTES // 4,)  # float32: exactly the pool's threshold
    kept = []
    for step in range(6):
        t.send({"act": torch.full(shape, float(10 * step + world.rank)), "mb": step}, peer, tag="fwd")
        got = t.recv(peer, "fwd").obj
        if step < 3:
            kept.append(got)  # alive: each must keep its own memory
        else:
            assert torch.equal(got["act"], torch.full(shape, float(10 * step + peer)))
            del got  # dropped: its memory goes back to the pool for the next message
        t.send(b"ack", peer, tag="ack")
        t.recv(peer, "ack")
    small = t.send(torch.ones(16), peer, tag="small")
    below = t.recv(peer, "small").obj  # under the threshold: plain memory, not the pool's
    small.wait()
    intact = all(
        torch.equal(got["act"], torch.full(shape, float(10 * step + peer))) and got["mb"] == step
        for step, got in enumerate(kept)
    )
    storages = {got["act"].untyped_storage().data_ptr() for got in kept}
    out = {
        "intact": intact and torch.equal(below, torch.ones(16)),
        "distinct": len(storages) == len(kept),
        "hits": t.pool.hits,
        "misses": t.pool.misses,
    }
    t.close()
    return out


def test_large_receives_recycle_memory_without_aliasing(worlds: Any) -> None:
    """Received tensors of POOL_MIN_BYTES and more come from the pool: those kept alive each keep their
    own memory, and the memory of dropped ones serves the next message."""
    for r in worlds.run(2, _pooled_receives, timeout=60):
        assert r["intact"] and r["distinct"], r
        # steps 0-3 find the pool empty (0-2 are kept; 3 comes back), 4 and 5 reuse step 3's memory
        assert (r["misses"], r["hits"]) == (4, 2), r


def _self_send_and_reopen(world: Any) -> list[str]:
    for _ in range(3):
        t = _open(world)
        t.send({"me": world.rank}, world.rank, tag=0)
        assert t.recv(world.rank, 0).obj == {"me": world.rank}
        t.close()
        t.close()
    return [th.name for th in threading.enumerate() if th.name.startswith("mp-comm-mpi")]


def test_self_sends_and_close_leaves_no_threads(worlds: Any) -> None:
    assert worlds.run(2, _self_send_and_reopen, timeout=60) == [[], []]


def _doorbell(world: Any) -> dict[str, Any]:
    # No spinning, and naps of 2 s that only a ring cuts short (the progress thread looks in every 10 s).
    t = _open(world, spin_time=0.0, poll_min=2.0, poll_max=2.0, poll_busy_idle=10.0)
    comm = world.mpi_comm
    out: dict[str, Any] = {}
    if world.rank == 0:
        # rank 1 is not receiving (it waits in the barrier): nobody to ring. A send is rung (or not)
        # before its handle completes.
        for handle in [t.send(i, 1, tag="quiet") for i in range(5)]:
            handle.wait()
        out["quiet"] = (t.bell.rung, t.bell.skipped)
        comm.Barrier()
        time.sleep(0.5)  # rank 1 naps in recv by now: this send rings it
        t.send("wake", 1, tag="wake").wait()
        out["wake"] = (t.bell.rung, t.bell.skipped)
    else:
        comm.Barrier()
        assert [t.recv(0, "quiet").obj for _ in range(5)] == list(range(5))
        start = time.monotonic()
        assert t.recv(0, "wake").obj == "wake"
        out["waited"] = time.monotonic() - start
    comm.Barrier()
    t.close()
    return out


def test_the_doorbell_rings_only_a_rank_that_naps_and_its_ring_ends_the_nap(worlds: Any) -> None:
    sender, receiver = worlds.run(2, _doorbell, timeout=90)
    assert sender["quiet"] == (0, 5)  # no system call for a receiver that is not napping
    rung, skipped = sender["wake"]
    assert skipped == 5 and rung <= 1
    # rung 1: the ring ended the 2 s nap at once; rung 0 (a loaded host: the receiver armed after the
    # send), its last look before the nap found the message. A lost wake-up would wait the 2 s out.
    assert receiver["waited"] < 1.5, receiver


def _cuda_round_trip(world: Any) -> bool:
    t = _open(world)
    peer = 1 - world.rank
    x = torch.arange(1000, device="cuda", dtype=torch.float32) + world.rank
    t.send({"x": x}, peer, tag="cuda")
    got = t.recv(peer, "cuda").obj["x"]
    t.close()
    return got.device.type == "cuda" and bool(torch.equal(got.cpu(), torch.arange(1000.0) + peer))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_travel_through_host_staging(worlds: Any) -> None:
    assert worlds.run(2, _cuda_round_trip, timeout=60) == [True, True]


def test_thread_level_below_multiple_is_refused_with_the_fix() -> None:
    check_thread_level(3, 3)
    expected = r"MPI_THREAD_SERIALIZED.*MPI_THREAD_MULTIPLE.*thread_level"
    with pytest.raises(TransportUnavailableError, match=expected):
        check_thread_level(2, 3)


class _FakeInfo:
    class launcher:
        value = "torchrun"


class _FakeWorld:
    mpi_comm = None
    size = 2
    info = _FakeInfo()


def test_a_world_without_mpi_is_refused_by_name() -> None:
    with pytest.raises(TransportUnavailableError, match=r"torchrun.*mpiexec"):
        MPITransport.from_world(_FakeWorld())
