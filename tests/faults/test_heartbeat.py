"""The heartbeat (mp_comm.heartbeat) in one process: ranks as threads on loopback UDP sockets.

A rank that never beats is named after the timeout, with what this rank waits for from it; one that
says goodbye, or is merely slow, is not; datagrams without the job's MAC are not heard.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mp_comm import waits
from mp_comm.errors import WorldError
from mp_comm.heartbeat import Heartbeat, Peer, timeout_from_env
from mp_comm.transport import auth

TIMEOUT = 0.6
INTERVAL = 0.05


class Ranks:
    """`n` heartbeats of one job; `fired[r]` holds what rank r reported (silent ranks, report)."""

    def __init__(self, n: int) -> None:
        self.socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
        for s in self.socks:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        self.secret = auth.new_secret()
        peers = [Peer(r, "here", 1000 + r, s.getsockname(), f"pp_rank {r}") for r, s in enumerate(self.socks)]
        self.fired: dict[int, tuple[list[int], str]] = {}
        self.beats = [
            Heartbeat(
                r,
                peers,
                s,
                self.secret,
                TIMEOUT,
                interval=INTERVAL,
                on_silent=lambda report, silent, r=r: self.fired.setdefault(r, (silent, report)),
            )
            for r, s in enumerate(self.socks)
        ]

    def stop(self) -> None:
        for b in self.beats:
            b.stop()


@pytest.fixture
def ranks() -> object:
    made: list[Ranks] = []

    def make(n: int) -> Ranks:
        made.append(Ranks(n))
        return made[-1]

    yield make
    for r in made:
        r.stop()


def _wait_until(condition: object, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not condition():  # type: ignore[operator]
        time.sleep(0.02)


def test_a_silent_rank_is_named_with_what_the_others_wait_for(ranks: object) -> None:
    job = ranks(3)  # type: ignore[operator]
    job.beats[0].start()
    job.beats[1].start()  # rank 2 never beats: stopped
    with waits.waiting("the forward response of module 'layer'", 2):
        started = time.monotonic()
        _wait_until(lambda: 0 in job.fired and 1 in job.fired, 5 * TIMEOUT)
        took = time.monotonic() - started
    assert job.fired[0][0] == [2] and job.fired[1][0] == [2]
    assert TIMEOUT <= took < TIMEOUT + 0.5, took
    report = job.fired[0][1]
    assert report.startswith("rank 2 (pp_rank 2; host here, PID 1002) has sent no heartbeat"), report
    assert "Rank 0 noticed" in report
    # this rank's own wait, and rank 1's as its heartbeat carried it
    assert (
        "rank 0 (pp_rank 0; host here, PID 1000), now: waiting for the forward response of module " in report
    )
    assert re.search(
        r"rank 1 \(pp_rank 1; host here, PID 1001\), \d\.\d s ago: waiting for the forward", report
    )
    assert "from rank 2" in report and "main thread at" in report


def test_a_slow_rank_that_beats_and_a_rank_that_said_goodbye_are_not_named(ranks: object) -> None:
    job = ranks(3)  # type: ignore[operator]
    for b in job.beats:
        b.start()
    time.sleep(2 * INTERVAL)
    job.beats[2].stop()  # ended normally: says goodbye
    busy_until = time.monotonic() + 3 * TIMEOUT
    while time.monotonic() < busy_until:  # the main thread computes in Python: the thread still beats
        sum(i * i for i in range(10_000))
    assert job.fired == {}


def test_datagrams_without_the_job_mac_are_not_heard(ranks: object) -> None:
    job = ranks(2)  # type: ignore[operator]
    job.beats[0].start()
    forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    body = json.dumps({"r": 1, "k": "hb", "w": [], "f": ""}).encode()
    target = job.socks[0].getsockname()
    stop = threading.Event()

    def forge() -> None:  # a stranger pretends to be rank 1, alive, with a wrong secret and with none
        while not stop.is_set():
            forger.sendto(auth.seal(auth.new_secret(), 0x4842, body), target)
            forger.sendto(body, target)
            time.sleep(INTERVAL)

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    _wait_until(lambda: 0 in job.fired, 5 * TIMEOUT)
    stop.set()
    thread.join()
    forger.close()
    assert job.fired[0][0] == [1]


def test_the_setting_is_checked() -> None:
    assert timeout_from_env({}) == 30.0
    assert timeout_from_env({"MP_HEARTBEAT_TIMEOUT": "0"}) == 0.0
    assert timeout_from_env({"MP_HEARTBEAT_TIMEOUT": " 12.5 "}) == 12.5
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(WorldError, match=f"MP_HEARTBEAT_TIMEOUT='{bad}' is not a number of seconds"):
            timeout_from_env({"MP_HEARTBEAT_TIMEOUT": bad})


def _start(world: Any, timeouts: list[float]) -> str:
    from mp_comm import heartbeat

    try:
        beat = heartbeat.start(world, f"pp_rank {world.rank}", timeout=timeouts[world.rank])
    except WorldError as exc:
        return str(exc)
    assert beat is not None
    try:
        time.sleep(4 * beat.interval)
        other = 1 - world.rank
        return f"{beat.peers[other].name()} heard at {beat._heard[other].frame or 'nothing'}"
    finally:
        heartbeat.stop()


def test_started_over_the_world_each_rank_hears_the_other(worlds: Any) -> None:
    heard = worlds.run(2, _start, [1.0, 1.0], timeout=60)
    for rank, text in enumerate(heard):
        assert re.match(rf"rank {1 - rank} \(pp_rank {1 - rank}; host \S+, PID \d+\) heard at \S+:\d+", text)


def test_a_timeout_that_differs_between_ranks_is_refused_on_every_rank(worlds: Any) -> None:
    for text in worlds.run(2, _start, [1.0, 2.0], timeout=60):
        assert text.startswith("MP_HEARTBEAT_TIMEOUT differs between ranks ([1.0, 2.0])"), text


def _gloo_waits(world: Any) -> list[str]:
    """Rank 1 joins each collective 1 s late; rank 0 reports the waits registered while it blocks."""
    import torch
    import torch.distributed as dist

    from mp_comm.collectives import all_reduce_, all_reduce_async

    group = dist.new_group([0, 1], backend="gloo")  # no MPI twin: torch.distributed carries it
    seen: list[str] = []

    def look() -> None:
        time.sleep(0.5)
        seen.extend(waits.describe(w) for w in waits.current())

    for launch in (
        lambda: all_reduce_(torch.ones(4), group),
        lambda: all_reduce_async(torch.ones(4), group).wait(),
    ):
        if world.rank == 1:
            time.sleep(1.0)
            launch()
            continue
        thread = threading.Thread(target=look)
        thread.start()
        launch()
        thread.join()
    assert not waits.current()  # left on completion
    dist.destroy_process_group(group)
    return seen


def test_a_gloo_collective_registers_its_wait_with_the_group(worlds: Any) -> None:
    seen = worlds.run(2, _gloo_waits, timeout=60)[0]
    assert len(seen) == 2, seen
    for text in seen:
        expected = r"waiting for the gloo all_reduce over ranks \[0, 1\] for 0\.\d s \(thread .+\)"
        assert re.fullmatch(expected, text), text


def test_a_rank_that_holds_the_gil_is_reported_with_its_stacks() -> None:
    """Rank 1 stops its heartbeat by holding the GIL: rank 0 ends the job, and its report holds the stacks
    rank 1's faulthandler watchdog wrote (the function that holds the GIL)."""
    from tests._harness import run_script

    env = {"MP_HEARTBEAT_TIMEOUT": "3", "OMP_NUM_THREADS": "1"}
    output, code, took = run_script(Path(__file__).with_name("_gil_job.py"), 2, env=env, timeout=120)
    assert code != 0 and took < 45, (code, took, output[-3000:])
    assert "rank 1 (pp_rank 1" in output and "has sent no heartbeat" in output, output[-3000:]
    report = output[output.index("its threads when its heartbeat stopped (faulthandler):") :]
    assert "in hold_the_gil_in_one_c_call" in report, output[-3000:]
