"""Splitting step inputs and merging step results (no processes)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch

from mp_pipeline import SplitError, SplitSpec, StepOutput, merge_microbatch_results, split_arguments
from mp_pipeline.errors import InvalidStepOutputError
from mp_pipeline.structure import Slot, flatten, unflatten


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


class Sliceable:
    def __init__(self, values: list[int]) -> None:
        self.values = values

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> Sliceable:
        size = len(self.values) // num_mb
        return Sliceable(self.values[mb * size : (mb + 1) * size])


def fn(x: torch.Tensor, nested: Any, mask: torch.Tensor, obj: Any = None, *rest: Any, **kw: Any) -> None:
    pass


def test_tensors_are_split_everywhere_but_non_split_inputs() -> None:
    spec = SplitSpec.for_function(fn, non_split_inputs=["mask"], input_split_axes={"obj": 0, "extra": 1})
    x = torch.arange(8).reshape(4, 2)
    nested = {"p": Pair(torch.arange(4), 7), "l": [torch.ones(4, 3), "s"], "s": {3}}
    mask = torch.ones(3)
    parts = split_arguments(spec, (x, nested, mask, Sliceable([1, 2, 3, 4])), {"extra": torch.zeros(2, 4)}, 2)
    assert len(parts) == 2
    (a0, k0), (a1, _) = parts
    assert a0[0].tolist() == [[0, 1], [2, 3]] and a1[0].tolist() == [[4, 5], [6, 7]]
    assert isinstance(a0[1]["p"], Pair) and a0[1]["p"].a.tolist() == [0, 1] and a0[1]["p"].b == 7
    assert a1[1]["l"][0].shape == (2, 3) and a1[1]["l"][1] == "s" and a0[1]["s"] == {3}
    assert a0[2] is mask  # non_split_inputs
    assert a1[3].values == [3, 4]  # smp_slice
    assert k0["extra"].shape == (2, 2)  # input_split_axes for a **kwargs member


def test_scalars_pass_whole_and_one_microbatch_is_a_no_op() -> None:
    spec = SplitSpec.for_function(fn)
    t = torch.tensor(3.0)
    parts = split_arguments(spec, (t, None, torch.ones(2)), {}, 2)
    assert parts[0][0][0] is t and parts[1][0][0] is t
    args = (torch.ones(3), None, torch.ones(3))
    assert split_arguments(spec, args, {}, 1) == [(args, {})]


def test_indivisible_batches_and_bad_specs_raise_with_the_fix() -> None:
    spec = SplitSpec.for_function(fn)
    with pytest.raises(SplitError) as err:
        split_arguments(spec, (torch.ones(7, 2), None, torch.ones(8)), {}, 2)
    msg = str(err.value)
    assert "batch size=7, number of microbatches=2" in msg and "drop_last=True" in msg
    assert "non_split_inputs" in msg and "input_split_axes" in msg and "'x'" in msg
    with pytest.raises(SplitError, match="expected a list"):
        SplitSpec.for_function(fn, non_split_inputs="mask")  # type: ignore[arg-type]
    with pytest.raises(SplitError, match="expected a dict"):
        SplitSpec.for_function(fn, input_split_axes=[("x", 1)])  # type: ignore[arg-type]

    def strict(x: torch.Tensor) -> None:
        pass

    with pytest.raises(SplitError, match="no such argument"):
        SplitSpec.for_function(strict, non_split_inputs=["y"])


def test_merge_keeps_structure_with_step_output_leaves() -> None:
    results = [
        (torch.tensor(1.0, requires_grad=True) * 2, {"logits": torch.ones(2, 3), "n": 2}, None),
        (torch.tensor(3.0), {"logits": torch.zeros(2, 3), "n": 2}, None),
    ]
    loss, extra, nothing = merge_microbatch_results(results)
    assert isinstance(loss, StepOutput) and loss.reduce_mean().item() == 2.5
    assert not loss.outputs[0].requires_grad  # detached
    assert extra["logits"].concat().shape == (4, 3) and extra["n"] == [2, 2]
    assert nothing == [None, None]
    od = merge_microbatch_results([OrderedDict(a=torch.ones(1)), OrderedDict(a=torch.ones(1))])
    assert isinstance(od, OrderedDict) and isinstance(od["a"], StepOutput)
    with pytest.raises(InvalidStepOutputError):
        StepOutput(torch.ones(2))  # type: ignore[arg-type]


def test_flatten_dedups_tensors_and_round_trips() -> None:
    t, u = torch.ones(2), torch.zeros(1)
    obj = {"a": (t, t, Pair(u, 3)), "b": [None, "x", 1.5]}
    skeleton, tensors = flatten(obj)
    assert len(tensors) == 2 and skeleton["a"][0] == Slot(0) == skeleton["a"][1]
    back = unflatten(skeleton, tensors)
    assert back["a"][0] is t and isinstance(back["a"][2], Pair) and back["b"] == [None, "x", 1.5]


def test_unflatten_rebuilds_each_container_as_its_own_type() -> None:
    t, u = torch.ones(1), torch.zeros(2)
    obj = ((t, [u, {"k": t}]), OrderedDict(a=u), Pair(t, (u,)), {"d": (t,), "n": None}, [])
    skeleton, tensors = flatten(obj)
    back = unflatten(skeleton, tensors)
    assert type(back) is tuple and type(back[0][1]) is list and type(back[0][1][1]) is dict
    assert type(back[1]) is OrderedDict and type(back[2]) is Pair and type(back[2][1]) is tuple
    assert back[0][0] is t and back[0][1][0] is u and back[0][1][1]["k"] is t and back[1]["a"] is u
    assert back[3] == {"d": (t,), "n": None} and back[4] == []
    assert back[0][1] is not skeleton[0][1] and back[4] is not skeleton[4]  # new containers
    assert unflatten(Slot(1), tensors) is u and unflatten("x", tensors) == "x"
