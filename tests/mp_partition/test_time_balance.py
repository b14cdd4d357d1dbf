"""Time as the default cost: the timed step, the balancer with remote-call overhead, the memory bound,
the plan's predicted and measured stage times, and the looped GPT on a real pp=2 pipeline."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mp_partition import (
    ModuleTimes,
    PartitionPlan,
    StepTimer,
    TraceResult,
    auto_partition,
    time_step,
    trace_model,
)
from mp_partition.balance import CallCosts, refine, stage_loads, units
from mp_partition.cost import assign_costs
from mp_partition.nodes import build_module_tree

from .models import Stack


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return grad * 2.0


class SlowBack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(self.lin(x))  # type: ignore[no-any-return]


class SlowFwd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return torch.relu(self.lin(x))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = SlowFwd()
        self.b = SlowBack()
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _times(paths: dict[str, float], calls: dict[tuple[str, str], int] | None = None) -> ModuleTimes:
    """Synthetic measured times: all of it forward."""
    return ModuleTimes(
        forward_s=MappingProxyType(dict(paths)),
        backward_s=MappingProxyType({}),
        call_counts=MappingProxyType(dict(calls or {})),
        device="cpu",
    )


# -- the timed step -----------------------------------------------------------------------------------
def test_step_timer_attributes_forward_and_backward_to_the_module_that_ran_them() -> None:
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 8)
    before = torch.get_rng_state()
    grad = torch.ones(8, 8)
    model.c.weight.grad = grad
    with StepTimer(model) as timer:
        loss = model(x).square().mean()
        timer.backward(loss)
    times = timer.result()
    assert times.forward_s["a"] >= 0.02 and times.backward_s.get("a", 0.0) < 0.02
    assert times.backward_s["b"] >= 0.03 and times.forward_s.get("b", 0.0) < 0.02
    assert times.total_s("c") < 0.02
    assert times.call_counts[("", "a")] == 1 and times.call_counts[("a", "a.lin")] == 1
    assert ("", "") not in times.call_counts
    # what the next real step computes is unchanged: gradients and RNG as before the timed step
    assert model.c.weight.grad is grad and model.a.lin.weight.grad is None
    assert torch.equal(torch.get_rng_state(), before)
    assert (
        abs(times.step_s - sum(times.total_s(p) for p in set(times.forward_s) | set(times.backward_s))) < 1e-9
    )


def test_time_step_keeps_the_fastest_pass_and_round_trips() -> None:
    model = Chain()
    x = torch.randn(4, 8)

    def step(timer: StepTimer) -> None:
        timer.backward(model(x).sum())

    times = time_step(model, step, passes=2)
    assert times.backward_s["b"] >= 0.03
    again = ModuleTimes.from_dict(times.to_dict())
    assert again == ModuleTimes(
        MappingProxyType(dict(times.forward_s)),
        MappingProxyType(dict(times.backward_s)),
        MappingProxyType(dict(times.call_counts)),
        "cpu",
    )


def test_a_module_slow_in_backward_gets_a_stage_of_its_own() -> None:
    """Forward times alone would put b with the others; its backward makes it the heaviest module."""
    model = Chain()
    x = torch.randn(4, 8)

    def step(timer: StepTimer) -> None:
        timer.backward(model(x).sum())

    plan = auto_partition(model, 2, trace=trace_model(model, (x,)), times=time_step(model, step))
    assert plan.owner("b") != plan.owner("a")
    predicted = plan.predicted_times_s
    assert predicted is not None and max(predicted) >= 0.03
    assert plan.inputs.memory_weight == 0.0 and plan.inputs.memory_weight_auto


# -- the balancer -------------------------------------------------------------------------------------
@functools.cache
def _traced_stack(layers: int) -> tuple[Stack, TraceResult]:
    model = Stack(layers=layers)
    return model, trace_model(model, (torch.randn(2, 16),))


def _stack_tree(costs: list[float]) -> Any:
    model, trace = _traced_stack(len(costs))
    times = _times({f"layers.{i}": c for i, c in enumerate(costs)})
    root = build_module_tree(model, trace, times)
    assign_costs(root, 0.0)
    return root


@settings(max_examples=40, deadline=None)
@given(
    costs=st.lists(st.floats(0.01, 10.0), min_size=3, max_size=10),
    stages=st.integers(2, 3),
    overhead=st.floats(0.0, 0.05),
    split=st.booleans(),
)
def test_refine_never_raises_the_largest_load_nor_scatters_stages(
    costs: list[float], stages: int, overhead: float, split: bool
) -> None:
    root = _stack_tree(costs)
    nodes = list(root.walk())
    layers = next(n for n in nodes if n.path == "layers")
    calls = CallCosts({(root.index, c.index): 1 for c in layers.children}, overhead, overhead / 2)
    from mp_partition.algorithm import partition_tree

    seed = partition_tree(root, stages).device
    refined = refine(root, seed, stages, calls, split=split)
    assert (
        max(stage_loads(nodes, refined, stages, calls))
        <= max(stage_loads(nodes, seed, stages, calls)) + 1e-12
    )
    assert refine(root, seed, stages, calls, split=split) == refined  # deterministic
    assert set(refined.values()) == set(seed.values())  # no stage emptied

    # moves happen only at boundaries between units: the runs of consecutive units on one stage
    # (the seed's own plan may leave a stray unit on stage 0) never become more numerous
    def runs(device: dict[int, int]) -> int:
        order = [device[u.index] for u in units(root, device)]
        return sum(1 for i, d in enumerate(order) if i == 0 or order[i - 1] != d)

    assert runs(refined) <= runs(seed)


def test_call_overhead_moves_work_off_the_parents_stage() -> None:
    """Eight equal blocks called by the parent on stage 0: each remote call costs stage 0, so stage 1
    takes more blocks than stage 0 once the overhead is counted."""
    root = _stack_tree([1.0] * 8)
    nodes = list(root.walk())
    layers = next(n for n in nodes if n.path == "layers")
    from mp_partition.algorithm import partition_tree

    seed = partition_tree(root, 2).device
    assert sum(seed[c.index] for c in layers.children) == 4
    calls = CallCosts({(root.index, c.index): 1 for c in layers.children}, 0.05, 0.0)
    refined = refine(root, seed, 2, calls)
    assert sum(refined[c.index] for c in layers.children) == 5
    loads = stage_loads(nodes, refined, 2, calls)
    assert max(loads) < max(stage_loads(nodes, seed, 2, calls))


def test_auto_partition_balances_time_and_falls_back_to_memory_when_it_binds() -> None:
    model = Stack(layers=6)
    x = torch.randn(2, 16)
    trace = trace_model(model, (x,))
    # the last layer is as slow as the five others: a time-balanced plan gives it a stage of its own
    times = _times({f"layers.{i}": (5.0 if i == 5 else 1.0) * 1e-3 for i in range(6)})
    plan = auto_partition(model, 2, trace=trace, times=times, call_overhead_s=0.0, callee_overhead_s=0.0)
    owners = [plan.owner(f"layers.{i}") for i in range(6)]
    assert owners == [0, 0, 0, 0, 0, 1]
    assert plan.predicted_times_s == pytest.approx((5e-3, 5e-3))
    # memory binds: stage 0 would hold 5/6 of the parameters; the limit allows about a half
    total = sum(4 * p.numel() * p.element_size() for p in model.parameters())
    tight = auto_partition(
        model,
        2,
        trace=trace,
        times=times,
        memory_limit_bytes=int(0.55 * total) + 4096,
        microbatches_in_flight=1,
    )
    assert tight.inputs.memory_weight > 0.0
    assert [tight.owner(f"layers.{i}") for i in range(6)] != owners
    # an explicit memory_weight is used as given, without the memory check
    fixed = auto_partition(model, 2, trace=trace, times=times, memory_weight=0.8, memory_limit_bytes=1)
    assert fixed.inputs.memory_weight == 0.8 and not fixed.inputs.memory_weight_auto


def test_time_concentrated_in_one_leaf_still_gives_every_stage_a_part() -> None:
    """Time-only balance gives both stages' seats to a leaf that holds nearly all the time, leaving
    stage 1 empty (seen under load with the small CNN of the pipeline tests). The plan weighs memory
    more instead, so that each stage holds part of the model, as pipeline_parallel_degree 2 asks."""
    from tests.mp_pipeline.models import SmallCNN, batch

    model = SmallCNN()
    x = batch("cnn", 0, 0)[0][:8]
    for hot in ("conv2", "fc1", "fc2"):
        times = _times({p: (1.0 if p == hot else 1e-5) for p in ("", "conv1", "conv2", "fc1", "fc2")})
        plan = auto_partition(model, 2, trace=trace_model(model, (x,)), times=times)
        assert not plan.empty_partitions, (hot, dict(plan.assignment))
        assert plan.inputs.memory_weight > 0.0, hot


def test_plan_report_shows_predicted_and_measured_stage_times(tmp_path: Path) -> None:
    model = Stack(layers=4)
    x = torch.randn(2, 16)
    times = _times({f"layers.{i}": 1e-3 for i in range(4)})
    plan = auto_partition(model, 2, trace=trace_model(model, (x,)), times=times)
    text = plan.report()
    assert "forward + backward time" in text and "pred. ms" in text and "meas. ms" not in text
    measured = plan.with_measured_times([2.5e-3, 2.0e-3])
    text = measured.report()
    assert "meas. ms" in text and "2.50" in text and "measured from the pipeline timeline" in text
    again = PartitionPlan.from_json(measured.to_json())
    assert again.partitions[0].measured_time_s == 2.5e-3
    assert again.predicted_times_s == measured.predicted_times_s
    pytest.importorskip("matplotlib")
    measured.render(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_forward_times_alone_are_not_reported_as_stage_times() -> None:
    model = Stack(layers=4)
    plan = auto_partition(model, 2, example_args=(torch.randn(2, 16),), measure_time=True)
    assert plan.predicted_times_s is None
    assert "compute = forward time" in plan.report() and "pred. ms" not in plan.report()


def test_timeline_stage_time_counts_nested_executions_once_and_cuts_waits() -> None:
    from mp_pipeline.timeline import Event, EventKind, Timeline

    ms = 1_000_000
    events = (
        Event(EventKind.STEP, 0, "main", 1, "", -1, 0, 100 * ms),
        # microbatch 0: the step's forward (0-40 ms) holds a nested local block (10-20) and a wait (20-30)
        Event(EventKind.FWD, 0, "main", 1, "<step>", 0, 0, 40 * ms),
        Event(EventKind.FWD, 0, "main", 1, "blocks.0", 0, 10 * ms, 20 * ms),
        Event(EventKind.WAIT, 0, "main", 1, "blocks.1", 0, 20 * ms, 30 * ms),
        Event(EventKind.BWD, 0, "main", 1, "<step>", 0, 50 * ms, 60 * ms),
        Event(EventKind.FWD, 0, "main", 1, "<step>", 1, 60 * ms, 70 * ms),
    )
    timeline = Timeline(events)
    assert timeline.stage_time_s(0) == pytest.approx((30 + 10 + 10) * 1e-3 / 2)
    assert timeline.stage_time_s(1) is None


# -- a real pipeline ----------------------------------------------------------------------------------
def _looped_gpt_pp2(world: Any) -> dict[str, Any]:
    import mp as smp
    from benchmarks.models import GPT  # the benchmark's model, as users write it
    from tests.mp_pipeline.models import first_difference

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(vocab=1000, seq=128, hidden=256, layers=8)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 1000, (4, 128), generator=g), torch.randint(0, 1000, (4, 128), generator=g))]
    data.append(
        (torch.randint(0, 1000, (4, 128), generator=g), torch.randint(0, 1000, (4, 128), generator=g))
    )

    def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    try:
        model = smp.DistributedModel(build())
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        @smp.step
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_of(model, x, y)
            model.backward(loss)
            return loss

        losses = []
        smp.timeline.start()
        for x, y in data:
            losses.append(train_step(x, y).reduce_mean().item())
            opt.step()
            opt.zero_grad()
        smp.timeline.stop()
        state = model.state_dict()
        plan = model.plan
    finally:
        smp.reset()
    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x, y in data:
        parts = [loss_of(ref, a, b) / 2 for a, b in zip(x.chunk(2), y.chunk(2), strict=True)]
        for p in parts:
            p.backward()
        ref_losses.append(sum(p.item() for p in parts))
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "losses": (losses, ref_losses),
        "params": first_difference(state, ref.state_dict()),
        "predicted": None if plan is None else plan.predicted_times_s,
        "measured": None if plan is None else [p.measured_time_s for p in plan.partitions],
        "report": None if plan is None else plan.report(),
    }


def test_looped_gpt_gets_time_balanced_stages_and_trains_exactly_like_pytorch(worlds: Any) -> None:
    r0, r1 = worlds.run(2, _looped_gpt_pp2, timeout=300)
    for r in (r0, r1):
        got, want = r["losses"]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["params"] is None, r["params"]
    predicted = r0["predicted"]
    assert predicted is not None, r0["report"]
    assert max(predicted) <= 1.15 * min(predicted), r0["report"]
    assert all(m is not None and m > 0 for m in r0["measured"]), r0["report"]
