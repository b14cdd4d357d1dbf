"""smp.DistributedOptimizer patches the user's optimizer once, with its features as one ordered chain
(mp.optimizer_chain), and keeps torch's LR-scheduler protocol: a scheduler made before or after it,
stepped after ``optimizer.step()``, gives no warning, and the same scheduler stepped before the optimizer
still gets torch's warning. Trained parameters equal plain PyTorch's with the same scheduler."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import mp as smp
from mp.optimizer_chain import chain_of

_LR_WARNINGS = ("lr_scheduler.step()", "optimizer.step()` has been overridden")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))


def _data(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(step))


def _run(world: Any, config: dict[str, Any], when: str, order: str) -> dict[str, Any]:
    """Train 3 steps under ``config`` with a StepLR made ``when`` ("before"/"after") DistributedOptimizer,
    stepped in ``order`` ("right": optimizer first); the LR warnings torch gave and the parameters."""
    smp.init(config)
    model = smp.DistributedModel(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if when == "before" else None
    registered = smp.DistributedOptimizer(opt)
    if sched is None:  # smp's docs: under fp16/bf16 the scheduler takes the user's optimizer
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    @smp.step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).float().square().mean()
        model.backward(loss)
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            registered.zero_grad()
            train_step(_data(s))
            if order == "wrong":
                sched.step()
            registered.step()
            if order == "right":
                sched.step()
    found = [str(w.message)[:80] for w in caught if any(k in str(w.message) for k in _LR_WARNINGS)]
    params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"warnings": found, "params": params, "chain": repr(chain_of(opt))}


def _plain(order: str) -> dict[str, torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(3):
            opt.zero_grad()
            model(_data(s)).square().mean().backward()
            if order == "wrong":
                sched.step()
            opt.step()
            if order == "right":
                sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = [
    ({}, "delayed loads -> plain"),
    ({"shard_optimizer_state": True}, "zero -> delayed loads -> plain"),
    ({"bf16": True}, "delayed loads -> plain"),
]


@pytest.mark.parametrize(("config", "chain"), CASES, ids=["fp32", "zero", "bf16"])
def test_schedulers_see_every_step_and_wrong_order_still_warns(
    worlds: Any, config: dict[str, Any], chain: str
) -> None:
    for when in ("before", "after"):
        got = worlds.run(1, _run, config, when, "right")[0]
        assert got["warnings"] == [], (when, got["warnings"])
        assert got["chain"] == f"OptimizerChain({chain})"
        if not config:  # bf16 rounds; fp32 and ZeRO (one rank) step exactly as torch
            want = _plain("right")
            for name, tensor in want.items():
                torch.testing.assert_close(got["params"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)
        wrong = worlds.run(1, _run, config, when, "wrong")[0]
        assert any("before `optimizer.step()`" in w for w in wrong["warnings"]), (when, wrong["warnings"])
        if not config:
            want = _plain("wrong")
            for name, tensor in want.items():
                torch.testing.assert_close(wrong["params"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def _optimizer_first(world: Any) -> str:
    smp.init({})
    try:
        smp.DistributedOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1))
    except smp.DistributedModelNotWrappedError as exc:
        return str(exc)
    return "accepted"


def test_an_optimizer_registered_before_the_model_is_refused(worlds: Any) -> None:
    """smp refused ``smp.DistributedOptimizer`` before ``smp.DistributedModel``; so does mp: its parts
    are bound to the model (its placement and parameter names) when it is registered."""
    message = worlds.run(1, _optimizer_first)[0]
    assert "call smp.DistributedModel(model) before smp.DistributedOptimizer" in message, message
