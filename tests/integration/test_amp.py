"""smp.amp.GradScaler: loss scaling in a pipeline trains like torch's GradScaler in one process, and an
overflow on one rank makes every rank skip that step and lower the scale alike.

An MLP on pp=2 (its last layer on pp_rank 1), 2 microbatches, SGD, 5 steps; the scale starts at 2**8 and
doubles after every 2 good steps. In step 2 one gradient of the last layer is set to inf on one rank
only (pp_rank 1; with 4 ranks, only on the second replica's), as an fp16 overflow would. Plain PyTorch
(one process, torch.amp.GradScaler, the same microbatches and the same inf) skips step 2 and halves the
scale; so must every rank, including those whose own gradients were finite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

STEPS = 5
OVERFLOW_STEP = 2
MICROBATCHES = 2
INIT_SCALE, GROWTH_INTERVAL = 2.0**8, 2


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _autocast(on: bool) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _reference(autocast: bool) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ref = MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    losses, scales = [], []
    for s in range(STEPS):
        x, y = _data(s)
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            with _autocast(autocast):
                loss = F.mse_loss(ref(xs), ys) / MICROBATCHES
            scaler.scale(loss).backward()
            total += loss.item()
        if s == OVERFLOW_STEP:
            assert ref.fc3.weight.grad is not None
            ref.fc3.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        losses.append(total)
        scales.append(scaler.get_scale())
    return losses, scales, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _train(world: Any, overflow_rank: int, autocast: bool) -> dict[str, Any]:
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": MICROBATCHES,
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    torch.manual_seed(0)
    net = MLP()
    smp.set_partition(net.fc3, 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(INIT_SCALE, growth_interval=GROWTH_INTERVAL)

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _autocast(autocast):  # the ranks that run the layers run them under it too
            loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    losses, scales, skipped = [], [], None
    for s in range(STEPS):
        x, y = _data(s)  # the same batch on every replica: the reference is one process
        opt.zero_grad()
        out = train_step(x, y)
        if s == OVERFLOW_STEP and smp.rank() == overflow_rank:
            assert net.fc3.weight.grad is not None
            net.fc3.weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.local_parameters()]
        scaler.step(opt)
        scaler.update()
        if s == OVERFLOW_STEP:
            skipped = all(torch.equal(b, p) for b, p in zip(before, model.local_parameters(), strict=True))
        losses.append(out.reduce_mean().item())
        scales.append(scaler.get_scale())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_losses, ref_scales, ref_state = _reference(autocast)
    return {
        "rank": smp.rank(),
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "state_error": _first_difference(state, ref_state),
        "ref_losses": ref_losses,
        "ref_scales": ref_scales,
    }


def _first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    if set(got) != set(want):
        return f"keys differ: {sorted(set(got) ^ set(want))}"
    for k, w in want.items():
        if not torch.allclose(got[k], w, rtol=1e-5, atol=1e-6):
            return f"{k}: max difference {(got[k] - w).abs().max().item():.3g}"
    return None


@pytest.mark.parametrize(("n", "overflow_rank", "autocast"), [(2, 1, False), (4, 3, False), (2, 1, True)])
def test_grad_scaler_trains_like_torch_and_all_ranks_skip_an_overflow(
    worlds: Any, n: int, overflow_rank: int, autocast: bool
) -> None:
    results = worlds.run(n, _train, overflow_rank, autocast, timeout=180)
    want_scales = results[0]["ref_scales"]
    assert want_scales == [256.0, 512.0, 256.0, 256.0, 512.0]  # the schedule the test is about
    for r in results:
        assert r["skipped"], f"rank {r['rank']} stepped although rank {overflow_rank} overflowed"
        assert r["scales"] == want_scales, r
        assert r["state_error"] is None, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), r


def test_grad_scaler_defaults_follow_torch_cuda_amp() -> None:
    scaler = smp.amp.GradScaler(2.0**10)  # positional: init_scale, as torch.cuda.amp.GradScaler
    assert scaler.get_scale() == 2.0**10
    assert scaler.get_growth_interval() == 2000
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert scaler._device == expected
    assert isinstance(scaler, torch.amp.GradScaler)
