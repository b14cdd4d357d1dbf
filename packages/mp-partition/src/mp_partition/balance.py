"""Stage loads with the cost of remote calls, and a refinement that balances them.

The seed's algorithm (:mod:`mp_partition.algorithm`) splits each node's children among its devices
without knowing what those devices already carry from elsewhere: the parent's own work and the
modules left on the first device (embeddings, final norm, head) land on pipeline rank 0 on top of an
even share of the blocks. Nor does it know that a call from a module to a child on another rank costs
both ranks time (a request out and back, forward and backward), and that the module running the
model's own ``forward`` (the parent, on rank 0) makes most of those calls.

Here a stage's load is the sum of its nodes' own costs plus, for every call between two modules on
different stages, ``caller_overhead`` on the caller's stage and ``callee_overhead`` on the callee's.
:func:`refine` then moves single-stage subtrees ("units") across the boundaries between consecutive
units on different stages, one move at a time, always the move that lowers the largest load most
(ties: the lower sum of squared loads, then the earlier candidate, whole units before their parts),
until no move helps. A candidate is a boundary unit or, where the unit is a pure container
(:attr:`ModuleNode.is_container`: its own code ran no tensor operation in the trace and each child ran
once per call of it, as an ``nn.Sequential`` of blocks, or an ``nn.ModuleList``), the part of it next
to the boundary: its last child when moving forward, its first when moving back, and so on down while
that part is a container too.
Splitting a container adds a call boundary between two of its children, priced like any other, and no
round trip through the container, which computes nothing; a container whose children end up on two
stages stays on the stage of its first child (the one its caller reaches first), so that the calls
still go forward. With ``split`` any unit may be split that way, blocks included; ``auto_partition``
never splits a block with its own compute: the cut adds a round trip in the middle of the block (the
block's own code needs the output back) that the busy-time overheads do not price (on the looped GPT at
pp = 2, cutting block 3's last Linear made the step 11% slower in an interleaved A/B,
benchmarks/partition_stage_times.py). Moves happen at boundaries only, so the plan still reads as a
pipeline. Deterministic: the same tree, costs and calls give the same plan on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .nodes import ModuleNode

__all__ = ["CallCosts", "refine", "stage_loads", "subtree_devices", "units"]

_REL_TOL = 1e-9


@dataclass(frozen=True)
class CallCosts:
    """Calls between modules and what one remote call costs, in the unit of the node costs."""

    calls: Mapping[tuple[int, int], int]
    """(caller node index, callee node index) -> calls per step; same-node calls are left out."""
    caller_overhead: float = 0.0
    callee_overhead: float = 0.0


def stage_loads(
    nodes: Sequence[ModuleNode],
    device: Mapping[int, int],
    num_stages: int,
    calls: CallCosts | None = None,
    *,
    seconds: bool = False,
) -> list[float]:
    """Each stage's own node costs (or, with ``seconds``, measured times) plus its remote-call costs."""
    loads = [0.0] * num_stages
    for node in nodes:
        loads[device[node.index]] += (node.self_time_s or 0.0) if seconds else node.own_cost
    if calls is not None:
        for (caller, callee), n in calls.calls.items():
            a, b = device[caller], device[callee]
            if a != b:
                loads[a] += n * calls.caller_overhead
                loads[b] += n * calls.callee_overhead
    return loads


def units(root: ModuleNode, device: Mapping[int, int]) -> list[ModuleNode]:
    """The maximal subtrees that lie on one stage, in execution order (the tree's child order)."""
    out: list[ModuleNode] = []

    def single(node: ModuleNode) -> bool:
        return all(device[n.index] == device[node.index] for n in node.walk())

    def visit(node: ModuleNode) -> None:
        for child in node.children:
            if single(child):
                out.append(child)
            else:
                visit(child)

    if single(root):
        return [root]
    visit(root)
    return out


def _score(loads: Sequence[float]) -> tuple[float, float]:
    return max(loads), sum(x * x for x in loads)


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether score ``a`` beats ``b`` by more than rounding."""
    scale = max(abs(b[0]), 1e-300)
    if a[0] < b[0] - scale * _REL_TOL:
        return True
    if a[0] > b[0] + scale * _REL_TOL:
        return False
    return a[1] < b[1] - max(abs(b[1]), 1e-300) * _REL_TOL


def refine(
    root: ModuleNode,
    device: Mapping[int, int],
    num_stages: int,
    calls: CallCosts | None = None,
    *,
    split: bool = False,
    max_moves: int = 1000,
) -> dict[int, int]:
    """A copy of ``device`` with boundary units moved while that lowers the largest stage load: a whole
    unit, or the part of a pure container next to the boundary (its first or last child, recursively);
    with ``split``, the part next to the boundary of any unit."""
    nodes = list(root.walk())
    current = dict(device)
    score = _score(stage_loads(nodes, current, num_stages, calls))
    for _ in range(max_moves):
        seq = units(root, current)
        best: tuple[tuple[float, float], dict[int, int]] | None = None
        for i, unit in enumerate(seq):
            here = current[unit.index]
            for j in (i - 1, i + 1):
                if not 0 <= j < len(seq) or current[seq[j].index] == here:
                    continue
                target = current[seq[j].index]
                # the unit, or the piece of it next to the boundary: its first (or last) child, and so on
                piece: ModuleNode | None = unit
                while piece is not None:
                    trial = dict(current)
                    for n in piece.walk():
                        trial[n.index] = target
                    _follow_first_child(piece, trial)
                    if here in trial.values():  # never empty a stage that had modules
                        s = _score(stage_loads(nodes, trial, num_stages, calls))
                        if _better(s, score) and (best is None or _better(s, best[0])):
                            best = (s, trial)
                    kids = piece.children if split or piece.is_container else []
                    piece = (kids[0] if j < i else kids[-1]) if kids else None
        if best is None:
            break
        score, current = best
    return current


def _follow_first_child(piece: ModuleNode, device: dict[int, int]) -> None:
    """The pure containers above a moved ``piece`` (innermost first, up to the first that is not one)
    take the stage of their first child: a container's caller reaches it first, then its children in
    order, so the calls keep going forward, and a container whose children all moved moves with them."""
    node = piece.parent
    while node is not None and node.is_container:
        device[node.index] = device[node.children[0].index]
        node = node.parent


def subtree_devices(root: ModuleNode, device: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    """P(n) after refinement: the node's own stage first, then every other stage of its subtree."""
    out: dict[int, tuple[int, ...]] = {}
    for node in reversed(list(root.walk())):  # children before parents
        others = {d for c in node.children for d in out[c.index]}
        others.discard(device[node.index])
        out[node.index] = (device[node.index], *sorted(others))
    return out
