"""A short training job that injects one fault (tests/faults/test_fault_matrix.py, docs/faults.md).

MP_FAULT="<rank>:<phase>:<kind>" picks the global rank, the phase (preinit: before smp.init, init,
forward, backward, step: the optimizer step) and the fault: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: the
process stays, silent), ``raise`` (a RuntimeError naming the rank and phase), ``slow`` (sleeps
MP_TEST_SLOW seconds, alive, then goes on). MP_TEST_PP and MP_TEST_TP set the degrees; the
rest of the world is data parallelism. The job runs 3 steps of a small MLP, pipelined when pp > 1, with
a DistributedLinear layer when tp > 1.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

RANK, PHASE, KIND = os.environ["MP_FAULT"].split(":")


SLOWED: list[str] = []  # a slow rank sleeps once, not at every microbatch
STEPS: list[int] = []  # the steps done


def fault(phase: str) -> None:
    rank = int(os.environ["PMI_RANK"]) if phase == "preinit" else smp.rank()
    if phase != PHASE or rank != int(RANK) or SLOWED or (KIND == "slow" and not STEPS):
        return  # slow: in a step after the first (a sleep in the first would skew the partitioner's timing)
    print(f"rank {rank}: injecting {KIND} at {phase} t={time.time():.3f}", flush=True)
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif KIND == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif KIND == "slow":
        SLOWED.append(phase)
        time.sleep(float(os.environ["MP_TEST_SLOW"]))
    else:
        raise RuntimeError(f"injected failure on rank {rank} at {phase}")


class Hooked(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault("forward")
        y = self.inner(x)
        if y.requires_grad:
            y.register_hook(lambda g: (fault("backward"), g)[1])
        return y


pp, tp = int(os.environ.get("MP_TEST_PP", "1")), int(os.environ.get("MP_TEST_TP", "1"))
fault("preinit")
smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2, "ddp": True})
fault("init")
torch.manual_seed(0)
middle: nn.Module = smp.nn.DistributedLinear(8, 8) if tp > 1 else nn.Linear(8, 8)
model = nn.Sequential(Hooked(nn.Linear(6, 8)), nn.ReLU(), Hooked(middle), nn.ReLU(), Hooked(nn.Linear(8, 3)))
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@smp.step
def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


for _ in range(3):
    train(torch.randn(4, 6), torch.randn(4, 3))
    fault("step")
    optimizer.step()
    optimizer.zero_grad()
    STEPS.append(len(STEPS))
print(f"rank {smp.rank()} finished", flush=True)
