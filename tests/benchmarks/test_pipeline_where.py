"""benchmarks/_pipeline_where.py and the overhead's recorded step: a pipelined step split per rank into
compute, waiting for a peer and the runtime's own time, on hand-built timelines with known answers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _pipeline_where
from benchmarks._pipeline_overhead import chain_split
from benchmarks._pipeline_where import (
    CALL,
    RECV,
    WEIGHTS,
    ActionClock,
    RankTime,
    cause,
    recording_mp,
    recording_torch_waits,
    render,
    split,
)
from mp_pipeline.timeline import STEP_MODULE, Event, EventKind, Recorder, Timeline

MS = 1_000_000  # ns


def _event(kind: EventKind, rank: int, a: float, b: float, **kw: Any) -> Event:
    thread = kw.pop("thread", "MainThread")
    module = kw.pop("module", "m")
    mb = kw.pop("mb", 0)
    return Event(kind, rank, thread, 0, module, mb, int(a * MS), int(b * MS), **kw)


def _timeline(*events: Event) -> Timeline:
    return Timeline(tuple(sorted(events, key=lambda e: (e.start_ns, e.rank, e.end_ns))), {}, {0: 0})


def test_split_divides_each_rank_step_into_compute_waiting_and_own() -> None:
    tl = _timeline(
        _event(EventKind.STEP, 0, 0, 100, module=STEP_MODULE, mb=-1),
        _event(EventKind.FWD, 0, 10, 30),
        _event(EventKind.BWD, 0, 50, 80, thread="w0"),
        _event(EventKind.WAIT, 0, 60, 70, thread="w0", phase="BWD", peer=1),  # cut from w0's compute
        _event(EventKind.WAIT, 0, 2, 6, phase=RECV),  # before the first action: fill
        _event(EventKind.WAIT, 0, 30, 55, phase=RECV),  # 50-55 overlaps w0's compute: not waiting
        _event(EventKind.WAIT, 0, 90, 120, phase=RECV),  # clipped to the step: drain 10
        _event(EventKind.WAIT, 0, 60, 70, thread="w2", phase=CALL),  # a call's path in the gap 60-70 ...
        _event(EventKind.WAIT, 0, 62, 68, thread="w2", phase="FWD", peer=1),  # ... parked 62-68
        _event(EventKind.STEP, 1, 5, 45, module=STEP_MODULE, mb=-1),
        _event(EventKind.FWD, 1, 5, 45),
        _event(EventKind.WAIT, 1, 20, 25, phase=CALL),  # a call's path inside the execution: cut out
        _event(EventKind.WAIT, 1, 22, 24, phase=RECV),  # inside it: waiting, not the path's
        _event(EventKind.WAIT, 1, 30, 38, thread="w1", phase=CALL),  # parked 31-37 (the runtime's WAIT)
        _event(EventKind.WAIT, 1, 31, 37, thread="w1", phase="FWD", peer=0),
    )
    r0, r1 = split(tl)
    assert r0 == RankTime(
        rank=0, step=100, compute=40, wait=34, own=26, actions=2, fill=4, drain=10, calls=1, in_calls=4
    )
    assert r1 == RankTime(  # w1's path overlaps compute on MainThread: not the runtime's own there
        rank=1, step=40, compute=35, wait=2, own=3, actions=1, fill=0, drain=0, calls=2, in_calls=3
    )


def test_cause_names_the_fill_and_drain_or_the_own_time_per_action() -> None:
    waited = RankTime(rank=1, step=100, compute=50, wait=40, own=10, actions=8, fill=25, drain=5)
    assert cause(waited, 2) == (
        "waited 40.0 ms for rank 0: 25.0 before its first action (fill), 10.0 between actions, "
        "5.0 after its last (drain)"
    )
    own = RankTime(rank=0, step=100, compute=60, wait=10, own=30, actions=12, fill=0, drain=0)
    assert cause(own, 2) == "30.0 ms of the runtime's own over 12 actions (2500 µs per action)"
    calls = RankTime(
        rank=0, step=100, compute=60, wait=5, own=35, actions=8, fill=0, drain=0, calls=64, in_calls=16
    )
    assert cause(calls, 2) == (
        "35.0 ms of the runtime's own, 16.0 of it in the paths of its 64 calls to another rank (250 µs each)"
    )
    busy = RankTime(rank=0, step=100, compute=95, wait=3, own=2, actions=4, fill=0, drain=0)
    assert cause(busy, 4) == "computed 95% of its step"


class _Runner:
    busy = 0.0


def test_action_clock_times_each_call_and_records_only_while_recording() -> None:
    runner, clock = _Runner(), ActionClock(rank=1)
    forward = clock.wrap(runner, lambda mb, x: x + 1, EventKind.FWD, "stage 1")
    loss = clock.wrap(runner, lambda out, target: out - target, EventKind.FWD, "loss")
    weights = clock.wrap(runner, lambda mb: None, EventKind.BWD, f"stage 1{WEIGHTS}")
    assert forward(0, 1) == 2  # not recording: timed only
    assert runner.busy > 0 and not clock.recorder.stop().events
    clock.recorder.start()
    with clock.step():
        forward(3, 1)
        loss(5, 2)
        weights(2)
    events = clock.recorder.stop().events
    got = [(e.kind, e.module, e.microbatch, e.rank) for e in events]
    assert got == [
        (EventKind.FWD, "stage 1", 3, 1),
        (EventKind.FWD, "loss", 3, 1),  # the loss belongs to the last forward's microbatch
        (EventKind.BWD, "stage 1 weights", 2, 1),
        (EventKind.STEP, "<step>", -1, 1),
    ]


def test_torch_waits_are_recorded_while_observed_and_the_schedule_restored() -> None:
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p
    waited: list[int] = []

    class Work:
        def wait(self) -> None:
            waited.append(1)

    clock = ActionClock(rank=0)
    clock.recorder.start()
    with recording_torch_waits(clock):
        schedules._wait_batch_p2p([Work(), Work()])
    assert schedules._wait_batch_p2p is original
    (event,) = clock.recorder.stop().events
    assert waited == [1, 1]
    assert (event.kind, event.phase, event.rank) == (EventKind.WAIT, RECV, 0)


def test_mp_receives_are_recorded_with_their_source_and_take_restored() -> None:
    from mp_comm.transport.mailbox import Arrival, Mailbox

    original = Mailbox.take
    box, recorder = Mailbox(), Recorder()
    threading.Timer(0.02, lambda: box.deliver(Arrival(source=1, tag="t", order=0))).start()
    recorder.start()
    with recording_mp(recorder, rank=0):
        got = box.take(1, "t", 5.0)
    assert Mailbox.take is original
    (event,) = recorder.stop().events
    assert got.source == 1
    assert (event.kind, event.phase, event.peer) == (EventKind.WAIT, RECV, 1)
    assert event.duration_ns >= 10 * MS  # it waited for the delivery (20 ms later)


def test_mp_call_paths_are_recorded_on_their_thread_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    class Calls:
        def call(self, path: str, owner: int) -> str:
            if owner < 0:
                raise ValueError(path)
            return path

    original = Calls.call
    monkeypatch.setattr(_pipeline_where, "_mp_methods", lambda: [(Calls, "call", CALL)])
    recorder = Recorder()
    recorder.start()
    with recording_mp(recorder, rank=1):
        assert Calls().call("blocks.3", 1) == "blocks.3"
        with pytest.raises(ValueError, match=r"blocks\.4"):
            Calls().call("blocks.4", -1)  # recorded too
    assert Calls.call is original
    events = recorder.stop().events
    assert [(e.kind, e.phase, e.rank, e.thread, e.peer) for e in events] == [
        (EventKind.WAIT, CALL, 1, threading.current_thread().name, None)
    ] * 2


def test_the_mp_methods_timed_exist() -> None:
    """The runtime's names this benchmark wraps: a rename must fail here, not in a full run."""
    for cls, name, _ in _pipeline_where._mp_methods():
        assert callable(getattr(cls, name)), f"{cls.__name__}.{name}"


def test_render_stacks_the_systems_in_one_picture(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    one = _timeline(
        _event(EventKind.STEP, 0, 0, 10, module=STEP_MODULE, mb=-1),
        _event(EventKind.FWD, 0, 1, 4),
        _event(EventKind.BWD, 0, 5, 7),
        _event(EventKind.BWD, 0, 7, 9),  # under a split backward: the weight half
        _event(EventKind.WAIT, 0, 4, 5, phase=RECV),
    )
    path = render([("mp", one, True), ("torch 1F1B", one, False)], tmp_path / "w.png", title="t")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chain_split_reads_where_a_call_goes_from_one_recorded_step() -> None:
    def us(a: float, b: float) -> tuple[float, float]:
        return a / 1000, b / 1000  # µs as ms for _event

    calls = 4
    events = [
        _event(EventKind.FWD, 0, *us(100, 900), module=STEP_MODULE, thread="w0"),
        _event(EventKind.WAIT, 0, *us(200, 230), phase=CALL, module="Remote.call", thread="w0"),
        _event(EventKind.WAIT, 0, *us(300, 350), phase=CALL, module="Remote.call", thread="w0"),
        _event(EventKind.WAIT, 0, *us(320, 340), phase="FWD", thread="w0"),  # parked: not the path's
        _event(EventKind.BWD, 0, *us(1000, 1500), module=STEP_MODULE, thread="w0"),
        _event(EventKind.WAIT, 0, *us(1100, 1160), phase=CALL, module="Link.backward", thread="w0"),
        _event(EventKind.WAIT, 0, *us(1120, 1140), phase=RECV, thread="MainThread"),  # another thread's
    ]
    events += [_event(EventKind.FWD, 1, *us(300 + 50 * i, 310 + 50 * i), module=f"c{i}") for i in range(4)]
    events.append(_event(EventKind.BWD, 1, *us(1300, 1380), module="c3"))
    got = chain_split(_timeline(*events), calls)
    assert got == pytest.approx(
        {
            "pp_rank0_forward_per_call": (30 + 30) / 2,
            "owner_forward_spacing": 50,
            "owner_forward_execution": 10,
            "pp_rank0_backward_per_call": 60,
            "owner_backward_executions": 1,
            "owner_backward_per_call": 80 / calls,
        }
    )
