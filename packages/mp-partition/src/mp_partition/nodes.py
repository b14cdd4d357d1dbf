"""The ModuleNode tree (docs/partition.md).

Modules and parameters form a bipartite graph with an edge between a module and each parameter it holds
directly; each connected component is one ModuleNode, so modules that share parameters (a tied embedding
and LM head) are one node and always land on one partition. Node ``i`` is the parent of node ``j`` when a
module of ``i`` has a module of ``j`` as a direct child; a node with several parents (a module reused in
several places, or a tied node whose modules sit under different parents) keeps the one met first in a
breadth-first walk from the root, i.e. a shallowest one. The tree follows the module hierarchy, not the
forward code; a trace only orders each node's children by when their subtrees first ran (children that
never ran come last, in registration order).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from ._walk import ModuleEntry, walk_modules
from .timing import ModuleTimes
from .trace import TraceResult

__all__ = ["ModuleNode", "build_module_tree"]


@dataclass(eq=False)
class ModuleNode:
    """One or more modules that share parameters, with the statistics the cost model uses.

    Sizes are the node's own (its modules' direct parameters and buffers, each counted once), not its
    subtree's. ``own_cost`` and ``cost`` are filled by :func:`mp_partition.cost.assign_costs`: ``cost`` is
    the normalized cost c(n) of the whole subtree, ``own_cost`` the part of it from this node's modules.
    """

    index: int
    """Position in breadth-first order (the root is 0)."""
    modules: tuple[nn.Module, ...]
    """The modules of this node, in ``named_modules()`` order."""
    paths: tuple[str, ...]
    """Canonical path of each module (``""`` is the model itself)."""
    aliases: tuple[str, ...]
    """Every path that reaches one of this node's modules (canonical paths included)."""
    class_names: tuple[str, ...]
    parent: ModuleNode | None = None
    children: list[ModuleNode] = field(default_factory=list)
    num_parameters: int = 0
    parameter_bytes: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    """Activation memory attributed to the node's modules by the trace (0 without a trace)."""
    calls: int = 0
    """Forward calls of the node's modules in the trace (0 without a trace)."""
    self_time_s: float | None = None
    """Measured time of the node's modules, excluding submodules (None when not measured): forward plus
    backward when the step was timed (:mod:`mp_partition.timing`), else the trace's forward time."""
    first_call: int | None = None
    """Earliest first-call sequence number in this node's subtree (None when nothing in it ran)."""
    own_ops: int | None = None
    """Torch operations returning a tensor that the node's modules ran in their own code (their
    submodules' excluded), in the trace; None without a trace that counted them."""
    own_cost: float = 0.0
    cost: float = 0.0

    @property
    def is_container(self) -> bool:
        """Whether the node only holds and chains its children: it has children, is not the root, its own
        code ran no tensor operation in the trace, and each child ran as often as it did (each once per
        call: an ``nn.Sequential`` of blocks), or, for a node that never ran itself (an
        ``nn.ModuleList``), all its children ran equally often. Where such a node's children run adds no
        round trip through it, so the balancer may split it between stages. A block whose own forward
        computes (a residual add, attention) is not one, nor a module that calls a child twice (T5's
        stack runs its dropout before and after its blocks). Decided from the trace, not the class."""
        if not self.children or self.parent is None or self.own_ops != 0:
            return False
        ran = {c.calls for c in self.children}
        if self.calls > 0:
            return ran == {self.calls}
        return len(ran) == 1 and min(ran) > 0

    @property
    def path(self) -> str:
        """Canonical path of the node's first module."""
        return self.paths[0]

    @property
    def memory_bytes(self) -> int:
        """The node's own memory: parameters, buffers and activations."""
        return self.parameter_bytes + self.buffer_bytes + self.activation_bytes

    @property
    def label(self) -> str:
        """A short human name: the paths of its modules relative to the parent node's first path."""
        if self.parent is None and self.paths[0] == "":
            names = [self.class_names[0]] + [p for p in self.paths[1:]]
            return " + ".join(names)
        base = self.parent.path if self.parent is not None else ""
        rel = [_relative(p, base) for p in self.paths]
        return " + ".join(rel)

    def walk(self) -> Iterator[ModuleNode]:
        """This node and its descendants in breadth-first order."""
        queue: deque[ModuleNode] = deque([self])
        while queue:
            node = queue.popleft()
            yield node
            queue.extend(node.children)

    def __repr__(self) -> str:
        return (
            f"ModuleNode({self.label!r}, modules={len(self.modules)}, children={len(self.children)}, "
            f"cost={self.cost:.4f})"
        )


def _relative(path: str, base: str) -> str:
    if base and path.startswith(base + "."):
        return path[len(base) + 1 :]
    return path if path else "<root>"


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # the smaller index stays the representative, so components are named by their first module
            if rb < ra:
                ra, rb = rb, ra
            self.parent[rb] = ra


def _components(entries: list[ModuleEntry]) -> list[list[int]]:
    """Connected components of the module-parameter graph, each a sorted list of entry indices."""
    uf = _UnionFind(len(entries))
    owner: dict[int, int] = {}
    for entry in entries:
        for param in entry.module._parameters.values():
            if param is None:
                continue
            first = owner.setdefault(id(param), entry.index)
            uf.union(first, entry.index)
    groups: dict[int, list[int]] = {}
    for entry in entries:
        groups.setdefault(uf.find(entry.index), []).append(entry.index)
    return [groups[k] for k in sorted(groups)]


def build_module_tree(
    model: nn.Module, trace: TraceResult | None = None, times: ModuleTimes | None = None
) -> ModuleNode:
    """Builds the ModuleNode tree of ``model``; with a ``trace``, children follow execution order.

    Every module of the model belongs to exactly one node, whether or not the trace saw it run. With
    ``times`` (a timed step), a node's time is its modules' forward plus backward time; the time spent
    outside every module (the loss, the autograd engine) counts as the root's.
    """
    entries = walk_modules(model)
    components = _components(entries)
    node_of_entry: dict[int, int] = {}
    for ci, members in enumerate(components):
        for m in members:
            node_of_entry[m] = ci
    # Breadth-first discovery over the node graph: the first parent to reach a node keeps it.
    root_comp = node_of_entry[0]
    parent_of: dict[int, int | None] = {root_comp: None}
    children_of: dict[int, list[int]] = {root_comp: []}
    order: list[int] = [root_comp]
    queue: deque[int] = deque([root_comp])
    while queue:
        ci = queue.popleft()
        for m in components[ci]:
            for child in entries[m].children:
                cj = node_of_entry[child]
                if cj != ci and cj not in parent_of:
                    parent_of[cj] = ci
                    children_of[ci].append(cj)
                    children_of[cj] = []
                    order.append(cj)
                    queue.append(cj)
    assert len(order) == len(components), "every module is reachable from the root"

    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    nodes: dict[int, ModuleNode] = {}
    for ci in order:
        group = [entries[m] for m in components[ci]]
        node = ModuleNode(
            index=-1,
            modules=tuple(e.module for e in group),
            paths=tuple(e.path for e in group),
            aliases=tuple(a for e in group for a in e.aliases),
            class_names=tuple(type(e.module).__name__ for e in group),
        )
        for e in group:
            for p in e.module._parameters.values():
                if p is not None and id(p) not in seen_params:
                    seen_params.add(id(p))
                    node.num_parameters += int(p.numel())
                    node.parameter_bytes += int(p.numel()) * int(p.element_size())
            for b in e.module._buffers.values():
                if b is not None and id(b) not in seen_buffers:
                    seen_buffers.add(id(b))
                    node.buffer_bytes += int(b.numel()) * int(b.element_size())
            if trace is not None:
                stats = trace.stats(e.path)
                node.activation_bytes += trace.activation_bytes(e.path)
                node.calls += stats.calls
                if stats.self_time_s is not None:
                    node.self_time_s = (node.self_time_s or 0.0) + stats.self_time_s
                if stats.first_call is not None:
                    node.first_call = (
                        stats.first_call
                        if node.first_call is None
                        else min(node.first_call, stats.first_call)
                    )
        if trace is not None:
            counted = [trace.stats(e.path).own_ops for e in group]
            node.own_ops = None if None in counted else sum(c for c in counted if c is not None)
        if times is not None:  # a timed step (forward + backward) supersedes the trace's forward times
            node.self_time_s = sum(times.total_s(e.path) for e in group)
        nodes[ci] = node

    for ci in order:
        parent = parent_of[ci]
        if parent is not None:
            nodes[ci].parent = nodes[parent]
    # Subtree first calls (reverse breadth-first order visits children before parents).
    for ci in reversed(order):
        node = nodes[ci]
        for cj in children_of[ci]:
            fc = nodes[cj].first_call
            if fc is not None and (node.first_call is None or fc < node.first_call):
                node.first_call = fc
    for ci in order:
        kids = [nodes[cj] for cj in children_of[ci]]
        if trace is not None:
            position = {id(k): i for i, k in enumerate(kids)}
            kids.sort(
                key=lambda k: (
                    k.first_call is None,
                    k.first_call if k.first_call is not None else 0,
                    position[id(k)],
                )
            )
        nodes[ci].children = kids
    root = nodes[root_comp]
    for i, node in enumerate(root.walk()):
        node.index = i
    return root
