"""The cost model: equation 1, normalization, super-additivity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mp_partition import PartitionError, assign_costs, build_module_tree, trace_model

from .models import Stack, TiedLM


def test_normalized_costs_are_super_additive_and_root_is_one() -> None:
    model = TiedLM()
    root = build_module_tree(model, trace_model(model, (torch.randint(0, 64, (2, 5)),)))
    totals = assign_costs(root, 0.5)
    assert root.cost == 1.0
    assert totals.compute_unit == "calls"
    for node in root.walk():
        assert 0.0 <= node.cost <= 1.0 + 1e-12
        assert node.cost >= sum(c.cost for c in node.children) - 1e-12
        assert node.cost == pytest.approx(node.own_cost + sum(c.cost for c in node.children))


def test_memory_only_is_proportional_to_bytes() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 30))
    root = build_module_tree(model)
    assign_costs(root, 1.0)
    first, second = root.children
    assert first.cost == pytest.approx(110 / 440)
    assert second.cost == pytest.approx(330 / 440)


def test_compute_only_without_trace_counts_modules() -> None:
    model = Stack(layers=3)
    root = build_module_tree(model)
    totals = assign_costs(root, 0.0)
    assert totals.compute_unit == "modules"
    n = len(list(model.modules()))
    layers = root.children[0]
    assert layers.cost == pytest.approx((n - 1) / n)
    for block in layers.children:
        assert block.cost == pytest.approx(5 / n)  # the block and its four submodules


def test_measured_times_drive_compute() -> None:
    model = Stack(layers=2)
    root = build_module_tree(model, trace_model(model, (torch.randn(4, 16),), measure_time=True))
    totals = assign_costs(root, 0.0)
    assert totals.compute_unit == "seconds"
    assert root.cost == 1.0


def test_degenerate_models_fall_back() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Tanh())  # no parameters, no trace: memory is zero
    root = build_module_tree(model)
    totals = assign_costs(root, 1.0)
    assert totals.effective_memory_weight == 0.0
    assert [c.cost for c in root.children] == pytest.approx([1 / 3, 1 / 3])


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True, float("nan")])
def test_memory_weight_is_validated(bad: object) -> None:
    root = build_module_tree(nn.Linear(2, 2))
    with pytest.raises(PartitionError, match="memory_weight"):
        assign_costs(root, bad)  # type: ignore[arg-type]
