"""PartitionPlan: queries, JSON round trip, model checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mp_partition import (
    PartitionError,
    PartitionPlan,
    PlanFormatError,
    PlanMismatchError,
    UnknownModulePathError,
    auto_partition,
)

from .models import Stack, TiedLM


@pytest.fixture(scope="module")
def plan() -> PartitionPlan:
    return auto_partition(TiedLM(layers=6), 3, example_args=(torch.randint(0, 64, (2, 5)),))


def test_queries(plan: PartitionPlan) -> None:
    assert plan.owner("body.layers.5.down") == plan.owner_of_parameter("body.layers.5.down.weight")
    assert plan.owner_of_parameter("embed.weight") == plan.owner("embed")
    assert sorted(plan.modules_on(0) + plan.modules_on(1) + plan.modules_on(2)) == sorted(plan.assignment)
    splits = plan.split_points()
    assert splits and all(plan.owner(p) == i for p, i in splits.items())
    assert sum(plan.costs) == pytest.approx(1.0)
    assert plan.imbalance >= 1.0
    stats = plan.partitions
    assert sum(s.num_parameters for s in stats) == sum(p.numel() for p in TiedLM(layers=6).parameters())
    assert plan.inputs.example_inputs == ("arg0: int64[2, 5] on cpu",)
    assert plan.inputs.traced and plan.inputs.trace_device == "cpu"


def test_unknown_path(plan: PartitionPlan) -> None:
    with pytest.raises(
        UnknownModulePathError, match=r"'body.layers.9'.*nearest module in the plan is 'body.layers'"
    ):
        plan.owner("body.layers.9")
    with pytest.raises(KeyError):
        plan.owner("nope")
    with pytest.raises(PartitionError):
        plan.owner("nope")


def test_json_round_trip(plan: PartitionPlan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = PartitionPlan.load(path)
    assert loaded == plan
    assert loaded.report() == plan.report()
    assert dict(loaded.assignment) == dict(plan.assignment)
    assert json.loads(path.read_text())["format"] == "mp_partition.plan"
    assert not (tmp_path / "plan.json.tmp").exists()


def test_plan_is_frozen(plan: PartitionPlan) -> None:
    with pytest.raises(AttributeError):
        plan.num_partitions = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.assignment["embed"] = 2  # type: ignore[index]


def test_check_model(plan: PartitionPlan) -> None:
    plan.check_model(TiedLM(layers=6))
    with pytest.raises(PlanMismatchError, match=r"body.layers.5"):
        plan.check_model(TiedLM(layers=5))
    with pytest.raises(PlanMismatchError, match="different classes or parameter shapes"):
        plan.check_model(TiedLM(layers=6, width=8))


def test_bad_files(plan: PartitionPlan, tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        PartitionPlan.from_json("{")
    with pytest.raises(PlanFormatError, match="not a partition plan"):
        PartitionPlan.from_dict({"format": "other"})
    data = plan.to_dict()
    data["version"] = 99
    with pytest.raises(PlanFormatError, match="version 99"):
        PartitionPlan.from_dict(data)
    data = plan.to_dict()
    del data["tree"]
    with pytest.raises(PlanFormatError, match="malformed"):
        PartitionPlan.from_dict(data)
    data = plan.to_dict()
    data["assignment"]["embed"] = 7
    with pytest.raises(PlanFormatError, match="out-of-range"):
        PartitionPlan.from_dict(data)


def test_reuse_a_saved_plan_for_a_fresh_model(tmp_path: Path) -> None:
    model = Stack(layers=4)
    plan = auto_partition(model, 2, example_args=(torch.randn(2, 16),))
    plan.save(tmp_path / "p.json")
    again = PartitionPlan.load(tmp_path / "p.json")
    fresh = Stack(layers=4)
    again.check_model(fresh)
    owners = {name: again.owner(name) for name, _ in fresh.named_modules()}
    assert owners == {name: plan.owner(name) for name, _ in model.named_modules()}
    with pytest.raises(PlanMismatchError):
        again.check_model(nn.Linear(2, 2))
