"""Optimal contiguous segmentation against brute force."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_partition import max_segment_cost, optimal_segments
from mp_partition.segment import segment_costs


def brute(costs: list[float], k: int) -> tuple[float, float]:
    """(optimal largest segment cost, least sum of squares among the optimal splits)."""
    n = len(costs)
    k = min(k, n)
    best = math.inf
    splits = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        segs = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        splits.append(segs)
        best = min(best, max(segs))
    tol = 1e-9 * max(1.0, best)
    squares = min(sum(s * s for s in segs) for segs in splits if max(segs) <= best + tol)
    return best, squares


def check_shape(segments: list[tuple[int, int]], n: int, k: int) -> None:
    assert len(segments) == min(k, n)
    assert segments[0][0] == 0 and segments[-1][1] == n
    for (_, b), (c, _) in itertools.pairwise(segments):
        assert b == c
    assert all(b > a for a, b in segments)


costs_strategy = st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(costs=costs_strategy, k=st.integers(min_value=1, max_value=10))
def test_matches_brute_force(costs: list[float], k: int) -> None:
    segments = optimal_segments(costs, k)
    check_shape(segments, len(costs), k)
    seg = segment_costs(costs, segments)
    best, squares = brute(costs, k)
    assert max(seg) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert max_segment_cost(costs, k) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert sum(s * s for s in seg) == pytest.approx(squares, rel=1e-7, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=10), k=st.integers(1, 6))
def test_integer_costs_with_many_ties(costs: list[int], k: int) -> None:
    values = [float(c) for c in costs]
    segments = optimal_segments(values, k)
    check_shape(segments, len(values), k)
    best, squares = brute(values, k)
    seg = segment_costs(values, segments)
    assert max(seg) == best
    assert sum(s * s for s in seg) == squares


def test_equal_layers_split_evenly() -> None:
    assert optimal_segments([1.0] * 48, 8) == [(6 * i, 6 * i + 6) for i in range(8)]
    seg = segment_costs([1.0] * 50, optimal_segments([1.0] * 50, 8))
    assert sorted(seg) == [6.0] * 6 + [7.0] * 2  # 7,7,...,1 would also be minimax-optimal


def test_edge_cases() -> None:
    assert optimal_segments([], 3) == []
    assert optimal_segments([5.0], 4) == [(0, 1)]
    assert optimal_segments([0.0, 0.0, 0.0], 2) in ([(0, 1), (1, 3)], [(0, 2), (2, 3)])
    assert optimal_segments([9.0, 1.0, 1.0, 1.0], 2) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="non-negative"):
        optimal_segments([1.0, -1.0], 2)
    with pytest.raises(ValueError):
        optimal_segments([1.0], 0)


def test_deterministic_and_fast_on_long_sequences() -> None:
    costs = [((i * 7919) % 97) / 97 + 0.01 for i in range(600)]
    start = time.perf_counter()
    first = optimal_segments(costs, 8)
    elapsed = time.perf_counter() - start
    assert first == optimal_segments(costs, 8)
    assert elapsed < 5.0
    bound = max(sum(costs) / 8, *costs)
    assert max(segment_costs(costs, first)) <= bound + max(costs)
