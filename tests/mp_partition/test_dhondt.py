"""D'Hondt allocation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_partition import dhondt_allocate, dhondt_seats


def test_textbook_example() -> None:
    # The usual illustration: 100k, 80k, 30k and 20k votes for 8 seats give 4, 3, 1, 0.
    assert dhondt_seats([100_000, 80_000, 30_000, 20_000], 8) == [4, 3, 1, 0]


def test_t5_like_split() -> None:
    # Decoder somewhat costlier than encoder: five devices to three (seed 001, Figure 10).
    assert dhondt_seats([0.4, 0.6], 8) == [3, 5]
    assert dhondt_seats([0.5, 0.5], 8) == [4, 4]


def test_small_segment_gets_nothing() -> None:
    assert dhondt_seats([0.9, 0.1], 2) == [2, 0]
    assert dhondt_seats([0.9, 0.05, 0.05], 4) == [4, 0, 0]


def test_ties_favour_the_larger_segment_then_the_earlier() -> None:
    assert dhondt_seats([1.0, 2.0], 2) == [0, 2]
    assert dhondt_seats([1.0, 1.0, 1.0], 2) == [1, 1, 0]


def test_literal_algorithm_hands_devices_in_order() -> None:
    assert dhondt_allocate([0, 1, 2, 3], [0.3, 0.7]) == [[2], [0, 1, 3]]
    assert dhondt_allocate([4, 5, 6], [1.0, 1.0, 1.0]) == [[4], [5], [6]]


def test_zero_costs_count_as_equal() -> None:
    assert dhondt_seats([0.0, 0.0], 4) == [2, 2]


def test_invalid_input() -> None:
    with pytest.raises(ValueError):
        dhondt_seats([], 2)
    with pytest.raises(ValueError):
        dhondt_seats([1.0, -0.5], 2)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=6),
    seats=st.integers(min_value=0, max_value=16),
)
def test_highest_averages_properties(costs: list[int], seats: int) -> None:
    values = [float(c) for c in costs]
    got = dhondt_seats(values, seats)
    assert sum(got) == seats
    if sum(values) == 0:
        return
    # Jefferson/D'Hondt: no segment's next quotient beats another's last one.
    for i, ci in enumerate(values):
        for j, cj in enumerate(values):
            if got[j] > 0:
                assert ci / (got[i] + 1) <= cj / got[j] + 1e-9
    # The seats are the top `seats` entries of the quotient table.
    table = sorted(((c / d, i) for i, c in enumerate(values) for d in range(1, seats + 1)), reverse=True)
    if seats:
        cutoff = table[seats - 1][0]
        for i, c in enumerate(values):
            strictly_above = sum(1 for d in range(1, seats + 1) if c / d > cutoff + 1e-12)
            at_least = sum(1 for d in range(1, seats + 1) if c / d >= cutoff - 1e-12)
            assert strictly_above <= got[i] <= at_least
