"""mp_partition.Placement: owner lookups by module path and state key, which tensors a rank holds, and
freeing other stages' tensors to placeholders."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mp_partition import PLACEHOLDER_ATTR, Placement, module_path


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2))
    return model


def test_module_path_of_keys() -> None:
    assert module_path("1.0.weight") == "1.0"
    assert module_path("weight") == ""


def test_unpartitioned_placement_holds_everything_on_stage_zero() -> None:
    placement = Placement(pp_size=2, pp_rank=1)
    assert not placement.partitioned and not placement.pipelined
    assert placement.owner("1.0.weight") == 0
    assert placement.holds("1.0.weight")  # not partitioned yet: every rank holds the whole model


def test_owner_falls_back_to_the_closest_listed_ancestor() -> None:
    placement = Placement(pp_size=2, pp_rank=1, assignment={"": 0, "1": 1, "1.1": 0}, partitioned=True)
    assert placement.pipelined
    assert placement.owner("1.0.weight") == 1  # "1.0" is not listed: its parent "1" is
    assert placement.owner("1.1.running_mean") == 0
    assert placement.owner("2.bias") == 0  # the root's
    assert placement.module_owner("1") == 1
    assert placement.holds("1.0.bias") and not placement.holds("0.weight")
    assert [n for n, _ in placement.local_named_modules(_model())] == ["1", "1.0"]


def test_assignment_is_read_only_and_copied() -> None:
    given = {"": 0, "1": 1}
    placement = Placement(pp_size=2, pp_rank=0, assignment=given, partitioned=True)
    given["2"] = 1
    assert "2" not in placement.assignment
    with pytest.raises(TypeError):
        placement.assignment["2"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.pp_rank = 1  # type: ignore[misc]


def test_free_remote_keeps_shapes_and_drops_other_stages_values() -> None:
    model = _model()
    before = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    placement = Placement(pp_size=2, pp_rank=1, assignment={"": 0, "1": 1}, partitioned=True)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    placement.free_remote(model)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.shape == before[name].shape, name
        if name.startswith("1."):
            assert placement.is_local(t), name
            assert torch.equal(t, before[name]), name
        else:
            assert not placement.is_local(t) and getattr(t, PLACEHOLDER_ATTR), name
            assert t.stride() == (0,) * t.dim(), name  # no memory behind it
    assert model[0].weight.grad is None
    local = placement.local_parameters(model)
    assert [id(p) for p in local] == [id(p) for p in model[1].parameters()]


def test_collective_entry_is_called_with_the_description() -> None:
    seen: list[str] = []
    placement = Placement(pp_size=2, pp_rank=0, enter=seen.append)
    placement.enter("model.state_dict()")
    assert seen == ["model.state_dict()"]
    Placement(pp_size=1, pp_rank=0).enter("nothing to wait for")  # the default entry does nothing
