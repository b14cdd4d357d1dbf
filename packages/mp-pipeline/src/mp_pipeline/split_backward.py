"""Split backward: a call's input gradients now, its weight gradients later (docs/pipeline.md).

A zero-bubble schedule sends a call's input gradients upstream as soon as they exist and computes the
gradients of the call's parameters later, when the rank would otherwise wait. :func:`backward_input`
does the first half on the live autograd graph of any module (no traced graph) and returns a
:class:`WeightGrad` that does the second half.

The graph below the call's outputs splits in two. The *input side* is every node on a path from an
output to an input (what ``torch.autograd.grad`` to the inputs runs); the rest is the *weight side*, and
no weight-side node leads back to the input side (it would then lie on a path to an input). The
gradient enters the weight side only (a) at an output whose node is on the weight side, with the
output's own gradient, or (b) through an input-side node with a child on the weight side that leads to
a parameter (a *boundary* node: the matmul of a ``Linear``, whose ``dW`` output the input pass does not
compute). The input pass records what flows into each boundary node (a pre-hook); the weight pass runs
each boundary node again on that gradient, asking only for the parameters below its weight-side
children, so the node computes only its weight-side outputs and none of the input pass is redone.
Nodes of the input side below a boundary node are fenced with a pre-hook that passes zeros on (they run
only where a parameter is reachable both ways, e.g. a parameter shared by two ops of the call). The
parameters' gradients of all entries are summed per parameter and accumulated through the parameters'
own ``AccumulateGrad`` nodes (``torch.autograd.backward`` on the parameters), exactly as a full backward
accumulates them into ``.grad``, post-accumulate hooks included.

torch.distributed.pipelining does the same with ``stage_backward_input``/``stage_backward_weight``;
this module also covers calls whose inputs do not require grad and outputs that reach parameters
without touching an input.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from mp_pipeline.errors import SplitBackwardError

__all__ = ["WeightGrad", "WeightQueue", "backward_input"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass(slots=True)
class _Entry:
    """Where the weight pass starts: gradient edges with their gradients, the parameters below them, the
    node whose incoming gradient is pinned to what the input pass saw, and the input-side nodes fenced
    off with zeros."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    pinned: Node | None = None
    pinned_grads: Grads = ()
    fenced: list[Node] = field(default_factory=list)


class WeightGrad:
    """The weight half of one call's backward, kept by :func:`backward_input` until :meth:`run`.

    It holds the boundary nodes (and through them the part of the graph the weight gradients need) and
    the gradients that flowed into them; :meth:`run` accumulates the parameters' gradients into
    ``.grad`` and drops all of it, as does :meth:`discard` without computing anything."""

    __slots__ = ("_entries", "_state")

    def __init__(self, entries: list[_Entry]) -> None:
        self._entries: list[_Entry] | None = entries
        self._state = "pending"

    @property
    def pending(self) -> bool:
        """Whether :meth:`run` has not run yet (nor :meth:`discard`)."""
        return self._state == "pending"

    @property
    def empty(self) -> bool:
        """Whether no parameter gets a gradient from this call (nothing to run)."""
        return not self._entries

    def run(self) -> None:
        """Computes the parameters' gradients and accumulates them into ``.grad``; then frees the graph
        this object kept."""
        entries = self._take("run")
        totals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for entry in entries:
            for param, grad in zip(entry.params, _entry_grads(entry), strict=True):
                if grad is None:
                    continue
                seen = totals.get(id(param))
                totals[id(param)] = (param, grad if seen is None else seen[1] + grad)
        if totals:
            params = [p for p, _ in totals.values()]
            torch.autograd.backward(params, [g for _, g in totals.values()], inputs=params)

    def discard(self) -> None:
        """Drops the kept graph without computing the weight gradients (a step that failed)."""
        self._take("discard")

    def _take(self, what: str) -> list[_Entry]:
        if self._entries is None:
            raise SplitBackwardError(
                f"WeightGrad.{what}() called after {self._state}(): the weight half of a call's backward "
                "runs once; keep one WeightGrad per backward_input call and run it once"
            )
        entries, self._entries = self._entries, None
        self._state = what
        return entries


def _entry_grads(entry: _Entry) -> Grads:
    handles = []
    try:
        if entry.pinned is not None:
            pinned = entry.pinned_grads
            handles.append(entry.pinned.register_prehook(lambda _g: pinned))
        for node in entry.fenced:
            handles.append(node.register_prehook(_zeros))
        return torch.autograd.grad(
            entry.edges, entry.params, entry.grads, retain_graph=True, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()


def _zeros(grads: Grads) -> Grads:
    return tuple(None if g is None else torch.zeros_like(g) for g in grads)


def backward_input(
    outputs: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor | GradientEdge | None],
    params: Iterable[torch.Tensor],
    *,
    must_run: Sequence[torch.Tensor | GradientEdge] = (),
) -> tuple[Grads, WeightGrad]:
    """The input half of the backward of one call: the gradients of ``inputs`` (None where an input is
    None, does not require grad or gets none), and the weight half to run later.

    ``outputs`` are the call's outputs (tensors or their gradient edges) and ``grads`` their gradients
    (None: the output got none); ``params`` the parameters whose gradients the weight half accumulates
    (the module's; others reachable from the outputs are left alone, as are the inputs' ``.grad``).

    ``must_run``: leaves whose gradient the input half must compute because a node above them acts when
    it runs (the anchor of a call made to another rank inside this one: its backward sends that call's
    backward request) and so must run exactly once. Where such a node also leads to a parameter, the
    weight half could need it again: the whole backward then runs now and the weight half is empty.
    """
    if len(outputs) != len(grads):
        raise SplitBackwardError(
            f"backward_input got {len(outputs)} outputs and {len(grads)} gradients: expected one gradient "
            "(or None) per output; pass grads in the order of outputs"
        )
    roots: list[GradientEdge] = []
    root_grads: list[torch.Tensor] = []
    for out, grad in zip(outputs, grads, strict=True):
        edge = _edge(out)
        if edge is not None and grad is not None:
            roots.append(edge)
            root_grads.append(grad)
    in_edges = [_edge(x) for x in inputs]
    wanted = [(i, e) for i, e in enumerate(in_edges) if e is not None]
    by_node = {}
    for p in params:
        edge = _edge(p)
        if edge is not None:
            by_node[edge.node] = p
    musts = [e for e in map(_edge, must_run) if e is not None]
    graph = _Graph(roots, {e.node for _, e in wanted}, by_node, {e.node for e in musts})
    if not graph.separable:
        return _whole(roots, root_grads, wanted, musts, by_node, n_inputs=len(inputs))

    captured: dict[Node, Grads] = {}
    handles = [m.register_prehook(_capture(captured, m)) for m in graph.boundary]
    try:
        found: Grads = ()
        if roots and (wanted or musts) and graph.input_side:
            found = torch.autograd.grad(
                roots, [e for _, e in wanted] + musts, root_grads, retain_graph=True, allow_unused=True
            )
    finally:
        for h in handles:
            h.remove()
    input_grads: list[torch.Tensor | None] = [None] * len(inputs)
    for (i, _), g in zip(wanted, found, strict=False):
        input_grads[i] = g
    return tuple(input_grads), WeightGrad(graph.entries(roots, root_grads, captured))


def _whole(
    roots: list[GradientEdge],
    root_grads: list[torch.Tensor],
    wanted: list[tuple[int, GradientEdge]],
    musts: list[GradientEdge],
    params: dict[Node, torch.Tensor],
    *,
    n_inputs: int,
) -> tuple[Grads, WeightGrad]:
    """The whole backward at once (what ``backward_input`` does when it cannot split): input gradients
    returned, parameter gradients accumulated as the weight half would."""
    plist = list(params.values())
    targets = [e for _, e in wanted] + musts + [get_gradient_edge(p) for p in plist]
    found: Grads = (
        torch.autograd.grad(roots, targets, root_grads, allow_unused=True)
        if roots
        else (None,) * len(targets)
    )
    used = [(p, g) for p, g in zip(plist, found[len(wanted) + len(musts) :], strict=True) if g is not None]
    if used:
        torch.autograd.backward([p for p, _ in used], [g for _, g in used], inputs=[p for p, _ in used])
    input_grads: list[torch.Tensor | None] = [None] * n_inputs
    for (i, _), g in zip(wanted, found, strict=False):
        input_grads[i] = g
    return tuple(input_grads), WeightGrad([])


def _capture(store: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def hook(grad_outputs: Grads) -> None:
        store[node] = tuple(grad_outputs)

    return hook


def _edge(x: torch.Tensor | GradientEdge | None) -> GradientEdge | None:
    if x is None:
        return None
    if isinstance(x, GradientEdge):
        return x
    if not x.requires_grad:
        return None
    return get_gradient_edge(x)


class _Graph:
    """The part of the autograd graph below ``roots``, split into its input and weight sides."""

    def __init__(
        self,
        roots: list[GradientEdge],
        inputs: set[Node],
        params: dict[Node, torch.Tensor],
        musts: set[Node] | None = None,
    ) -> None:
        self.params = params
        musts = musts or set()
        stop = inputs | musts
        order = _post_order([e.node for e in roots], stop=stop)
        self.input_side: set[Node] = set()
        self.below: dict[Node, frozenset[Node]] = {}
        """For each weight-side node, the parameter nodes it leads to through weight-side nodes."""
        self.separable = True
        """False where a node above a ``must_run`` leaf also leads to a parameter (see backward_input)."""
        leads: dict[Node, bool] = {}  # leads to a parameter, either side
        for node in order:  # children first
            kids = [] if node in stop else [k for k, _ in node.next_functions if k is not None]
            leads[node] = node in params or any(leads.get(k, False) for k in kids)
            if musts and any(k in musts for k in kids) and leads[node]:
                self.separable = False
            if node in stop:
                self.input_side.add(node)
                continue
            if any(k in self.input_side for k in kids):
                self.input_side.add(node)
                continue
            reach = frozenset([node]) if node in params else frozenset()
            for k in kids:
                reach |= self.below.get(k, frozenset())
            self.below[node] = reach
        self.boundary = [
            n
            for n in order
            if n in self.input_side
            and n not in stop
            and any(k is not None and self.below.get(k) for k, _ in n.next_functions)
        ]

    def entries(
        self, roots: list[GradientEdge], root_grads: list[torch.Tensor], captured: dict[Node, Grads]
    ) -> list[_Entry]:
        out: list[_Entry] = []
        weight_roots = [(e, g) for e, g in zip(roots, root_grads, strict=True) if self.below.get(e.node)]
        if weight_roots:
            reach = frozenset().union(*(self.below[e.node] for e, _ in weight_roots))
            out.append(
                _Entry([e for e, _ in weight_roots], [g for _, g in weight_roots], self._params(reach))
            )
        for node in self.boundary:
            seen = captured.get(node)
            if seen is None or all(g is None for g in seen):
                continue  # no gradient reached it
            kids = [k for k, _ in node.next_functions if k is not None]
            reach = frozenset().union(*(self.below.get(k, frozenset()) for k in kids))
            edges = [GradientEdge(node, j) for j, g in enumerate(seen) if g is not None]
            out.append(
                _Entry(
                    edges,
                    [g for g in seen if g is not None],
                    self._params(reach),
                    pinned=node,
                    pinned_grads=seen,
                    fenced=[k for k in kids if k in self.input_side],
                )
            )
        return out

    def _params(self, nodes: frozenset[Node]) -> list[torch.Tensor]:
        return [self.params[n] for n in nodes]


def _post_order(roots: list[Node], stop: set[Node]) -> list[Node]:
    """Every node reachable from ``roots`` (not below the ``stop`` nodes), each after its children."""
    order: list[Node] = []
    done: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in done:
            continue
        done.add(node)
        stack.append((node, True))
        if node in stop:
            continue
        for kid, _ in node.next_functions:
            if kid is not None and kid not in done:
                stack.append((kid, False))
    return order


class WeightQueue:
    """The weight halves a rank deferred (``"pipeline": "zero_bubble"``), oldest first.

    The server runs one whenever the rank would otherwise wait for a message (:meth:`run_one`); before
    a forward, the oldest run while ``limit`` microbatches or more have halves pending (:meth:`make_room`,
    ZB-H1's bound: each pending half keeps its call's graph); the step drains the rest before its
    gradients are reduced (:meth:`drain`), or drops them when it fails (:meth:`discard`). ``context``
    gives the context each half runs in (the call's grad mode and autocast)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise SplitBackwardError(f"WeightQueue limit={limit}: expected >= 1 (microbatches pending)")
        self.limit = limit
        self._items: deque[tuple[int, WeightGrad, Callable[[], contextlib.AbstractContextManager[object]]]]
        self._items = deque()
        self.ran_idle = 0
        """Halves run while the rank waited (the bubble they filled), over the queue's life."""
        self.ran_early = 0
        """Halves run before a forward to respect ``limit``."""
        self.ran_at_end = 0
        """Halves run when the step drained the queue."""

    def __len__(self) -> int:
        return len(self._items)

    def add(
        self,
        microbatch: int,
        half: WeightGrad,
        context: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> None:
        """Defers ``half`` (of a call of ``microbatch``), to run in ``context()``."""
        if not half.empty:
            self._items.append((microbatch, half, context))

    def run_one(self) -> bool:
        """Runs the oldest pending half; False if none was pending."""
        if not self._items:
            return False
        self._run()
        self.ran_idle += 1
        return True

    def make_room(self, microbatch: int) -> None:
        """Before a forward of ``microbatch``: run the oldest halves while ``limit`` other microbatches
        or more have halves pending."""
        while len({m for m, _, _ in self._items if m != microbatch}) >= self.limit:
            self._run()
            self.ran_early += 1

    def drain(self) -> None:
        """Runs every pending half, oldest first."""
        while self._items:
            self._run()
            self.ran_at_end += 1

    def discard(self) -> None:
        """Drops every pending half without computing it (the step failed)."""
        while self._items:
            self._items.popleft()[1].discard()

    def _run(self) -> None:
        _, half, context = self._items.popleft()
        with context():
            half.run()
