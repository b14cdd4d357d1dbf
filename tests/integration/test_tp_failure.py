"""A module that fails on one tensor-parallel rank only still ends the whole job, under plain mpiexec.

Its TP peer is then inside a blocking collective that the failing rank never joins, and no pipeline
message can reach it there. The job still stops: the other ranks raise the error from their step
(the failure names the rank and the module, with its traceback), and the first uncaught exception
aborts the MPI job (mp_comm.world's excepthook), taking the waiting peer with it.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests._harness import run_script

SCRIPT = """
import sys, time
import torch
from torch import nn
import mp as smp

smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2,
          "auto_partition": False, "default_partition": 0})


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with smp.tensor_parallelism():
            self.lin = smp.nn.DistributedLinear(8, 8)

    def forward(self, x):
        if smp.tp_rank() == 1:  # its TP peer goes on into the layer's collective
            print(f"FAILING AT {time.time()}", flush=True)
            raise ValueError("tail breaks on tp_rank 1 only")
        return self.lin(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 8)
        self.tail = Tail()

    def forward(self, x):
        return self.tail(torch.relu(self.head(x)))


torch.manual_seed(0)
net = Net()
smp.set_partition(net.tail, 1)
model = smp.DistributedModel(net)


@smp.step
def train(x):
    loss = model(x).sum()
    model.backward(loss)
    return loss


train(torch.randn(4, 8))
print("STEP FINISHED", flush=True)
"""


def test_a_module_failing_on_one_tp_rank_ends_the_job(tmp_path: Path) -> None:
    script = tmp_path / "tp_fail.py"
    script.write_text(SCRIPT)
    output, code, _ = run_script(script, 4, timeout=300)
    ended = time.time()
    assert code != 0, output
    assert "STEP FINISHED" not in output, output
    failed_at = [float(line.split()[-1]) for line in output.splitlines() if "FAILING AT" in line]
    assert failed_at, output
    assert ended - min(failed_at) < 30, f"the job ran {ended - min(failed_at):.0f} s after the failure"
    # Whichever rank aborted first, its report names the failing rank and module, with the traceback.
    assert "ValueError on rank 3 in module 'tail'" in output, output
    assert 'raise ValueError("tail breaks on tp_rank 1 only")' in output, output
    assert "aborting the MPI job" in output, output
