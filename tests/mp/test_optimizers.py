"""smp.optimizers: FusedAdam is torch's Adam/AdamW; FusedLAMB matches LAMB's formula (written out below
element by element) alone and, under pp=2 and tp=2, LAMB on the unpartitioned model; NovoGrad refused."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp.errors import SMPUnsupportedError, SMPValidationError
from mp.optimizers import FusedAdam, FusedLAMB, FusedLamb, FusedNovoGrad


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> list[torch.Tensor]:
    for s in range(steps):
        gen = torch.Generator().manual_seed(s)
        x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 2, generator=gen)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torchs_adam(adam_w_mode: bool) -> None:
    a, b = _net(), _net()
    fused = FusedAdam(a.parameters(), lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode)
    assert fused.defaults["fused"] is True  # torch has a fused CPU kernel
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    plain = cls(b.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    for x, y in zip(_train(a, fused), _train(b, plain), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    fused.zero_grad()
    assert all(p.grad is None for p in a.parameters())  # set_grad_none=True (apex's default)


def test_fused_adam_refuses_what_torch_lacks() -> None:
    with pytest.raises(SMPUnsupportedError, match="amsgrad=True"):
        FusedAdam(_net().parameters(), amsgrad=True)
    with pytest.raises(SMPValidationError, match="bias_correction=False"):
        FusedAdam(_net().parameters(), bias_correction=False)
    with pytest.raises(SMPUnsupportedError, match=r"FusedNovoGrad is not built.*FusedLAMB"):
        FusedNovoGrad(_net().parameters())
    assert FusedLamb is FusedLAMB


def _reference_lamb(
    params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]], cfg: dict[str, Any]
) -> list[torch.Tensor]:
    """LAMB as apex documents it, element by element in float64 Python scalars."""
    b1, b2 = cfg["betas"]
    wd, eps, lr, max_norm = cfg["weight_decay"], cfg["eps"], cfg["lr"], cfg["max_grad_norm"]
    w = [p.double().flatten().tolist() for p in params]
    m = [[0.0] * len(x) for x in w]
    v = [[0.0] * len(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        g = [x.double().flatten().tolist() for x in grads]
        norm = math.sqrt(sum(e * e for x in g for e in x))
        clip = norm / max_norm if max_norm > 0 and norm > max_norm else 1.0
        for i in range(len(w)):
            update = []
            for j in range(len(w[i])):
                gj = g[i][j] / clip
                if not cfg["adam_w_mode"]:
                    gj += wd * w[i][j]
                m[i][j] = b1 * m[i][j] + (1 - b1) * gj
                v[i][j] = b2 * v[i][j] + (1 - b2) * gj * gj
                u = (m[i][j] / (1 - b1**t)) / (math.sqrt(v[i][j] / (1 - b2**t)) + eps)
                if cfg["adam_w_mode"]:
                    u += wd * w[i][j]
                update.append(u)
            wn = math.sqrt(sum(e * e for e in w[i]))
            un = math.sqrt(sum(e * e for e in update))
            ratio = wn / un if wd != 0 and wn > 0 and un > 0 else 1.0
            w[i] = [a - lr * ratio * u for a, u in zip(w[i], update, strict=True)]
    return [torch.tensor(x, dtype=torch.float64).view(p.shape) for x, p in zip(w, params, strict=True)]


@pytest.mark.parametrize(
    ("adam_w_mode", "weight_decay", "max_grad_norm"),
    [(True, 0.01, 1.0), (False, 0.1, 0.05), (True, 0.0, 0.0)],
)
def test_fused_lamb_matches_the_formula(adam_w_mode: bool, weight_decay: float, max_grad_norm: float) -> None:
    cfg = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    cfg.update(max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode)
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    opt = FusedLAMB(params, **cfg)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    expected = _reference_lamb(start, grads, cfg)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def _pipelined_lamb(world: Any, cfg: dict[str, Any]) -> list[torch.Tensor]:
    smp.init(cfg)
    model = smp.DistributedModel(_net())
    opt = smp.DistributedOptimizer(FusedLAMB(model.parameters(), lr=0.05, max_grad_norm=0.1))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for s in range(4):
        gen = torch.Generator().manual_seed(s)
        x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 2, generator=gen)
        opt.zero_grad()
        train_step(x, y)
        opt.step()
    full = model.state_dict()
    return [full[k] for k in sorted(full)]


def test_fused_lamb_under_a_pipeline_is_lamb_on_the_whole_model(worlds: Any) -> None:
    """Its gradient norm (which clips here: max_grad_norm=0.1) spans both stages."""
    reference = _net()
    opt = FusedLAMB(reference.parameters(), lr=0.05, max_grad_norm=0.1)
    _train(reference, opt)
    expected = [v for _, v in sorted(reference.state_dict().items())]
    for got in worlds.run(2, _pipelined_lamb, {"pipeline_parallel_degree": 2, "microbatches": 1}):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _tp_lamb(world: Any) -> tuple[int, int, dict[str, torch.Tensor]]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "microbatches": 1})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(FusedLAMB(model.parameters(), lr=0.05, max_grad_norm=0.1))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for s in range(3):
        gen = torch.Generator().manual_seed(s)
        x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 2, generator=gen)
        opt.zero_grad()
        train_step(x, y)  # the same batch on both ranks (tp=2, dp=2 by rank: the same data)
        opt.step()
    distributed = sum(model.is_distributed_parameter(p) for p in model.parameters())
    return smp.tp_rank(), distributed, {k: v.clone() for k, v in model.state_dict().items()}


def test_fused_lamb_with_tensor_parallel_shards_is_lamb_on_the_whole_model(worlds: Any) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = FusedLAMB(reference.parameters(), lr=0.05, max_grad_norm=0.1)
    _train(reference, opt, steps=3)
    expected = reference.state_dict()
    for tp_rank, distributed, got in worlds.run(2, _tp_lamb):
        assert distributed > 0 and set(got) == set(expected), sorted(got)
        for k, full in expected.items():
            e = full
            if got[k].shape != e.shape:  # this rank's shard (the state_dict of TP ranks is local)
                dim = next(i for i in range(e.dim()) if got[k].shape[i] != e.shape[i])
                e = full.narrow(dim, tp_rank * got[k].shape[dim], got[k].shape[dim])
            torch.testing.assert_close(got[k], e, rtol=1e-5, atol=1e-6, msg=k)


def test_optimizers_wrapped_keep_their_type() -> None:
    a = _net()
    opt = FusedAdam(copy.deepcopy(a).parameters())
    assert isinstance(opt, torch.optim.Adam)
