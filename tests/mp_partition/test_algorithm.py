"""Algorithms 1 and 2: the three cases, balance, consistency, determinism."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mp_partition import ModelTooSmallError, PartitionError, allocate_devices, auto_partition
from mp_partition.algorithm import hand_out_devices

from ._checks import walk_consistent
from .models import HugeEmbedding, HugeTrunk, Stack, TiedLM


def test_case_one_small_segment_stays_with_the_parent() -> None:
    # Segments [0.9] | [0.05, 0.05]: D'Hondt gives both devices to the big one, the rest take P[0].
    assert allocate_devices([0, 1], [0.9, 0.05, 0.05]) == [(0, 1), (0,), (0,)]


def test_case_two_one_device_per_segment() -> None:
    assert allocate_devices([0, 1, 2, 3], [1.0] * 8) == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]


def test_case_three_recurses_into_multi_node_segments() -> None:
    # Three devices over [5, 0.1 | 8, 3 | 2, 8]: D'Hondt gives the segment [8, 3] two devices, so it is
    # segmented and allocated again: both go to the 8 (8/2 > 3), and the 3 takes that call's P[0]. The
    # segment [5, 0.1] gets no device and takes P[0] of the outer call.
    assert allocate_devices([0, 1, 2], [5.0, 0.1, 8.0, 3.0, 2.0, 8.0]) == [
        (0,),
        (0,),
        (0, 1),
        (0,),
        (2,),
        (2,),
    ]


def test_first_device_goes_where_it_adds_least() -> None:
    # Seats 1,1,1,1,1 over segments of 2,2,2,3,3 layers: the first device (which also holds the parent's
    # leftovers) goes to a light segment; the others follow in order.
    assert hand_out_devices([3, 4, 5, 6, 7], [2.0, 2.0, 2.0, 3.0, 3.0], [1, 1, 1, 1, 1], 0.5) == [
        [3],
        [4],
        [5],
        [6],
        [7],
    ]
    assert hand_out_devices([0, 1, 2], [3.0, 2.0, 3.0], [1, 1, 1], 0.5) == [[1], [0], [2]]
    assert hand_out_devices([0, 1, 2, 3], [6.0, 0.1, 2.0], [3, 0, 1]) == [[0, 1, 2], [], [3]]


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.floats(min_value=0.0, max_value=5.0, allow_nan=False), min_size=1, max_size=12),
    ndev=st.integers(min_value=1, max_value=9),
)
def test_allocation_invariants(costs: list[float], ndev: int) -> None:
    devices = list(range(10, 10 + ndev))
    result = allocate_devices(devices, costs)
    assert len(result) == len(costs)
    assert set().union(*result) == set(devices)  # every device is used
    for r in result:
        assert r and set(r) <= set(devices) and list(r) == sorted(r)
    assert result == allocate_devices(devices, costs)  # deterministic


@pytest.mark.parametrize("skip", [False, True])
def test_48_identical_layers_over_8_partitions_balance(skip: bool) -> None:
    model = Stack(layers=48)
    plan = auto_partition(model, 8, example_args=(torch.randn(4, 16),), skip_tracing=skip)
    costs = plan.costs
    assert max(costs) / min(costs) <= 1.1
    assert [plan.owner(f"layers.{i}") for i in range(48)] == [i // 6 for i in range(48)]
    for i in range(48):
        assert plan.owner(f"layers.{i}.up") == plan.owner(f"layers.{i}")
    walk_consistent(plan.tree)


def test_huge_embedding_keeps_small_layers_with_the_parent(caplog: pytest.LogCaptureFixture) -> None:
    model = HugeEmbedding()
    with caplog.at_level(logging.WARNING, logger="mp_partition"):
        plan = auto_partition(model, 2, example_args=(torch.randint(0, 100, (2, 3)),))
    root = plan.owner("")
    assert all(plan.owner(f"small.{i}") == root for i in range(12))
    assert plan.owner("embed") == root
    assert plan.empty_partitions == (1,)
    assert "no module" in caplog.text and "embed" in caplog.text
    with pytest.raises(ModelTooSmallError, match="2 partitions"):
        auto_partition(model, 2, example_args=(torch.randint(0, 100, (2, 3)),), allow_empty_partitions=False)


def test_small_layers_beside_a_costly_trunk_stay_with_the_parent() -> None:
    model = HugeTrunk()
    plan = auto_partition(model, 4, example_args=(torch.randn(2, 8),), memory_weight=1.0)
    root = plan.owner("")
    assert {plan.owner(f"small.{i}") for i in range(12)} == {root}
    assert sorted(plan.owner(f"trunk.{i}") for i in range(4)) == [0, 1, 2, 3]
    assert not plan.empty_partitions
    walk_consistent(plan.tree)


def test_every_module_is_placed_including_unexecuted_and_aliases() -> None:
    model = TiedLM()
    model.body.layers[0].extra = model.body.layers[1].up  # reused module: two paths
    plan = auto_partition(model, 3, example_args=(torch.randint(0, 64, (2, 4)),))
    paths = {p for p, _ in model.named_modules(remove_duplicate=False)}
    assert paths == set(plan.assignment)
    assert plan.owner("body.layers.0.extra") == plan.owner("body.layers.1.up")
    assert plan.owner("embed") == plan.owner("head.1")  # tied
    assert "unused" in plan.assignment
    walk_consistent(plan.tree)


def test_deterministic() -> None:
    args = (torch.randn(2, 16),)
    first = auto_partition(Stack(layers=13), 4, example_args=args).to_dict()
    second = auto_partition(Stack(layers=13), 4, example_args=args).to_dict()
    for d in (first, second):
        d["inputs"].pop("model_fingerprint")
    assert first == second


def test_one_partition_and_errors() -> None:
    plan = auto_partition(Stack(layers=2), 1)
    assert set(plan.assignment.values()) == {0}
    assert plan.costs == pytest.approx((1.0,))
    with pytest.raises(ModelTooSmallError, match="too small to split into 2 partitions"):
        auto_partition(nn.Linear(2, 2), 2)
    with pytest.raises(PartitionError, match="num_partitions 0"):
        auto_partition(Stack(layers=2), 0)
    with pytest.raises(PartitionError, match=r"expected a torch\.nn\.Module"):
        auto_partition("model", 2)  # type: ignore[arg-type]
