"""A three-layer net and a manual pp=2 config (every unmarked module on pp_rank 0), shared by
test_smp_checkpoint and test_partition_file."""

from __future__ import annotations

import torch
from torch import nn

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))
