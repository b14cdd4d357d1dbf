"""Data-parallel replicas that run different numbers of steps end the job with an error, not a hang.

smp_clients.md's S8: a data loader sized differently on the replicas (a mis-sized DistributedSampler)
lets one replica finish its loop while the other goes on into a step whose gradient averaging waits for
it forever. Here the waiting ranks raise SMPRuntimeError after MP_PIPELINE_TIMEOUT, naming the replicas
and the fix, and the first of them ends the MPI job.
"""

from __future__ import annotations

from pathlib import Path

from tests._harness import run_script

SCRIPT = """
import torch
import torch.nn.functional as F
from torch import nn
import mp as smp

smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@smp.step
def train(x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


for _ in range(3 if smp.dp_rank() == 0 else 2):  # replica 1 has one batch less
    train(torch.randn(4, 6), torch.randn(4, 3))
    opt.step()
    opt.zero_grad()
print(f"rank {smp.rank()} finished its loop", flush=True)
"""

TIMEOUT = 8


def test_a_replica_that_runs_out_of_batches_is_an_error_not_a_hang(tmp_path: Path) -> None:
    script = tmp_path / "uneven.py"
    script.write_text(SCRIPT)
    output, code, took = run_script(script, 4, env={"MP_PIPELINE_TIMEOUT": str(TIMEOUT)})
    assert code != 0, output
    assert "rank 2 finished its loop" in output and "rank 0 finished its loop" not in output, output
    # within the timeout, or sooner when the replica that finished has already left the group
    assert "the data-parallel replicas [0, 2] did not all finish step 3 " in output or (
        "the data-parallel replicas [1, 3] did not all finish step 3 " in output
    ), output
    assert "DistributedSampler(..., drop_last=True)" in output and "aborting the MPI job" in output, output
    assert took < 120, f"the job took {took:.0f} s to end"
