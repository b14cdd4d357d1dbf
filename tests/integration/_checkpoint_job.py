"""The small pp=2 training job of the checkpoint crash and integrity tests (test_checkpoint_faults, which
also runs it as a script under mpiexec, test_checkpoint_async, test_checkpoint_integrity)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def build_job(seed: int) -> tuple[Any, Any]:
    from mp_partition import set_partition

    smp.init(PP2)
    torch.manual_seed(seed)
    net = Net()
    set_partition(net.b, 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    return model, opt


@smp.step
def step_job(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def train_once(model: Any, opt: Any, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    opt.zero_grad()
    step_job(model, torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
    opt.step()


def state_copy(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def own_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "a." if smp.pp_rank() == 0 else "b."
    return {k: v for k, v in state.items() if k.startswith(prefix)}
