"""Static and fast mode pieces shared by the pipeline integration tests (test_pipeline_equivalence,
test_pipeline_shortcut, test_pipeline_posted): how many steps static mode records, a fast-mode trainer,
plain SGD to compare with, and the Relay model whose children hand outputs to each other."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

import mp as smp
from mp import DistributedModel, DistributedOptimizer, step

RECORD_STEPS = 2
"""Steps static mode records before replaying in these tests (MP_PIPELINE_STATIC_STEPS; default 5)."""


@contextlib.contextmanager
def record_steps(n: int) -> Iterator[None]:
    before = os.environ.get("MP_PIPELINE_STATIC_STEPS")
    os.environ["MP_PIPELINE_STATIC_STEPS"] = str(n)
    try:
        yield
    finally:
        if before is None:
            del os.environ["MP_PIPELINE_STATIC_STEPS"]
        else:
            os.environ["MP_PIPELINE_STATIC_STEPS"] = before


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def plain_sgd(
    ref: torch.nn.Module,
    data: Batches,
    microbatches: int,
    before: Callable[[int], None] | None = None,
    lr: float = 0.1,
) -> list[float]:
    """The losses of plain PyTorch training ``ref`` (MSE, SGD) on ``data`` split into microbatches
    (``before(step)`` runs before each step)."""
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for s, (x, y) in enumerate(data):
        if before is not None:
            before(s)
        total = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = torch.nn.functional.mse_loss(ref(xs), ys) / microbatches
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses


def fast_trainer(
    net: torch.nn.Module,
    pp: int,
    owners: dict[str, int],
    microbatches: int,
    *,
    fast_mode: bool | None = True,
    lr: float = 0.1,
) -> tuple[Any, Any, Any]:
    """``net`` under fast mode (children named in ``owners`` on those pp_ranks, the rest on 0), its SGD
    optimizer and an MSE training step. ``fast_mode=None``: mp's default (the shortcut, with retries)."""
    with record_steps(RECORD_STEPS):
        smp.init(
            {
                "pipeline_parallel_degree": pp,
                "microbatches": microbatches,
                "fast_mode": fast_mode,
                "auto_partition": False,
                "default_partition": 0,
            }
        )
        for name, owner in owners.items():
            smp.set_partition(getattr(net, name), owner)
        model = DistributedModel(net)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


class Relay(torch.nn.Module):
    """Children on ranks 1, 2, 1 and 3 called in turn from rank 0: what a and b return goes straight to
    the next child under fast mode; what c returns the parent also reads, so it comes back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 8)
        self.d = torch.nn.Linear(8, 8)
        self.rewire = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.embed(x))  # rank 1, handed to rank 2
        if self.rewire == "elsewhere":
            h = self.d(h)
        elif self.rewire == "twice":
            h = self.b(h) + self.b(h)
        else:
            h = self.b(h)  # rank 2, handed back to rank 1
        g = self.c(h)  # rank 1; the parent reads it too
        return self.d(torch.tanh(g)).sum(-1) + g.mean(-1)


RELAY_OWNERS = {"a": 1, "b": 2, "c": 1, "d": 3}
