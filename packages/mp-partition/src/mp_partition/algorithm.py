"""The tree partitioning algorithm (docs/partition.md).

Breadth-first over the ModuleNode tree, starting with ``P(root) = [0, D)``. Each node ``n`` takes the
first device of ``P(n)``; if ``|P(n)| > 1`` its children (in execution order) are split into ``|P(n)|``
contiguous segments of balanced cost by dynamic programming and the devices are shared among the segments
by D'Hondt's method. A segment then

1. with no device: its nodes take ``P[0]``, the first device of the set being shared;
2. with one device, or with one node: its nodes take the segment's devices (a single node with several
   devices splits them further when the breadth-first walk reaches it);
3. with several devices and several nodes: is segmented and allocated again, recursively.

A node with several devices and no children keeps the first one (the others get nothing from it).

How many devices each segment gets is D'Hondt's; which ones is decided so that the plan balances and reads
as a pipeline. ``P[0]`` also carries the parent node and every segment left without a device, so it goes to
the segment where that extra load raises the largest per-device load least, the earliest such segment on
ties (so partition 0 gets fewer decoder layers, balancing the fact that it holds other layers such as
embedding and lm_head); the other devices are handed out in execution order, so
consecutive segments get consecutive partitions. (Algorithm 3 read literally hands each device to the
current largest quotient, which gives the same counts but scatters the identities;
:func:`mp_partition.dhondt.dhondt_allocate` implements that reading.) Deterministic: the same tree and costs
always give the same assignment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .dhondt import dhondt_seats
from .nodes import ModuleNode
from .segment import optimal_segments, segment_costs

__all__ = ["TreeAssignment", "allocate_devices", "hand_out_devices", "partition_tree"]

_REL_TOL = 1e-9


@dataclass(frozen=True)
class TreeAssignment:
    """The outcome of Algorithm 1, keyed by ``ModuleNode.index``."""

    device: dict[int, int]
    """d(n): the partition each node is assigned to."""
    devices: dict[int, tuple[int, ...]]
    """P(n): the devices responsible for each node's subtree."""


def allocate_devices(
    devices: Sequence[int], costs: Sequence[float], carry: float = 0.0
) -> list[tuple[int, ...]]:
    """Algorithm 2 on plain costs: the device set P(n_i) of each of a sequence of sibling nodes.

    ``devices`` is P of the parent (at least one device); ``costs`` the normalized costs of the siblings in
    execution order; ``carry`` the parent's own cost, which stays on ``devices[0]``.
    """
    if not devices:
        raise ValueError("allocate_devices needs at least one device")
    result: list[tuple[int, ...]] = [()] * len(costs)
    _partition(list(devices), list(range(len(costs))), costs, result, carry)
    return result


def hand_out_devices(
    devices: Sequence[int], costs: Sequence[float], seats: Sequence[int], carry: float = 0.0
) -> list[list[int]]:
    """Which devices each segment gets, given how many (``seats``, from D'Hondt).

    ``devices[0]`` also holds ``carry`` (the parent node's own cost) and the segments without seats. It
    goes to the segment for which the largest per-device load (segment cost over its seats, plus that
    extra for the segment holding ``devices[0]``) is smallest, the earliest segment on ties; the remaining
    devices go, in order, to the segments in order.
    """
    if sum(seats) != len(devices):
        raise ValueError(f"{sum(seats)} seats for {len(devices)} devices")
    holders = [i for i, n in enumerate(seats) if n > 0]
    out: list[list[int]] = [[] for _ in seats]
    if not holders:
        return out
    extra = carry + sum(c for c, n in zip(costs, seats, strict=True) if n == 0)
    load = {i: costs[i] / seats[i] for i in holders}

    def worst(first: int) -> float:
        others = max((load[i] for i in holders if i != first), default=0.0)
        return max(load[first] + extra, others)

    best = min(worst(i) for i in holders)
    first = next(i for i in holders if worst(i) <= best + abs(best) * _REL_TOL)
    out[first].append(devices[0])
    rest = iter(devices[1:])
    for i, n in enumerate(seats):
        while len(out[i]) < n:
            out[i].append(next(rest))
    return out


def _partition(
    devices: list[int], items: list[int], costs: Sequence[float], out: list[tuple[int, ...]], carry: float
) -> None:
    item_costs = [float(costs[i]) for i in items]
    segments = optimal_segments(item_costs, len(devices))
    totals = segment_costs(item_costs, segments)
    allocation = hand_out_devices(devices, totals, dhondt_seats(totals, len(devices)), carry)
    for (start, stop), seg_devices in zip(segments, allocation, strict=True):
        members = items[start:stop]
        if not seg_devices:
            for i in members:
                out[i] = (devices[0],)
        elif len(members) == 1 or len(seg_devices) == 1:
            for i in members:
                out[i] = tuple(seg_devices)
        else:
            # several devices and several nodes: the segment is strictly shorter than `items`
            # (it is one of at least two segments), so the recursion terminates.
            _partition(seg_devices, members, costs, out, 0.0)


def partition_tree(root: ModuleNode, num_partitions: int) -> TreeAssignment:
    """Algorithm 1 over a tree whose costs are assigned (see :func:`mp_partition.cost.assign_costs`)."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    device: dict[int, int] = {}
    devices: dict[int, tuple[int, ...]] = {root.index: tuple(range(num_partitions))}
    queue: deque[ModuleNode] = deque([root])
    while queue:
        node = queue.popleft()
        p = devices[node.index]
        device[node.index] = p[0]
        if not node.children:
            continue
        if len(p) > 1:
            child_sets = allocate_devices(p, [c.cost for c in node.children], node.own_cost)
        else:
            child_sets = [(p[0],)] * len(node.children)
        for child, child_set in zip(node.children, child_sets, strict=True):
            devices[child.index] = child_set
            queue.append(child)
    return TreeAssignment(device=device, devices=devices)
