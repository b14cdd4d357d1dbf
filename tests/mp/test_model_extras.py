"""DistributedModel's DDP-side API: register_comm_hook, join (uneven inputs), size, constructor arguments.

Every multi-rank result is compared with plain PyTorch in one process on the same model, seed and data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import mp as smp
from mp.errors import SMPUnsupportedError, SMPValidationError

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)


def _make(cfg: dict[str, Any], **kwargs: Any) -> tuple[Any, Any, Any]:
    smp.init(cfg)
    model = smp.DistributedModel(_net(), **kwargs)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


# ------------------------------------------------------------------------------------------- comm hooks
def _hooked(world: Any, which: str) -> dict[str, Any]:
    model, opt, train_step = _make({"microbatches": 2, "ddp": True}, bucket_cap_mb=0.0002)
    group = smp.get_dp_process_group()
    seen: list[tuple[int, bool, int, int]] = []

    def averaging_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # smp's contract: average over replicas AND microbatches in the hook
        grads, params = bucket.gradients(), bucket.parameters()
        seen.append((bucket.index(), bucket.is_last(), len(grads), len(params)))
        assert [g.shape for g in grads] == [p.shape for p in params]
        tensor = bucket.buffer().div_(dist.get_world_size(state) * smp.num_microbatches())
        fut = dist.all_reduce(tensor, group=state, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    if which == "torch":
        model.register_comm_hook(group, default_hooks.allreduce_hook)
    elif which == "averaging":
        model.register_comm_hook(group, averaging_hook)
    grads: list[dict[str, torch.Tensor]] = []
    for s in range(STEPS):
        opt.zero_grad()
        train_step(*_batch(s, smp.dp_rank()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    if which != "none":
        with pytest.raises(SMPValidationError, match="called twice"):
            model.register_comm_hook(group, averaging_hook)
    return {"grads": grads, "seen": seen}


def test_a_comm_hook_replaces_the_gradient_all_reduce(worlds: Any) -> None:
    plain = worlds.run(2, _hooked, "none")
    averaging = worlds.run(2, _hooked, "averaging")
    summed = worlds.run(2, _hooked, "torch")  # torch's allreduce_hook averages over replicas only
    for r in range(2):
        # several buckets per step (bucket_cap_mb is tiny), the last one marked
        steps = averaging[r]["seen"]
        assert len(steps) > STEPS and sum(last for _, last, _, _ in steps) == STEPS, steps
        assert steps[0][0] == 0 and steps[1][0] == 1
        for s in range(STEPS):
            for name, g in plain[r]["grads"][s].items():
                torch.testing.assert_close(averaging[r]["grads"][s][name], g, msg=name)
        # the same first step, with gradients summed over the 2 microbatches (smp's contract)
        for name, g in plain[r]["grads"][0].items():
            torch.testing.assert_close(summed[r]["grads"][0][name], 2 * g, msg=name)


def _hook_with_tp(world: Any) -> str:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    model = smp.DistributedModel(_net())
    with pytest.raises(SMPUnsupportedError, match="tensor_parallel_degree=2") as info:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return str(info.value)


def test_a_comm_hook_with_tensor_parallelism_is_refused(worlds: Any) -> None:
    assert all("Fix:" in m for m in worlds.run(2, _hook_with_tp))


# ------------------------------------------------------------------------------------------------ join
def _uneven(world: Any, pp: int, divide_by_initial: bool) -> dict[str, torch.Tensor]:
    cfg: dict[str, Any] = {"microbatches": 2, "ddp": True, "pipeline_parallel_degree": pp}
    model, opt, train_step = _make(cfg)
    replica = smp.dp_rank()
    with model.join(divide_by_initial_world_size=divide_by_initial):
        for s in range(STEPS + 2 if replica == 0 else STEPS):  # replica 0 has two batches more
            opt.zero_grad()
            train_step(*_batch(s, replica))
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _uneven_reference(divide_by_initial: bool) -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(STEPS + 2):
        opt.zero_grad()
        replicas = [0, 1] if s < STEPS else [0]
        divisor = 2 if divide_by_initial or s < STEPS else 1
        loss = sum(F.mse_loss(net(_batch(s, r)[0]), _batch(s, r)[1]) for r in replicas) / divisor
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return net.state_dict()


@pytest.mark.parametrize(("pp", "divide_by_initial"), [(1, True), (1, False), (2, True)])
def test_join_trains_uneven_replicas_like_plain_pytorch(
    worlds: Any, pp: int, divide_by_initial: bool
) -> None:
    expected = _uneven_reference(divide_by_initial)
    for got in worlds.run(2 * pp, _uneven, pp, divide_by_initial, timeout=180):
        for k, e in expected.items():
            torch.testing.assert_close(got[k], e, rtol=1e-5, atol=1e-6, msg=k)


def _join_disabled_or_single(world: Any) -> list[int]:
    model, _, train_step = _make({"microbatches": 1})
    with model.join(enable=False):
        train_step(*_batch(0, 0))
    return [model.size(), smp.num_microbatches()]


def test_size_and_a_single_replica_join(worlds: Any) -> None:
    expected = sum(p.numel() * p.element_size() for p in _net().parameters())
    assert worlds.run(1, _join_disabled_or_single) == [[expected, 1]]


# --------------------------------------------------------------------------------- constructor arguments
def _constructor(world: Any) -> str:
    smp.init({})
    with pytest.raises(SMPUnsupportedError, match="gradient_as_bucket_view=True") as info:
        smp.DistributedModel(_net(), gradient_as_bucket_view=True)
    with pytest.raises(SMPValidationError, match="find_unused_parameters='yes'"):
        smp.DistributedModel(_net(), find_unused_parameters="yes")
    model = smp.DistributedModel(
        _net(),
        find_unused_parameters=True,
        trace_memory_usage=True,
        trace_device="cpu",
        trace_execution_times=True,
    )
    assert model._partitioner.trace_times is False  # smp: no execution times on a CPU trace
    return str(info.value)


def test_constructor_arguments(worlds: Any) -> None:
    assert "Fix: remove the argument" in worlds.run(1, _constructor)[0]
