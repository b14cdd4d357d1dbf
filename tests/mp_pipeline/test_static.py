"""Static mode's bookkeeping (mp_pipeline.static), without processes: recording, the replay decision,
the per-message check, and fast mode's strictness; and the worker pool kept across steps."""

from __future__ import annotations

import pytest
import torch

from mp_pipeline import ExecState, FlowChangedError, FlowRecorder, Phase, TemplateStore
from mp_pipeline.static import Key, Plan, Template, tensor_metas

STATE = ExecState(True)


def template(shape: tuple[int, ...] = (4, 8), payload: object = ("x", {"scale": 0.5})) -> Template:
    flow = (
        Phase.FORWARD,
        "block",
        ("<step>", "block"),
        (True,),
        STATE,
        False,
        tensor_metas([torch.zeros(shape)]),
    )
    return Template(flow, payload)


def send(flow: FlowRecorder, module: str = "block", mb: int = 0, **kwargs: object) -> Plan | None:
    key = flow.counted(Key(1, False, Phase.FORWARD, module, ("<step>", module), mb, 0))
    return flow.outgoing(key, template(**kwargs))  # type: ignore[arg-type]


def step(flow: FlowRecorder, calls: list[dict[str, object]]) -> list[Plan | None]:
    flow.begin_step()
    plans = [send(flow, **c) for c in calls]  # type: ignore[arg-type]
    flow.end_step(completed=True)
    return plans


STATIC = [{"mb": 0}, {"mb": 1}, {"mb": 0}]  # mb 0 calls the module twice (reuse)


def test_records_then_replays_compact_after_announcing_each_template_once() -> None:
    flow = FlowRecorder(rank=0, record_steps=2)
    assert step(flow, STATIC) == [None] * 3
    assert step(flow, STATIC) == [None] * 3
    assert flow.replaying
    first = step(flow, STATIC)
    assert all(p is not None and p.announce and not p.compact for p in first)
    assert len({p.template_id for p in first if p is not None}) == 3  # reuse: two keys for mb 0
    again = step(flow, STATIC)
    assert [p.template_id for p in again if p] == [p.template_id for p in first if p]
    assert all(p is not None and p.compact for p in again)
    assert flow.mismatch is None and not flow.disabled


def test_recorded_steps_that_differ_turn_static_mode_off() -> None:
    flow = FlowRecorder(rank=0, record_steps=2)
    step(flow, STATIC)
    step(flow, [{"mb": 0}, {"mb": 1, "shape": (2, 8)}])
    assert flow.disabled and not flow.replaying
    assert step(flow, STATIC) == [None] * 3


def test_a_payload_that_does_not_compare_equal_travels_in_full_under_its_static_tag() -> None:
    flow = FlowRecorder(rank=0, record_steps=2)
    for _ in range(2):
        step(flow, [{"payload": object()}])  # no __eq__: differs every step, the flow does not
    (plan,) = step(flow, [{"payload": object()}])
    assert plan is not None and not plan.compact and not plan.announce
    assert not flow.disabled


@pytest.mark.parametrize(
    ("calls", "what"),
    [
        ([{"mb": 0}, {"mb": 1}, {"module": "other"}], "not in the recording"),
        ([{"mb": 0}, {"mb": 1}, {"mb": 0, "shape": (3, 8)}], "differs from the recording"),
        ([{"mb": 0}, {"mb": 1}], "sent 2 of the 3 recorded messages"),  # found at the end of the step
    ],
)
def test_a_replayed_step_that_differs_falls_back_for_good(calls: list[dict[str, object]], what: str) -> None:
    flow = FlowRecorder(rank=0, record_steps=1)
    step(flow, STATIC)
    plans = step(flow, calls)
    assert flow.mismatch is not None and what in flow.mismatch
    if len(calls) == len(STATIC):
        assert plans[-1] is None  # the message that differed went in full
    assert flow.disabled
    assert step(flow, STATIC) == [None] * 3


def test_fast_mode_raises_before_sending_a_changed_message() -> None:
    flow = FlowRecorder(rank=3, record_steps=1, strict=True)
    step(flow, STATIC)
    flow.begin_step()
    send(flow, mb=0)
    with pytest.raises(FlowChangedError, match=r"rank 3.*'fast_mode' to False"):
        send(flow, module="other")


def test_an_aborted_step_is_not_recorded() -> None:
    flow = FlowRecorder(rank=0, record_steps=2)
    step(flow, STATIC)
    flow.begin_step()
    send(flow, module="other")
    flow.end_step(completed=False)
    step(flow, STATIC)
    assert flow.replaying


def test_template_store_names_a_missing_template() -> None:
    store = TemplateStore()
    store.put(1, 0, "template")
    assert store.get(1, 0) == "template"
    with pytest.raises(FlowChangedError, match="template 7"):
        store.get(1, 7)


def test_fast_mode_records_from_the_step_after_its_learning_step() -> None:
    flow = FlowRecorder(rank=0, record_steps=2, strict=True, skip_steps=1)
    flow.begin_step()
    send(flow, shape=(2, 8))  # the first step is not recorded, whatever it sent
    flow.end_step(completed=False)  # nor does an aborted step count as the one skipped
    step(flow, [{"shape": (3, 8)}])
    step(flow, STATIC)
    step(flow, STATIC)
    assert flow.replaying
    assert all(p is not None and p.announce for p in step(flow, STATIC))
