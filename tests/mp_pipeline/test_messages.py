"""The pipeline's messages survive pickling (as the transports send them) field for field."""

from __future__ import annotations

import pickle

import pytest
import torch

from mp_pipeline.context import ExecState
from mp_pipeline.messages import Compact, Entered, Failure, Request, Response, StepAbort, StepEnd, StepId
from mp_pipeline.schedule import Phase
from mp_pipeline.sequence import Order
from mp_pipeline.structure import Slot

STEP = StepId(model=2, step=7)
FAILURE = Failure(
    rank=1, module="h.3", microbatch=2, phase="fwd", exc_type="ValueError", message="x", traceback="tb"
)

MESSAGES = [
    STEP,
    ExecState(True, (("cpu", torch.bfloat16),)),
    Slot(3),
    Request(
        step=STEP,
        request_id=11,
        requester=0,
        phase=Phase.BACKWARD,
        module="transformer.h.3",
        microbatch=1,
        position=("<step>", "transformer", "transformer.h.3"),
        payload=((Slot(0), None), {"mask": Slot(1), "n": 3}),
        tensors=[None, torch.arange(4.0)],
        requires_grad=(True, False),
        state=ExecState(False),
        checkpoint=True,
        forward_id=4,
        template_id=9,
        refs=((0, 3, 1),),
    ),
    Response(STEP, 11, 1, payload=(Slot(0),), tensors=[torch.ones(2)], requires_grad=(True,), template_id=2),
    Response(STEP, 12, 1, failure=FAILURE),
    Compact(STEP, 5, 13, [torch.zeros(3), None], forward_id=2, refs=((1, 0, 0),)),
    StepEnd(STEP, results=[1.5, {"a": 2}]),
    StepAbort(STEP, FAILURE),
    Order(STEP, ("hand", "act", 1, 4, 0)),
    Entered("model.state_dict()", 3),
    FAILURE,
]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))  # type: ignore[arg-type]
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_pickle(message: object) -> None:
    back = pickle.loads(pickle.dumps(message, protocol=5))
    assert _same(message, back), (message, back)
    # pickled as a constructor call with the fields in order (no per-object field lookup)
    assert message.__reduce__()[0] is type(message)
