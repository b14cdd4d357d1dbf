"""The TP group's order of events (mp_pipeline.sequence) as data: names, holding, taking, errors."""

from __future__ import annotations

import pytest
import torch

from mp_pipeline.context import ExecState
from mp_pipeline.errors import PipelineError
from mp_pipeline.messages import Handoff, Request, Response, StepEnd, StepId
from mp_pipeline.schedule import Phase
from mp_pipeline.sequence import Order, Sequencer, event_of

STEP = StepId(0, 1)
PEERS_A, PEERS_B = (0, 2), (1, 3)
"""Two mirrored pipelines; the TP groups are {0, 1} (pp_rank 0) and {2, 3} (pp_rank 1)."""


def _request(requester: int, request_id: int) -> Request:
    state = ExecState(True)
    return Request(STEP, request_id, requester, Phase.FORWARD, "h.2", 0, ("h.2",), None, [], (), state)


def test_events_are_named_alike_in_mirrored_pipelines() -> None:
    # the same message in either pipeline: requester and handoff ranks become pp_ranks
    assert event_of(_request(0, 5), PEERS_A) == event_of(_request(1, 5), PEERS_B) == ("req", 0, 5)
    assert event_of(Response(STEP, 7, 2), PEERS_A) == event_of(Response(STEP, 7, 3), PEERS_B) == ("resp", 7)
    a = Handoff(STEP, ("act", 2, 4, 0), torch.zeros(1))
    b = Handoff(STEP, ("act", 3, 4, 0), torch.zeros(1))
    assert event_of(a, PEERS_A) == event_of(b, PEERS_B) == ("hand", "act", 1, 4, 0)
    assert event_of(StepEnd(STEP, None), PEERS_A) == ("end",)
    with pytest.raises(TypeError, match="no event for a Order"):
        event_of(Order(STEP, ("end",)), PEERS_A)


def test_follower_takes_messages_in_the_leaders_order_whatever_their_arrival() -> None:
    seq = Sequencer(3, (2, 3), PEERS_B)
    assert not seq.is_leader and seq.followers == () and seq.leader == 2
    first, second = _request(1, 0), _request(1, 1)
    seq.hold(second)  # arrives first
    seq.hold(Order(STEP, ("req", 0, 0)))
    seq.hold(Order(STEP, ("req", 0, 1)))
    assert seq.next_order() == ("req", 0, 0)
    assert seq.take(("req", 0, 0)) is None  # its message has not arrived: the order stays
    assert seq.next_order() == ("req", 0, 0)
    seq.hold(first)
    assert seq.take(("req", 0, 0)) is first
    assert seq.take(seq.next_order() or ()) is second
    assert seq.idle and seq.next_order() is None
    assert "the leader's next order" in seq.describe()


def test_leader_names_its_followers_and_a_duplicate_event_is_an_error() -> None:
    assert Sequencer(0, (0, 1), PEERS_A).followers == (1,)
    seq = Sequencer(1, (0, 1), PEERS_B)
    seq.hold(_request(1, 0))
    with pytest.raises(PipelineError, match=r"second message for event \('req', 0, 0\)"):
        seq.hold(_request(1, 0))
    with pytest.raises(ValueError, match="not in its TP group"):
        Sequencer(5, (0, 1), PEERS_A)
