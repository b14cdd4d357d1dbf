"""A short pp=2 x dp=2 job that makes the smp calls transformers' Trainer makes on its smp path, then
ends as such a script does, without any shutdown (tests/faults/test_pipeline_exit.py).

Training steps (`smp.step` with `model.backward`, the whole model's gradient norm clipped by
`clip_master_grads`, the DP reducer), a forward-only evaluation step whose outputs are gathered over
the data-parallel group (the Trainer's ``smp_gather``), the full state dict gathered on every rank with
rank 0 writing it (``save_model``), then interpreter exit: the pipeline runtime, the MPI transport and
its closing barrier, the process groups, the heartbeat and MPI finalization all come down at once.
Each rank prints one ``ok`` line as its last act before exit.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import mp as smp

smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
torch.manual_seed(0)
model = smp.DistributedModel(
    nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 4))
)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


@smp.step
def train(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


@smp.step
def forward_only(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out


data = torch.Generator().manual_seed(smp.dp_rank())
for _ in range(3):
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
    optimizer.zero_grad()
    train(model, x, y).reduce_mean()
    optimizer.clip_master_grads(0.5)
    optimizer.step()
with torch.no_grad():
    outputs = forward_only(model, torch.randn(8, 16, generator=data)).concat()
gathered = smp.allgather(outputs, smp.CommGroup.DP_GROUP)
assert len(gathered) == smp.dp_size(), len(gathered)
state = model.state_dict()
if smp.rank() == 0:
    torch.save(state, os.path.join(os.environ["MP_TEST_OUT"], "model.pt"))
print(f"rank {smp.rank()} ok", flush=True)
