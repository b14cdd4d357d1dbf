"""Schedules as pure data: driven by hand and by the communication-free simulator."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_pipeline import Phase, Scheduler, Task, fixed_order, simulate
from mp_pipeline.schedule import (
    Action,
    Op,
    OrderResult,
    one_f_one_b_orders,
    simulate_orders,
    zero_bubble_orders,
)

F, B = Phase.FORWARD, Phase.BACKWARD


def drain(s: Scheduler) -> list[Task]:
    out = []
    while (t := s.next_task()) is not None:
        out.append(t)
    return out


def test_simple_runs_all_forwards_then_all_backwards() -> None:
    s = Scheduler("simple", 3)
    assert drain(s) == [Task(0, F), Task(1, F), Task(2, F)]
    s.backward_ready(1)
    s.backward_ready(0)
    assert drain(s) == []  # microbatch 2 is still in its forward
    s.backward_ready(2)
    # then the backwards in microbatch order (each may start while the earlier one runs remotely)
    assert drain(s) == [Task(0, B), Task(1, B), Task(2, B)]
    for m in range(3):
        s.finished(m)
    assert s.done


def test_eager_simple_starts_each_backward_in_order_without_waiting_for_later_forwards() -> None:
    s = Scheduler("simple", 4, eager_backward=True)
    assert drain(s) == [Task(m, F) for m in range(4)]
    s.backward_ready(1)
    assert drain(s) == []  # microbatch 0 is still in its forward: the backwards keep microbatch order
    s.backward_ready(0)
    assert drain(s) == [Task(0, B), Task(1, B)]  # while microbatches 2 and 3 are still in their forward
    s.finished(2)  # a forward-only microbatch has no backward to wait for
    s.backward_ready(3)
    assert drain(s) == [Task(3, B)]
    for m in (0, 1, 3):
        s.finished(m)
    assert s.done
    # the forwards still come first, and the flag means nothing to the interleaved schedule
    assert Scheduler("interleaved", 2, eager_backward=True).eager_backward is False


@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
@pytest.mark.parametrize("costs", [(1.0, 1.0), (1.0, 1.3), (1.0, 0.7), (0.4, 2.5)])
def test_eager_backward_on_two_stages_keeps_gpipe_order_and_time(
    microbatches: int, costs: tuple[float, float]
) -> None:
    plain = simulate("simple", microbatches, forward_costs=costs)
    eager = simulate("simple", microbatches, forward_costs=costs, eager_backward=True)
    assert eager.makespan == pytest.approx(plain.makespan)
    last = [(s.phase, s.microbatch) for s in sorted(eager.spans, key=lambda s: s.start) if s.stage == 1]
    assert last == [(F, m) for m in range(microbatches)] + [(B, m) for m in range(microbatches)]


def test_eager_backward_would_overtake_forwards_on_more_stages() -> None:
    # why the runtime sets it only for two stages: the last stage starts backward 0 before forward 3
    plain = simulate("simple", 4, forward_costs=(1.0,) * 3)
    eager = simulate("simple", 4, forward_costs=(1.0,) * 3, eager_backward=True)
    assert (plain.makespan, eager.makespan) == (18.0, 21.0)
    last = [(s.phase, s.microbatch) for s in sorted(eager.spans, key=lambda s: s.start) if s.stage == 2]
    assert last.index((B, 0)) < last.index((F, 3))


def test_interleaved_prefers_a_ready_backward_and_bounds_microbatches_in_flight() -> None:
    s = Scheduler("interleaved", 4, 2)
    assert drain(s) == [Task(0, F), Task(1, F)]  # active_microbatches=2
    s.backward_ready(1)
    assert s.next_task() == Task(1, B)  # ready backward first, even out of order
    assert s.next_task() is None  # still 2 in flight
    s.finished(1)
    assert s.next_task() == Task(2, F)
    s.backward_ready(0)
    s.backward_ready(2)
    assert drain(s) == [Task(0, B), Task(2, B)]
    s.finished(0)
    assert drain(s) == [Task(3, F)]


@pytest.mark.parametrize("feeds", [False, True])
def test_a_forward_that_feeds_another_rank_first_goes_before_a_ready_backward(feeds: bool) -> None:
    """pp_rank 0's order of starts: a forward whose first act feeds another rank (feed_first, learned by
    per-rank replay: T5's encoder on pp_rank 1) starts before the ready backwards once in-flight room
    frees; any other forward keeps the backward first (the looped GPT, whose first stage is pp_rank 0)."""
    s = Scheduler("interleaved", 4, 2)
    s.feed_first(frozenset(range(4)) if feeds else frozenset())
    assert drain(s) == [Task(0, F), Task(1, F)]
    s.backward_ready(0)
    assert drain(s) == [Task(0, B)]
    s.backward_ready(1)  # ready while two are in flight: no forward may start yet
    s.finished(0)
    assert s.has_urgent()  # a backward, or a feeding forward: either goes before messages
    if feeds:
        assert drain(s) == [Task(2, F), Task(1, B)]
    else:
        assert drain(s) == [Task(1, B), Task(2, F)]
    s.backward_ready(2)
    s.finished(1)
    assert drain(s) == ([Task(3, F), Task(2, B)] if feeds else [Task(2, B), Task(3, F)])


def test_a_fixed_order_or_the_simple_schedule_feeds_nothing_first() -> None:
    for s in (Scheduler("interleaved", 3, 2, deterministic=True), Scheduler("simple", 3)):
        s.feed_first(frozenset({0, 1, 2}))
        assert s.forward_first == frozenset()


def test_forward_only_microbatches_finish_without_backward() -> None:
    for kind in ("simple", "interleaved"):
        s = Scheduler(kind, 2)  # type: ignore[arg-type]
        assert drain(s) == [Task(0, F), Task(1, F)]
        s.finished(0)
        s.finished(1)
        assert s.done and drain(s) == []


def test_deterministic_order_is_fixed() -> None:
    assert [str(t) for t in fixed_order(4, 2)] == [
        "FWD0",
        "FWD1",
        "BWD0",
        "FWD2",
        "BWD1",
        "FWD3",
        "BWD2",
        "BWD3",
    ]
    s = Scheduler("interleaved", 3, 2, deterministic=True)
    assert drain(s) == [Task(0, F), Task(1, F)]
    s.backward_ready(1)  # ready first, but the fixed order wants BWD0 next
    assert s.next_task() is None
    s.backward_ready(0)
    assert drain(s) == [Task(0, B)]
    s.finished(0)
    assert drain(s) == [Task(2, F), Task(1, B)]


def test_events_are_checked() -> None:
    s = Scheduler("interleaved", 2)
    with pytest.raises(ValueError, match="has not started"):
        s.backward_ready(0)
    with pytest.raises(ValueError, match="active_microbatches"):
        Scheduler("interleaved", 2, 3)
    with pytest.raises(ValueError, match="schedule"):
        Scheduler("gpipe", 2)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["simple", "interleaved"]),
    microbatches=st.integers(1, 8),
    stages=st.integers(1, 4),
    data=st.data(),
    deterministic=st.booleans(),
)
def test_simulated_pipelines_run_every_task_within_the_bounds(
    kind: str, microbatches: int, stages: int, data: st.DataObject, deterministic: bool
) -> None:
    active = data.draw(st.integers(1, microbatches)) if kind == "interleaved" else microbatches
    costs = data.draw(st.lists(st.floats(0.1, 3.0), min_size=stages, max_size=stages))
    res = simulate(kind, microbatches, active, forward_costs=costs, deterministic=deterministic)  # type: ignore[arg-type]
    assert sorted((t.microbatch, t.phase.value) for t in res.order) == sorted(
        [(m, "FWD") for m in range(microbatches)] + [(m, "BWD") for m in range(microbatches)]
    )
    assert res.peak_in_flight <= active
    for stage in range(stages):  # one task at a time per stage
        spans = sorted((s.start, s.end) for s in res.spans if s.stage == stage)
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(spans))
    # never faster than the busiest stage's work
    busiest = max(microbatches * 3 * c for c in costs)
    assert res.makespan >= busiest - 1e-9
    if kind == "simple":
        first_bwd = res.order.index(next(t for t in res.order if t.phase is Phase.BACKWARD))
        assert all(t.phase is Phase.FORWARD for t in res.order[:first_bwd]) and first_bwd == microbatches


@given(
    kind=st.sampled_from(["simple", "interleaved"]),
    microbatches=st.integers(1, 6),
    deterministic=st.booleans(),
    eager=st.booleans(),
    data=st.data(),
)
@settings(max_examples=150)
def test_has_task_answers_next_task_without_starting_anything(
    kind: str, microbatches: int, deterministic: bool, eager: bool, data: st.DataObject
) -> None:
    """The module server asks `has_task` before a worker waits for messages itself, and `has_urgent` and
    `has_early_forward` before it handles a message: asking must tell what `next_task` would do and change
    nothing, whatever happened before (the fixed order's cursor included)."""
    active = data.draw(st.integers(1, microbatches))
    feeds = frozenset(data.draw(st.sets(st.integers(0, microbatches - 1))))

    def make() -> Scheduler:
        made = Scheduler(kind, microbatches, active, deterministic=deterministic, eager_backward=eager)  # type: ignore[arg-type]
        made.feed_first(feeds)
        return made

    asked, plain = make(), make()
    started: list[Task] = []
    finished: set[int] = set()
    forward_only = data.draw(st.sets(st.integers(0, microbatches - 1)))
    while not asked.done:
        answers = [
            (asked.has_task(), asked.has_early_forward(), asked.has_urgent())
            for _ in range(data.draw(st.integers(1, 3)))
        ]
        task = asked.next_task()
        assert task == plain.next_task()  # asking changed nothing
        early = kind == "simple" and task is not None and task.phase is not B
        urgent = task is not None and (task.phase is B or task.microbatch in asked.forward_first)
        expected = (task is not None, early, urgent)
        assert answers == [expected] * len(answers)
        if task is not None:
            started.append(task)
            continue
        # nothing may start: a running microbatch reaches its backward, or finishes
        running = [t.microbatch for t in started if t.microbatch not in finished]
        waiting = [m for m in dict.fromkeys(running) if m not in asked.ready]
        assert waiting, "no task may start and nothing runs"
        m = data.draw(st.sampled_from(waiting))
        done = m in forward_only or Task(m, B) in started
        for sched in (asked, plain):
            if done:
                sched.finished(m)
            else:
                sched.backward_ready(m)
        if done:
            finished.add(m)
    assert sorted(str(t) for t in started) == sorted(
        [f"FWD{m}" for m in range(microbatches)]
        + [f"BWD{m}" for m in range(microbatches) if m not in forward_only]
    )


def test_interleaving_keeps_fewer_microbatches_alive_than_simple() -> None:
    # with smp's default active_microbatches = pp + 2 the step is as fast, with fewer microbatches alive
    simple = simulate("simple", 8, forward_costs=(1.0, 1.0, 1.0, 1.0))
    inter = simulate("interleaved", 8, 6, forward_costs=(1.0, 1.0, 1.0, 1.0))
    assert simple.peak_in_flight == 8 and inter.peak_in_flight == 6
    assert inter.makespan == simple.makespan == 33.0  # 8 x 3 units of work + a (4 - 1) x 3 bubble
    # bounding it further trades time for memory
    assert simulate("interleaved", 8, 4, forward_costs=(1.0,) * 4).makespan > simple.makespan


# ---------------------------------------------------------------------- per-stage orders: 1F1B vs ZB-H1
def _run(orders: list[list[Action]], p: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> OrderResult:
    return simulate_orders(orders, forward_costs=[f] * p, input_costs=[b] * p, weight_costs=[w] * p)


@pytest.mark.parametrize("stages", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5, 13])
def test_zero_bubble_bubble_is_a_third_of_1f1b_at_1f1b_activations(stages: int, extra: int) -> None:
    """Equal forward, input-half and weight-half costs: ZB-H1's step is 3m + p - 1 (bubble (p-1)/3m of
    the work), 1F1B's 3(m + p - 1) (bubble (p-1)/m), and no stage holds more microbatches between
    forward and input gradient than under 1F1B."""
    m = stages + extra
    zb = _run(zero_bubble_orders(stages, m), stages)
    ob = _run(one_f_one_b_orders(stages, m), stages)
    assert zb.makespan == 3 * m + stages - 1
    assert ob.makespan == 3 * (m + stages - 1)
    assert zb.bubble == pytest.approx((stages - 1) / (3 * m))
    assert ob.bubble == pytest.approx((stages - 1) / m)
    assert zb.bubble == pytest.approx(ob.bubble / 3)
    assert zb.peak_activations == ob.peak_activations == [stages - s for s in range(stages)]
    assert max(zb.peak_pending_weights) <= stages


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 7])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (1.0, 0.8, 1.2), (0.5, 1.0, 1.0)])
def test_zero_bubble_orders_are_complete_and_never_slower(
    stages: int, microbatches: int, costs: tuple[float, float, float]
) -> None:
    orders = zero_bubble_orders(stages, microbatches)
    for s, order in enumerate(orders):
        for op in (Op.F, Op.B, Op.W):
            assert sorted(a.microbatch for a in order if a.op is op) == list(range(microbatches)), (s, op)
        seen = {a: i for i, a in enumerate(order)}
        assert all(seen[Action(Op.B, k)] < seen[Action(Op.W, k)] for k in range(microbatches))
    f, b, w = costs
    zb = _run(orders, stages, f, b, w)
    ob = _run(one_f_one_b_orders(stages, microbatches), stages, f, b, w)
    assert zb.makespan <= ob.makespan + 1e-9
    assert zb.peak_activations == ob.peak_activations


def test_orders_that_deadlock_are_named() -> None:
    orders = [[Action(Op.B, 0), Action(Op.F, 0)], [Action(Op.F, 0), Action(Op.B, 0)]]
    with pytest.raises(ValueError, match=r"deadlock.*\{0: 'B0', 1: 'F0'\}"):
        _run(orders, 2)
