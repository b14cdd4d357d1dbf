"""The pipeline's per-call messages that travel as bare tensors: a handed-off tensor, and a compact
response (static mode's replayed response). Their step and ids ride in the transport tag and only the
tensors travel, so the sender pickles no object around them; the receiving wire rebuilds the message."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from mp_comm.message import encode_object
from mp_comm.transport import LoopbackHub, TransportConfig
from mp_pipeline.context import capture
from mp_pipeline.messages import (
    TAG,
    Compact,
    Handoff,
    Request,
    Response,
    StepId,
    compact_response_of,
    compact_response_tag,
    handoff_of,
    handoff_tag,
    is_pipeline_tag,
)
from mp_pipeline.schedule import Phase
from mp_pipeline.static import FlowRecorder, TemplateStore
from mp_pipeline.wire import Wire

STEP = StepId(3, 7, "main.<locals>.train_step")


def _wire(transport: Any, rank: int, flow: FlowRecorder | None = None, step: StepId = STEP) -> Wire:
    def waiting() -> str:
        return "nothing"

    class _Holder:  # a WeakMethod needs a bound method of a live object
        def describe(self) -> str:
            return waiting()

    holder = _Holder()
    wire = Wire(
        transport=transport,
        rank=rank,
        peers=(0, 1),
        step=step,
        early=[],
        entered={},
        templates=TemplateStore(),
        flow=flow,
        idle=None,
        stats={"compact_sent": 0, "compact_received": 0, "tensor_bytes": 0},
        waiting=weakref.WeakMethod(holder.describe),
    )
    wire._holder = holder  # type: ignore[attr-defined]  # keeps the describer alive with the wire
    return wire


def _pair() -> tuple[Any, Any]:
    hub = LoopbackHub(2, config=TransportConfig(timeout=5.0))
    return hub.transport(0), hub.transport(1)


def test_tags_round_trip_and_stay_pipeline_tags() -> None:
    t = torch.arange(4.0)
    handoff = Handoff(STEP, ("fed", 0, 12, 1), t)
    tag = handoff_tag(handoff)
    assert is_pipeline_tag(tag) and tag[0] == TAG
    back = handoff_of(tag, t)
    assert back is not None and back.step == STEP and back.key == ("fed", 0, 12, 1) and back.tensor is t
    ctag = compact_response_tag(STEP, 5, 44)
    assert is_pipeline_tag(ctag)
    one = compact_response_of(ctag, t)
    assert one == Compact(STEP, 5, 44, [t])
    two = compact_response_of(ctag, [t, None])
    assert two is not None and two.tensors == [t, None]
    # other tags are not mistaken for them
    assert handoff_of(TAG, t) is None and handoff_of(ctag, t) is None
    assert compact_response_of(tag, t) is None and compact_response_of((TAG, 5), t) is None


def test_a_handoff_travels_as_its_tensor_alone_and_arrives_as_the_handoff() -> None:
    a, b = _pair()
    sender, receiver = _wire(a, 0), _wire(b, 1)
    t = torch.randn(2, 3)
    sender.send_handoff(1, Handoff(STEP, ("act", 0, 4, 0), t))
    raw = b.recv(0)
    assert type(raw.obj) is torch.Tensor and torch.equal(raw.obj, t)  # no object around the tensor
    assert raw.tag == handoff_tag(Handoff(STEP, ("act", 0, 4, 0), t))
    assert encode_object(t)[0] == encode_object(torch.empty(0))[0]  # the bare tensor's fixed body
    sender.send_handoff(1, Handoff(STEP, ("grad", 0, 4, 2), t * 2))
    got = receiver.poll(5.0)
    assert isinstance(got, Handoff) and got.step == STEP and got.key == ("grad", 0, 4, 2)
    assert torch.equal(got.tensor, t * 2)
    assert sender.sent == {"Handoff": 2}


def test_a_handoff_of_another_step_is_kept_for_it_or_dropped() -> None:
    a, b = _pair()
    later = StepId(STEP.model, STEP.step + 1, STEP.fn)
    earlier = StepId(STEP.model, STEP.step - 1, STEP.fn)
    early: list[Any] = []
    receiver = _wire(b, 1)
    receiver._early = early
    sender = _wire(a, 0)
    sender.send_handoff(1, Handoff(earlier, ("fed", 0, 1, 0), torch.ones(1)))
    sender.send_handoff(1, Handoff(later, ("fed", 0, 1, 0), torch.ones(2)))
    sender.send_handoff(1, Handoff(STEP, ("fed", 0, 1, 0), torch.ones(3)))
    got = receiver.poll(5.0)
    assert isinstance(got, Handoff) and got.tensor.shape == (3,)
    assert len(early) == 1 and early[0].step == later and early[0].tensor.shape == (2,)


def _request(step: StepId, request_id: int) -> Request:
    return Request(
        step=step,
        request_id=request_id,
        requester=0,
        phase=Phase.FORWARD,
        module="layers.1",
        microbatch=0,
        position=(),
        payload=None,
        tensors=[torch.ones(1, 4)],
        requires_grad=(True,),
        state=capture(),
    )


def _response(step: StepId, request_id: int, tensors: list[torch.Tensor | None]) -> Response:
    return Response(
        step,
        request_id,
        1,
        payload=("out",),
        tensors=tensors,
        requires_grad=tuple(t is not None for t in tensors),
    )


@pytest.mark.parametrize("outputs", ["one", "two"])
def test_a_compact_response_travels_as_its_tensors_and_is_rebuilt_from_its_template(outputs: str) -> None:
    # The owner (rank 1) answers the same call in four steps: recorded, announced (sent in full with
    # its template), then compact twice: its one output alone, or its outputs' list (no object around).
    a, b = _pair()
    flow = FlowRecorder(1, record_steps=1)
    templates = TemplateStore()
    values = [torch.randn(1, 4) for _ in range(4)]
    for n in range(4):
        step = StepId(STEP.model, STEP.step + n, STEP.fn)
        owner = _wire(b, 1, flow, step)
        parent = _wire(a, 0, step=step)
        parent.templates = templates
        flow.begin_step()
        tensors: list[torch.Tensor | None] = [values[n]] if outputs == "one" else [values[n], None]
        owner.send_flow(0, _response(step, 10 + n, tensors), _request(step, 10 + n))
        if n < 3:
            raw = a.recv(1)
            if n < 2:
                assert isinstance(raw.obj, Response)  # recorded, then announced: in full
            else:
                assert type(raw.obj) is (torch.Tensor if outputs == "one" else list)
                assert raw.tag == compact_response_tag(step, raw.tag[5], 10 + n)
            got = parent._received(raw.source, raw.tag, raw.obj)
        else:
            got = parent.poll(5.0)
        assert isinstance(got, Response) and got.step == step and got.request_id == 10 + n
        assert got.payload == ("out",) and got.template_id == (0 if n == 1 else None)  # announced once
        assert got.requires_grad == tuple(t is not None for t in tensors)
        assert len(got.tensors) == len(tensors) and torch.equal(got.tensors[0], values[n])  # type: ignore[arg-type]
        assert got.tensors[1:] == tensors[1:]
        assert owner.sent == {"Response": 1}
        assert owner._stats["compact_sent"] == (1 if n >= 2 else 0)
        flow.end_step(completed=True)
        assert flow.mismatch is None and not flow.disabled
