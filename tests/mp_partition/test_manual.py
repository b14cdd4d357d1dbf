"""Manual partitioning: smp.partition at creation, set_partition, validation errors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from mp_partition import (
    InvalidPartitionIDError,
    SharedParameterPartitionError,
    clear_partition,
    get_partition,
    manual_partition,
    partition,
    partition_marks,
    set_partition,
)

from .models import Block, TiedLM

ORIGINAL_INIT = nn.Module.__init__


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        with partition(1):
            self.second = Block()
            with partition(2):
                self.third = Block()
            self.fourth = nn.Linear(16, 16)
        self.last = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.fourth(self.third(self.second(self.first(x)))))


def test_context_marks_modules_created_inside_innermost_wins() -> None:
    model = Net()
    assert nn.Module.__init__ is ORIGINAL_INIT
    marks = partition_marks(model)
    assert "" not in marks and "first" not in marks and "last" not in marks
    assert marks["second"] == 1 and marks["second.up"] == 1
    assert marks["third"] == 2 and marks["third.norm"] == 2
    assert marks["fourth"] == 1
    plan = manual_partition(model, 3, default_partition=0)
    assert plan.owner("") == 0 and plan.owner("first.up") == 0 and plan.owner("last") == 0
    assert plan.owner("second") == 1 and plan.owner("third.down") == 2 and plan.owner("fourth") == 1
    assert plan.inputs.method == "manual"
    assert sum(plan.costs) == pytest.approx(1.0)
    report = plan.report()
    assert "second (Block)" in report and "third (Block)" in report and "p2" in report
    plan_default = manual_partition(model, 3, default_partition=2)
    assert plan_default.owner("first") == 2 and plan_default.owner("second") == 1


def test_whole_model_in_a_context() -> None:
    with partition(1):
        model = Block()
    plan = manual_partition(model, 2)
    assert set(plan.assignment.values()) == {1}
    assert plan.empty_partitions == (0,)


def test_init_is_restored_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="inside"), partition(1):
        assert nn.Module.__init__ is not ORIGINAL_INIT
        raise RuntimeError("inside")
    assert nn.Module.__init__ is ORIGINAL_INIT
    assert get_partition(nn.Linear(2, 2)) is None


def test_other_threads_are_not_marked() -> None:
    made: list[nn.Module] = []
    inside = threading.Event()
    release = threading.Event()

    def context_thread() -> None:
        with partition(3):
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=context_thread)
    worker.start()
    assert inside.wait(10)
    made.append(nn.Linear(2, 2))  # this thread is in no context
    release.set()
    worker.join(10)
    assert get_partition(made[0]) is None
    assert nn.Module.__init__ is ORIGINAL_INIT


def test_set_partition_recurse_and_clear() -> None:
    block = Block()
    set_partition(block, 1)
    assert get_partition(block) == 1 and get_partition(block.up) == 1
    set_partition(block.up, 0, recurse=False)
    assert get_partition(block.up) == 0 and get_partition(block) == 1
    clear_partition(block)
    assert get_partition(block) is None and get_partition(block.up) is None
    with pytest.raises(TypeError):
        set_partition("block", 1)  # type: ignore[arg-type]


def test_index_out_of_range_names_module_and_index() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    set_partition(model[1], 5)
    with pytest.raises(InvalidPartitionIDError, match=r"partition index 5 for module '1'.*\[0, 4\)"):
        manual_partition(model, 4)
    with pytest.raises(InvalidPartitionIDError, match="default_partition"):
        manual_partition(nn.Linear(2, 2), 2, default_partition=2)
    with pytest.raises(InvalidPartitionIDError, match="-1"), partition(-1):
        pass
    with pytest.raises(InvalidPartitionIDError):
        set_partition(model, "1")  # type: ignore[arg-type]
    assert nn.Module.__init__ is ORIGINAL_INIT


def test_shared_parameters_on_different_partitions_is_an_error() -> None:
    model = TiedLM()
    set_partition(model.head, 1)
    with pytest.raises(SharedParameterPartitionError) as info:
        manual_partition(model, 2)
    message = str(info.value)
    assert "'embed' (partition 0)" in message and "'head.1' (partition 1)" in message
    set_partition(model.embed, 1)
    plan = manual_partition(model, 2)
    assert plan.owner("embed") == plan.owner("head.1") == 1


def test_manual_plan_with_trace_reports_activations() -> None:
    model = Net()
    plan = manual_partition(model, 3, example_args=(torch.randn(2, 16),))
    assert plan.inputs.traced
    assert plan.partitions[1].activation_bytes > 0
