"""mp_pipeline.posted.digest: the memo of digests an owner computes for every call it runs."""

from __future__ import annotations

import torch

from mp_pipeline import posted
from mp_pipeline.posted import Shape, digest
from mp_pipeline.structure import Slot


def _shape(payload: object, dtype: torch.dtype = torch.float32) -> Shape:
    return Shape(payload, ((torch.Size([1, 16]), dtype), None), (True, False))


def test_memoized_digest_equals_a_fresh_one() -> None:
    posted._DIGESTS.clear()
    first = digest(_shape((Slot(0), None)))
    assert len(posted._DIGESTS) == 1
    posted._DIGESTS.clear()
    again = digest(_shape((Slot(0), None)))  # computed afresh
    assert digest(_shape((Slot(0), None))) == first == again  # the last one from the memo
    assert digest(_shape((Slot(1), None))) != first
    assert digest(_shape((Slot(0), None), torch.float64)) != first


def test_values_equal_across_types_are_not_memoized() -> None:
    # 1 == True == 1.0, and they hash alike: a memo keyed by the shape would give all three one digest
    posted._DIGESTS.clear()
    digests = {digest(_shape((Slot(0), value))) for value in (1, True, 1.0)}
    assert len(digests) == 3
    assert not posted._DIGESTS
    lists = {digest(_shape([Slot(0)])), digest(_shape((Slot(0),)))}
    assert len(lists) == 2
