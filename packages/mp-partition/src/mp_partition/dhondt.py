"""D'Hondt allocation of devices to segments (docs/partition.md).

Devices are handed out one at a time, in the order given, each to the segment with the largest quotient
``c_i / (n_i + 1)`` where ``n_i`` is the number of devices the segment already holds. (Algorithm 3 in
the seed writes the divisor with one counter shared by all segments; that is not D'Hondt's method, which
the text names and whose property it cites: with a shared counter the quotients shrink factorially and
the devices alternate between segments almost regardless of their costs. We implement D'Hondt's method.)

Quotients within a relative 1e-9 of the largest count as tied; a tie goes to the segment with the larger
cost (the seed's bias towards larger segments), then to the earlier one. If every cost is zero, all
segments count as equal. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["dhondt_allocate", "dhondt_seats"]

_REL_TOL = 1e-9


def _winner(costs: Sequence[float], seats: Sequence[int]) -> int:
    quotients = [c / (s + 1) for c, s in zip(costs, seats, strict=True)]
    top = max(quotients)
    threshold = top - abs(top) * _REL_TOL
    best = -1
    for i, q in enumerate(quotients):
        if q >= threshold and (best < 0 or costs[i] > costs[best] * (1.0 + _REL_TOL)):
            best = i
    return best


def _checked(costs: Sequence[float]) -> list[float]:
    if not costs:
        raise ValueError("D'Hondt allocation needs at least one segment")
    values = [float(c) for c in costs]
    for c in values:
        if not c >= 0.0 or c == float("inf"):
            raise ValueError(f"segment costs must be finite and non-negative, got {c!r}")
    if all(c == 0.0 for c in values):
        return [1.0] * len(values)
    return values


def dhondt_allocate(devices: Sequence[int], costs: Sequence[float]) -> list[list[int]]:
    """Algorithm 3: the devices given to each segment, each list in the order the devices were handed out."""
    values = _checked(costs)
    seats = [0] * len(values)
    allocation: list[list[int]] = [[] for _ in values]
    for device in devices:
        k = _winner(values, seats)
        allocation[k].append(device)
        seats[k] += 1
    return allocation


def dhondt_seats(costs: Sequence[float], num_seats: int) -> list[int]:
    """How many of ``num_seats`` devices D'Hondt's method gives each segment."""
    if num_seats < 0:
        raise ValueError(f"number of seats must be >= 0, got {num_seats}")
    return [len(a) for a in dhondt_allocate(range(num_seats), costs)]
