"""Pure containers: the trace counts each module's own tensor operations, and the balancer splits a
container (an ``nn.Sequential`` chaining blocks, an ``nn.ModuleList``) between stages where that
balances them, never a block whose own forward computes."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mp_partition import ModuleTimes, TraceResult, auto_partition, trace_model
from mp_partition.algorithm import partition_tree
from mp_partition.balance import CallCosts, refine, stage_loads
from mp_partition.cost import assign_costs
from mp_partition.nodes import ModuleNode, build_module_tree

from .models import Stack


class Residual(nn.Module):
    """A block whose own forward computes (the residual add and the activation)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b(F.relu(self.a(x))))


class Staged(nn.Module):
    """The benchmark CNN's layout: a stem, a ModuleList of Sequential stages of residual blocks, a head;
    the root computes between them."""

    def __init__(self, width: int = 8, stages: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.stages = nn.ModuleList(
            nn.Sequential(*(Residual(width) for _ in range(blocks))) for _ in range(stages)
        )
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean(dim=0, keepdim=True))


def _times(seconds: dict[str, float], calls: dict[tuple[str, str], int] | None = None) -> ModuleTimes:
    return ModuleTimes(
        forward_s=MappingProxyType(dict(seconds)),
        backward_s=MappingProxyType({}),
        call_counts=MappingProxyType(dict(calls or {})),
        device="cpu",
    )


def _staged_times(model: Staged, block_ms: list[float], head_ms: float = 0.2) -> ModuleTimes:
    """Each residual block's time as given (on its first Linear), 1 ms for the root and the stem,
    ``head_ms`` for the head; the calls the model makes (one per module call)."""
    seconds = {"": 1e-3, "stem": 1e-3, "head": head_ms * 1e-3}
    calls: dict[tuple[str, str], int] = {("", "stem"): 1, ("", "head"): 1}
    blocks = [(i, j) for i, stage in enumerate(model.stages) for j in range(len(stage))]  # type: ignore[arg-type]
    for (i, j), ms in zip(blocks, block_ms, strict=True):
        seconds[f"stages.{i}.{j}.a"] = ms * 1e-3
        calls[("", f"stages.{i}")] = 1
        calls[(f"stages.{i}", f"stages.{i}.{j}")] = 1
        calls[(f"stages.{i}.{j}", f"stages.{i}.{j}.a")] = 1
        calls[(f"stages.{i}.{j}", f"stages.{i}.{j}.b")] = 1
    return _times(seconds, calls)


def _trace(model: nn.Module, width: int = 8) -> TraceResult:
    return trace_model(model, (torch.randn(3, width),))


# -- the trace ----------------------------------------------------------------------------------------
def test_trace_counts_each_modules_own_tensor_operations() -> None:
    model = Staged()
    trace = _trace(model)
    assert trace.stats("stages").own_ops == 0 and trace.stats("stages").calls == 0  # a ModuleList
    assert trace.stats("stages.1").own_ops == 0 and trace.stats("stages.1").calls == 1  # a Sequential
    assert trace.stats("stages.1.0").own_ops == 3  # relu, add, relu; its Linears' ops are theirs
    assert trace.stats("stages.1.0.a").own_ops == 1  # F.linear
    assert trace.stats("").own_ops == 2  # relu, mean (the Linears' ops are theirs)
    again = TraceResult.from_dict(trace.to_dict())
    assert again.stats("stages.1.0").own_ops == 3
    old = trace.to_dict()  # a trace saved before own_ops was counted: unknown, so no container
    for stats in old["modules"].values():
        del stats["own_ops"]
    unknown = TraceResult.from_dict(old)
    assert unknown.stats("stages.1").own_ops is None
    assert not _node(build_module_tree(model, unknown), "stages.1").is_container


def _node(root: ModuleNode, path: str) -> ModuleNode:
    return next(n for n in root.walk() if path in n.paths)


def test_containers_are_decided_from_the_trace_not_the_class() -> None:
    class Adding(nn.Sequential):
        """A Sequential subclass that computes: its own add makes it a block, not a container."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x + super().forward(x)

    model = nn.Sequential(
        nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), Adding(nn.Linear(8, 8))
    )
    root = build_module_tree(model, _trace(model))
    assert _node(root, "1").is_container and not _node(root, "2").is_container
    assert not root.is_container  # the root (pp_rank 0's) is never split off
    assert not _node(root, "0").is_container  # a leaf
    assert not _node(build_module_tree(model), "1").is_container  # no trace: unknown

    class Twice(nn.Module):
        """Computes nothing itself but runs one child before and after the other (as T5's stack runs
        its dropout): not a chain, so no container: moving ``after`` alone would send the tensor back."""

        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.0)
            self.body = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.body(self.drop(x)))  # type: ignore[no-any-return]

    twice = nn.Sequential(nn.Linear(8, 8), Twice())
    tree = build_module_tree(twice, _trace(twice))
    assert _node(tree, "1").own_ops == 0 and not _node(tree, "1").is_container
    stack = build_module_tree(Stack(layers=2), _trace(Stack(layers=2), 16))
    assert _node(stack, "layers").is_container and not _node(stack, "layers.0").is_container


# -- the balancer -------------------------------------------------------------------------------------
BLOCKS = [f"stages.{i}.{j}" for i in range(4) for j in range(2)]
UNEVEN = [1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0]
"""Block times whose only balanced cut lies between stages.2's two blocks: rank 0 holds the root and the
stem (2 ms) and blocks 0-4 (11 ms), rank 1 blocks 5-7 and the head (15.2 ms); whole stages give
2 + 6 | 20.2 or 2 + 16 | 10.2."""


def _owners(plan: Any, paths: list[str]) -> list[int]:
    return [plan.owner(p) for p in paths]


def test_a_container_is_split_where_whole_units_cannot_balance() -> None:
    """The benchmark CNN's case: torch's hand split cuts between two residual blocks of one stage; so
    does the time-balanced plan now, by splitting the Sequential stage (a pure container), whose own
    node stays with its first block so that the calls still go forward."""
    model = Staged()
    trace = _trace(model)
    times = _staged_times(model, UNEVEN)
    free = {"call_overhead_s": 0.0, "callee_overhead_s": 0.0}
    plan = auto_partition(model, 2, trace=trace, times=times, **free)  # type: ignore[arg-type]
    assert _owners(plan, BLOCKS) == [0, 0, 0, 0, 0, 1, 1, 1], dict(plan.split_points())
    assert plan.owner("stages.2") == 0 and plan.owner("stages") == 0
    assert {"stages.2.1", "stages.3"} <= set(plan.split_points())
    assert plan.predicted_times_s is not None
    assert max(plan.predicted_times_s) <= 15.2e-3 + 1e-9
    # every module of a block on one stage: the blocks themselves are never cut
    for block in BLOCKS:
        assert {plan.owner(block + s) for s in ("", ".a", ".b")} == {plan.owner(block)}
    # priced remote calls (stages.2 calls stages.2.1, the root stages.3: two calls, as with whole
    # stages on rank 1) keep the cut
    priced = auto_partition(model, 2, trace=trace, times=times, call_overhead_s=5e-4, callee_overhead_s=1e-3)
    assert _owners(priced, BLOCKS) == [0, 0, 0, 0, 0, 1, 1, 1]


def test_a_container_is_not_split_when_whole_units_balance() -> None:
    """Equal blocks: whole stages balance (2 + 16 | 16.2 ms), so no container is cut."""
    model = Staged()
    plan = auto_partition(
        model,
        2,
        trace=_trace(model),
        times=_staged_times(model, [4.0] * 8),
        call_overhead_s=0.0,
        callee_overhead_s=0.0,
    )
    assert _owners(plan, BLOCKS) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.owner("stages.2") == 1 and plan.owner("stages.3") == 1


def test_a_block_with_its_own_compute_is_never_cut() -> None:
    """Three equal residual blocks (their own forward adds) on two stages: a cut inside the middle one
    would balance better on paper (refine(split=True) finds it), but auto_partition moves whole blocks."""
    model = Stack(layers=3)
    trace = trace_model(model, (torch.randn(2, 16),))
    seconds = {f"layers.{i}.{leaf}": 1e-3 for i in range(3) for leaf in ("up", "down")}
    plan = auto_partition(
        model, 2, trace=trace, times=_times(seconds), call_overhead_s=0.0, callee_overhead_s=0.0
    )
    for i in range(3):
        inside = {plan.owner(f"layers.{i}{s}") for s in ("", ".norm", ".up", ".act", ".down")}
        assert len(inside) == 1, (i, dict(plan.assignment))
    root = build_module_tree(model, trace, _times(seconds))
    assign_costs(root, 0.0)
    seed = partition_tree(root, 2).device
    nodes = list(root.walk())
    whole, cut = refine(root, seed, 2), refine(root, seed, 2, split=True)
    assert max(stage_loads(nodes, cut, 2)) < max(stage_loads(nodes, whole, 2))


def test_refine_is_deterministic_across_ranks() -> None:
    """Two ranks build their own model from one seed and trace it: the same trace and the same plan,
    also with the calls listed in another order."""
    plans = []
    for order in (1, -1, 1):
        torch.manual_seed(0)
        model = Staged()
        trace = _trace(model)
        times = _staged_times(model, UNEVEN)
        shuffled = _times(dict(times.forward_s), dict(list(times.call_counts.items())[::order]))
        root = build_module_tree(model, trace, shuffled)
        totals = assign_costs(root, 0.0)
        calls = {
            (_node(root, a).index, _node(root, b).index): n
            for (a, b), n in shuffled.call_counts.items()
            if _node(root, a) is not _node(root, b)
        }
        priced = CallCosts(calls, 5e-4 / totals.compute, 1e-3 / totals.compute)
        device = refine(root, partition_tree(root, 2).device, 2, priced)
        plans.append((trace.to_dict()["modules"], {n.path: device[n.index] for n in root.walk()}))
    assert plans[0] == plans[1] == plans[2]
    assert plans[0][1]["stages.2.1"] == 1 and plans[0][1]["stages.2.0"] == 0
