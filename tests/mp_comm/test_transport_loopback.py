"""The transport semantics every transport shares, on the in-process loopback transport.

Matching by (source, tag) or any source, one sender's order, several senders and receivers at once,
timeouts that name the peer and the tag, closing, and the mailbox's reordering.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from mp_comm.errors import PeerLostError, PeerTimeoutError, TransportClosedError
from mp_comm.transport import ANY_SOURCE, ANY_TAG, LoopbackHub, LoopbackTransport, Mailbox, TransportConfig
from mp_comm.transport.base import Arrival, SendHandle

FAST = TransportConfig(timeout=5.0)


def test_world_of_one_sends_to_itself() -> None:
    with LoopbackTransport.single(config=FAST) as t:
        t.send({"x": torch.arange(3)}, 0, tag=7).wait()
        source, tag, obj = t.recv()
        assert (source, tag) == (0, 7) and torch.equal(obj["x"], torch.arange(3))
    assert t.closed


def test_receive_by_tag_in_any_order_and_from_any_source() -> None:
    hub = LoopbackHub(3, config=FAST)
    t0, t1, t2 = (hub.transport(r) for r in range(3))
    for tag in range(5):
        t1.send(("from1", tag), 0, tag)
    t2.send("from2", 0, "x")
    assert [t0.recv(1, tag).obj for tag in [4, 0, 3, 1, 2]] == [("from1", t) for t in [4, 0, 3, 1, 2]]
    assert t0.recv(ANY_SOURCE, "x") == (2, "x", "from2")
    for t in (t0, t1, t2):
        t.close()


def test_one_senders_messages_arrive_in_send_order() -> None:
    hub = LoopbackHub(2, config=FAST)
    a, b = hub.transport(0), hub.transport(1)
    rng = random.Random(0)
    for i in range(50):
        a.send((i, torch.randn(rng.choice([1, 100, 5000]))), 1, tag=rng.choice(["p", "q"]))
    got = [b.recv(0, ANY_TAG).obj[0] for _ in range(50)]
    assert got == list(range(50))
    a.close()
    b.close()


def test_many_senders_many_receiving_threads() -> None:
    n_ranks, per_sender = 4, 60
    hub = LoopbackHub(n_ranks, config=FAST)
    ts = [hub.transport(r) for r in range(n_ranks)]
    received: list[tuple[int, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def send_all(rank: int) -> None:
        try:
            for i in range(per_sender):
                ts[rank].send((rank, i, torch.full((i % 7,), float(i))), 0, tag=i % 3)
        except BaseException as exc:
            errors.append(exc)

    def receive(count: int) -> None:
        try:
            for _ in range(count):
                source, tag, (rank, i, x) = ts[0].recv(timeout=5.0)
                assert source == rank and tag == i % 3 and torch.equal(x, torch.full((i % 7,), float(i)))
                with lock:
                    received.append((rank, i))
        except BaseException as exc:
            errors.append(exc)

    total = (n_ranks - 1) * per_sender
    threads = [threading.Thread(target=receive, args=(total // 3,)) for _ in range(3)]
    threads += [threading.Thread(target=send_all, args=(r,)) for r in range(1, n_ranks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    assert sorted(received) == [(r, i) for r in range(1, n_ranks) for i in range(per_sender)]
    for t in ts:
        t.close()


def test_timeout_names_the_peer_the_tag_and_what_is_waiting() -> None:
    hub = LoopbackHub(2, config=FAST)
    a, b = hub.transport(0), hub.transport(1)
    a.send("other", 1, tag="b")
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"rank 0 with tag 'a' within 0.2 s.*\(0, 'b'\)") as info:
        b.recv(0, "a", timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert info.value.peer == 0 and info.value.tag == "a" and info.value.waited == 0.2
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(PeerTimeoutError, match="any rank"):
        b.recv(ANY_SOURCE, "zzz", timeout=0.0)
    assert b.recv(0, "b").obj == "other"
    a.close()
    b.close()


def test_default_timeout_comes_from_the_config() -> None:
    t = LoopbackTransport.single(config=TransportConfig(timeout=0.1))
    with pytest.raises(PeerTimeoutError, match=r"0\.1 s"):
        t.recv()
    t.close()


def test_close_wakes_waiting_threads_and_refuses_new_calls() -> None:
    hub = LoopbackHub(2, config=FAST)
    a, b = hub.transport(0), hub.transport(1)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            b.recv(0, "never", timeout=10.0)
        except BaseException as exc:
            caught.append(exc)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.05)
    b.close()
    th.join(5)
    assert not th.is_alive() and isinstance(caught[0], TransportClosedError)
    with pytest.raises(TransportClosedError):
        b.recv()
    with pytest.raises(TransportClosedError):
        b.send(1, 0)
    with pytest.raises(TransportClosedError, match="rank 1"):
        a.send(1, 1)  # the peer is gone
    b.close()  # idempotent
    a.close()


def test_bad_arguments_are_refused_by_name() -> None:
    t = LoopbackHub(2, config=FAST).transport(0)
    with pytest.raises(ValueError, match=r"dest=5.*\[0, 2\)"):
        t.send(1, 5)
    with pytest.raises(ValueError, match="not hashable"):
        t.send(1, 1, tag=["list"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source=-3"):
        t.recv(-3)
    with pytest.raises(ValueError, match="timeout"):
        TransportConfig(timeout=float("inf"))
    with pytest.raises(ValueError, match="poll_min"):
        TransportConfig(poll_min=1.0, poll_max=0.1)
    for bad in (0.0, float("inf")):
        with pytest.raises(ValueError, match="poll_busy"):
            TransportConfig(poll_busy=bad)
        with pytest.raises(ValueError, match="poll_busy_idle"):
            TransportConfig(poll_busy_idle=bad)
    t.close()


def test_mailbox_holds_back_messages_that_overtook_an_earlier_one() -> None:
    box = Mailbox()
    box.deliver(Arrival(1, "t", 1, b"second"))
    box.deliver(Arrival(2, "t", 0, b"other sender"))
    assert box.take(ANY_SOURCE, ANY_TAG, 1.0).body == b"other sender"
    with pytest.raises(PeerTimeoutError, match="held back"):
        box.take(1, "t", 0.05)
    box.deliver(Arrival(1, "t", 0, b"first"))
    assert [box.take(1, "t", 1.0).body for _ in range(2)] == [b"first", b"second"]


def test_mailbox_peer_failure_reaches_waiters_after_delivered_messages() -> None:
    box = Mailbox()
    box.deliver(Arrival(3, "t", 0, b"delivered before the failure"))
    box.fail_peer(3, PeerLostError("rank 3 died", peer=3))
    assert box.take(3, "t", 1.0).body == b"delivered before the failure"
    with pytest.raises(PeerLostError, match="rank 3"):
        box.take(3, ANY_TAG, 1.0)
    with pytest.raises(PeerLostError):
        box.take(ANY_SOURCE, ANY_TAG, 1.0)


@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_driving_waiter_sleeps_between_polls_only_where_ranks_outnumber_cores(
    monkeypatch: pytest.MonkeyPatch, oversubscribed: bool
) -> None:
    from mp_comm.transport import mailbox

    pauses: list[str] = []
    monkeypatch.setattr(mailbox.os, "sched_yield", lambda: pauses.append("yield"))
    monkeypatch.setattr(mailbox.time, "sleep", lambda s: pauses.append(f"sleep {s:g}"))
    box = Mailbox()
    polls = iter(range(3))

    def drive() -> bool:  # works twice, then the message is there
        if next(polls) == 2:
            box.deliver(Arrival(0, "t", 0, b"x"))
        return True

    config = TransportConfig(timeout=5.0, poll_min=3e-5, oversubscribed=oversubscribed)
    assert box.take(0, "t", 5.0, drive=drive, config=config).body == b"x"
    assert pauses == (["sleep 3e-05"] * 2 if oversubscribed else ["yield"] * 2)


def test_send_handle() -> None:
    h = SendHandle(1, "t", default_timeout=0.05)
    assert not h.done()
    with pytest.raises(PeerTimeoutError, match=r"send to rank 1 with tag 't'"):
        h.wait()
    h.set_done()
    h.wait()
    h.wait(timeout=0)
    assert h.done() and h.exception() is None
    failed = SendHandle(2, 0, 1.0)
    failed.set_failed(RuntimeError("x"))
    failed.set_done()  # the first outcome wins
    with pytest.raises(RuntimeError):
        failed.wait()
    assert "failed" in repr(failed)
