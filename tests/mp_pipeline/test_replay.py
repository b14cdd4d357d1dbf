"""Per-rank replay's bookkeeping on pp_rank 0 (mp_pipeline.replay.Replay): what it learns from the
requests of two steps, the owners' programs, and the guard that matches each call of a replayed step."""

from __future__ import annotations

import pytest
import torch

from mp_pipeline.context import ExecState
from mp_pipeline.errors import FlowChangedError
from mp_pipeline.messages import Ref, Request, StepId
from mp_pipeline.replay import REPLAY_BASE, Program, Replay
from mp_pipeline.schedule import Phase

OWNER = 1


def _request(
    rid: int,
    module: str,
    mb: int,
    *,
    phase: Phase = Phase.FORWARD,
    forward_id: int | None = None,
    refs: tuple[Ref, ...] = (),
    width: int = 4,
    fed: bool = True,
) -> Request:
    data = torch.zeros(2, width) if fed else None
    return Request(
        step=StepId(0, 1),
        request_id=rid,
        requester=0,
        phase=phase,
        module=module,
        microbatch=mb,
        position=("<step>", module),
        payload=None,
        tensors=[data],
        requires_grad=(True,) if phase is Phase.FORWARD else (),
        state=ExecState(True),
        forward_id=forward_id,
        refs=refs,
    )


def _step(replay: Replay, first_id: int, *, width: int = 4, swap: bool = False) -> None:
    """One step's requests to OWNER: per microbatch, a's forward (data from rank 0), b's forward (a's
    output, kept on the owner: a Ref), then b's and a's backward; ids count from ``first_id`` (the
    dynamic ids differ between steps)."""
    rid = first_id
    for mb in (1, 0) if swap else (0, 1):
        a, b = rid, rid + 1
        replay.record(OWNER, _request(a, "a", mb, width=width), posted=True)
        ref = Ref(0, OWNER, a, 0, True)
        replay.record(OWNER, _request(b, "b", mb, refs=(ref,), fed=False), posted=False)
        replay.record(OWNER, _request(b + 1, "b", mb, phase=Phase.BACKWARD, forward_id=b), posted=True)
        replay.record(OWNER, _request(b + 2, "a", mb, phase=Phase.BACKWARD, forward_id=a, fed=False), True)
        rid += 4


def _learned(replay: Replay) -> dict[int, Program]:
    replay.begin_step(record=True)
    _step(replay, 0)
    assert replay.learned() is None  # one recorded step proves nothing yet
    replay.begin_step(record=True)
    _step(replay, 100, swap=True)  # other ids, microbatches interleaved otherwise: the same flow
    programs = replay.learned()
    assert programs is not None
    return programs


def test_two_agreeing_steps_give_each_owner_its_program_with_the_same_ids_on_both_sides() -> None:
    replay = Replay()
    programs = _learned(replay)
    assert replay.active is not None and not replay.recording
    program = programs[OWNER]
    assert sorted(program) == [0, 1]
    calls = program[0]
    assert [(c.request.phase, c.request.module) for c in calls] == [
        (Phase.FORWARD, "a"),
        (Phase.FORWARD, "b"),
        (Phase.BACKWARD, "b"),
        (Phase.BACKWARD, "a"),
    ]
    a, b, b_back, a_back = calls
    assert all(c.request.request_id >= REPLAY_BASE for c in calls)
    assert b.request.refs[0].forward_id == a.request.request_id  # the shortcut names the program's id
    assert b_back.request.forward_id == b.request.request_id
    assert (a.fed, b.fed, a_back.fed) == ((0,), (), ())  # only a's input comes from rank 0
    assert (a.request.posted, b.request.posted) == (True, False)

    # a replayed step: rank 0's calls get the program's ids, in order
    replay.begin_step(record=False)
    got = replay.match(OWNER, _request(-1, "a", 0), posted=True)
    assert got == a.request.request_id
    ref = Ref(0, OWNER, got, 0, True)
    assert (
        replay.match(OWNER, _request(-1, "b", 0, refs=(ref,), fed=False), posted=False)
        == b.request.request_id
    )
    with pytest.raises(FlowChangedError, match=r"made 2 of the 8 remote calls"):
        replay.check_complete()


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ("module", "is not among the calls learned"),
        ("shape", "shapes and dtypes"),
        ("posted", "whether its response carries data"),
        ("order", "its order"),
    ],
)
def test_a_call_that_differs_from_the_program_is_a_flow_change(change: str, what: str) -> None:
    replay = Replay()
    programs = _learned(replay)
    replay.begin_step(record=False)
    if change == "order":  # microbatch 0's b before its a
        a_id = programs[OWNER][0][0].request.request_id
        ref = Ref(0, OWNER, a_id, 0, True)
        request, posted = _request(-1, "b", 0, refs=(ref,), fed=False), False
    else:
        module = "c" if change == "module" else "a"
        request = _request(-1, module, 0, width=5 if change == "shape" else 4)
        posted = change != "posted"
    with pytest.raises(FlowChangedError, match=what):
        replay.match(OWNER, request, posted=posted)


def test_steps_that_disagree_are_not_replayed_and_learning_stops_after_a_few() -> None:
    replay = Replay()
    for n in range(Replay.GIVE_UP_AFTER + 1):
        replay.begin_step(record=True)
        assert replay.recording
        _step(replay, 0, width=4 + n)  # a shape that changes in every step
        assert replay.learned() is None
    assert replay.active is None
    replay.begin_step(record=True)
    assert not replay.recording  # given up: the posted path stays


@pytest.mark.parametrize("second", [(True, True), (True, False), (False, False)])
def test_it_leads_with_the_forwards_whose_first_call_fed_another_rank_in_both_recorded_steps(
    second: tuple[bool, bool],
) -> None:
    """Microbatch 0's first call to another rank came before any module of pp_rank 0 returned in the first
    recorded step, microbatch 1's after one did. Only what both steps saw leads (Scheduler.feed_first)."""
    replay = Replay()
    for n, opened in enumerate([(True, False), second]):
        replay.begin_step(record=True)
        for mb, remote_first in enumerate(opened):
            replay.opened(mb, remote_first)
        _step(replay, 100 * n)
        learned = replay.learned()
        assert (learned is None) == (n == 0)
    assert replay.leading == (frozenset({0}) if second[0] else frozenset())
