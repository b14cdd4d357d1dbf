"""The cost model (docs/partition.md) and normalized costs.

Each module m gets ``C̄(m) = α·w(m) + (1−α)·ψ(m)`` where α is the memory weight, w the memory cost and ψ
the compute cost; a node costs the sum over its modules plus its children's costs,
``C(n) = Σ_{m∈M(n)} C̄(m) + Σ_{p∈Q(n)} C(p)``, and ``c(n) = C(n)/C(r)``.

So that a subtree's cost counts each parameter and each unit of work once, w and ψ here are a module's
*own* share; summed over a subtree they give exactly the seed's per-subtree quantities:

* w: bytes of the module's direct parameters and buffers plus the activation memory the trace attributed
  to it. Over a subtree: the parameters "including its submodules" plus their activations.
* ψ: the measured forward time of the module minus that of its submodules when times were measured;
  otherwise the number of times it ran in the trace, or 1 without a trace. Over a subtree: its forward
  time, or its number of (executed) modules, the seed's proxy when times are not measured.

Memory is in bytes and compute in seconds or counts, so each is divided by its total over the model
before they are mixed; α then means what the ``memory_weight`` setting says: 1.0 balances memory only,
0.0 compute only. If the model has no memory (or no compute) at all, the other term takes the full
weight. The normalized costs satisfy ``c(r) = 1`` and ``c(n) >= Σ c(children)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PartitionError
from .nodes import ModuleNode

__all__ = ["CostTotals", "assign_costs", "check_memory_weight", "node_compute"]


@dataclass(frozen=True)
class CostTotals:
    """Model-wide totals the costs were normalized by."""

    memory_bytes: int
    compute: float
    compute_unit: str
    """``seconds`` (measured), ``calls`` (traced, not timed) or ``modules`` (not traced)."""
    memory_weight: float
    effective_memory_weight: float
    """α actually used: differs from ``memory_weight`` only when memory or compute totals are zero."""


def check_memory_weight(memory_weight: float) -> float:
    """Validates α and returns it as a float."""
    if isinstance(memory_weight, bool) or not isinstance(memory_weight, (int, float)):
        raise PartitionError(
            f"memory_weight {memory_weight!r} is invalid: expected a float in [0, 1]; "
            "pass e.g. 0.8 (balance memory) or 0.2 (balance compute)"
        )
    alpha = float(memory_weight)
    if not 0.0 <= alpha <= 1.0:
        raise PartitionError(
            f"memory_weight {alpha!r} is out of range: expected a float in [0, 1]; "
            "1.0 balances memory only, 0.0 compute only"
        )
    return alpha


def node_compute(node: ModuleNode, unit: str) -> float:
    """ψ of a node's own modules in the given unit."""
    if unit == "seconds":
        return node.self_time_s or 0.0
    if unit == "calls":
        return float(node.calls)
    return float(len(node.modules))


def assign_costs(root: ModuleNode, memory_weight: float, *, compute_unit: str | None = None) -> CostTotals:
    """Fills ``own_cost`` and ``cost`` (normalized) of every node under ``root``.

    ``compute_unit`` defaults to ``seconds`` if the tree carries measured times, ``calls`` if it carries a
    trace, ``modules`` otherwise.
    """
    alpha = check_memory_weight(memory_weight)
    nodes = list(root.walk())
    if compute_unit is None:
        if any(n.self_time_s is not None for n in nodes):
            compute_unit = "seconds"
        elif any(n.calls > 0 for n in nodes):
            compute_unit = "calls"
        else:
            compute_unit = "modules"
    if compute_unit not in ("seconds", "calls", "modules"):
        raise PartitionError(
            f"compute_unit {compute_unit!r} is invalid: expected 'seconds', 'calls' or 'modules'"
        )
    memory = [n.memory_bytes for n in nodes]
    compute = [node_compute(n, compute_unit) for n in nodes]
    total_memory = sum(memory)
    total_compute = sum(compute)
    if compute_unit == "seconds" and total_compute <= 0.0:
        # a trace so fast that nothing registered: fall back to execution counts
        compute_unit = "calls"
        compute = [node_compute(n, "calls") for n in nodes]
        total_compute = sum(compute)
    effective = alpha
    if total_memory == 0:
        effective = 0.0
    if total_compute <= 0.0:
        effective = 1.0
    if total_memory == 0 and total_compute <= 0.0:
        # nothing measurable at all: every module counts the same
        compute_unit = "modules"
        compute = [node_compute(n, "modules") for n in nodes]
        total_compute = sum(compute)
        effective = 0.0
    for node, w, psi in zip(nodes, memory, compute, strict=True):
        mem_term = w / total_memory if total_memory else 0.0
        cmp_term = psi / total_compute if total_compute else 0.0
        node.own_cost = effective * mem_term + (1.0 - effective) * cmp_term
    for node in reversed(nodes):  # children before parents
        node.cost = node.own_cost + sum(c.cost for c in node.children)
    scale = root.cost
    if scale > 0.0:
        for node in nodes:
            node.own_cost /= scale
            node.cost /= scale
    root.cost = 1.0
    return CostTotals(
        memory_bytes=total_memory,
        compute=total_compute,
        compute_unit=compute_unit,
        memory_weight=alpha,
        effective_memory_weight=effective,
    )
