"""Optimal contiguous segmentation by dynamic programming (docs/partition.md).

Splits a sequence of non-negative costs into ``k`` non-empty runs of consecutive elements so that the
largest run cost is as small as possible. Recursion (3),
``c(k, i) = min_j max{c(k−1, j), Σ_{q∈[j, i)} c(q)}``, is solved by dynamic programming; since
``c(k−1, j)`` grows and the last run's cost shrinks with ``j``, the best ``j`` is found by bisection.

Problem (2) often has many optimal answers (50 equal layers in 8 runs: any split with runs of at most
7). Among them we return the one with the smallest sum of squared run costs, i.e. the most even one,
found by a second dynamic program restricted to runs no costlier than the optimum. Pure functions,
deterministic: ties go to the earliest split point.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = ["max_segment_cost", "optimal_segments", "segment_costs"]

_REL_TOL = 1e-9


def _prefix(costs: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        if not c >= 0.0 or math.isinf(c):
            raise ValueError(f"segment costs must be finite and non-negative, got {c!r}")
        prefix.append(prefix[-1] + float(c))
    return prefix


def _minimax(prefix: list[float], k: int) -> float:
    """The optimal value of problem (2): min over k-segmentations of the largest segment cost."""
    n = len(prefix) - 1
    # best[i] = c(kk, i): first i elements in kk segments (valid for i >= kk)
    best = [prefix[i] for i in range(n + 1)]  # kk = 1
    for kk in range(2, k + 1):
        new = [math.inf] * (n + 1)
        for i in range(kk, n + 1):
            lo, hi = kk - 1, i - 1  # split point j: previous segments hold [0, j), last holds [j, i)

            # smallest j in [lo, hi] with best[j] >= last-segment cost (the crossing point)
            a, b = lo, hi
            while a < b:
                mid = (a + b) // 2
                if best[mid] >= prefix[i] - prefix[mid]:
                    b = mid
                else:
                    a = mid + 1
            candidates = [a]
            if a - 1 >= lo:
                candidates.append(a - 1)
            new[i] = min(max(best[j], prefix[i] - prefix[j]) for j in candidates)
        best = new
    return best[n]


def optimal_segments(costs: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Splits ``costs`` into ``min(k, len(costs))`` non-empty contiguous segments ``[start, stop)``.

    The largest segment cost is minimal (problem (2)); among such splits the sum of squared segment
    costs is minimal. Returns ``[]`` for an empty sequence.
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"number of segments must be >= 1, got {k}")
    if n == 0:
        return []
    k = min(k, n)
    prefix = _prefix(costs)
    if k == 1:
        return [(0, n)]
    bound = _minimax(prefix, k)
    limit = bound * (1.0 + _REL_TOL) + 1e-300
    # g[kk][i]: least sum of squares for the first i elements in kk segments, each cost <= limit.
    g_prev = [math.inf] * (n + 1)
    for i in range(1, n + 1):
        if prefix[i] <= limit:
            g_prev[i] = prefix[i] ** 2
    choice: list[list[int]] = [[0] * (n + 1)]
    for kk in range(2, k + 1):
        g = [math.inf] * (n + 1)
        arg = [-1] * (n + 1)
        for i in range(kk, n + 1):
            # the last segment [j, i) must cost at most `limit`: j >= first index with prefix >= p_i - limit
            j_min = max(kk - 1, bisect.bisect_left(prefix, prefix[i] - limit))
            best_val = math.inf
            best_j = -1
            for j in range(j_min, i):
                prev = g_prev[j]
                if prev == math.inf:
                    continue
                seg = prefix[i] - prefix[j]
                val = prev + seg * seg
                if val < best_val * (1.0 - _REL_TOL) or best_j < 0:
                    best_val = val
                    best_j = j
            g[i] = best_val
            arg[i] = best_j
        choice.append(arg)
        g_prev = g
    if g_prev[n] == math.inf:  # pragma: no cover - the minimax split always satisfies the limit
        raise AssertionError("no segmentation within the optimal bound")
    bounds = [n]
    i = n
    for kk in range(k, 1, -1):
        i = choice[kk - 1][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [(bounds[s], bounds[s + 1]) for s in range(k)]


def segment_costs(costs: Sequence[float], segments: Sequence[tuple[int, int]]) -> list[float]:
    """The total cost of each segment."""
    return [float(sum(costs[a:b])) for a, b in segments]


def max_segment_cost(costs: Sequence[float], k: int) -> float:
    """The optimal value of problem (2) for ``min(k, len(costs))`` segments (0 for an empty sequence)."""
    if not costs:
        return 0.0
    prefix = _prefix(costs)
    return _minimax(prefix, min(max(k, 1), len(costs)))
