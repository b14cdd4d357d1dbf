"""A short smp job that ends as smp scripts do, without any shutdown (tests/faults/test_clean_exit.py).

It initializes smp with the degrees in MP_TEST_PP and MP_TEST_TP, runs one allreduce in each of its
groups, prints its ranks, and ends. Right after a gloo collective returns, gloo's worker thread may
still hold the tensors; if the interpreter finalizes in that window the worker dies taking the GIL
(`terminate called without an active exception`, SIGABRT): what mp's teardown at exit prevents (it
destroys mp's groups and waits for the workers of those the script still holds, as this one does).
With MP_TEST_RAISE_RANK set, that rank raises instead of ending normally.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mp as smp

smp.init(
    {
        "pipeline_parallel_degree": int(os.environ.get("MP_TEST_PP", "1")),
        "tensor_parallel_degree": int(os.environ.get("MP_TEST_TP", "1")),
        "microbatches": 2,
        "ddp": True,
    }
)
groups = [
    dist.group.WORLD,
    smp.get_pp_process_group(),
    smp.get_tp_process_group(),
    smp.get_dp_process_group(),
    smp.get_mp_process_group(),
]
tensors = [torch.ones(4) for _ in groups]
for tensor, group in zip(tensors, groups, strict=True):
    dist.all_reduce(tensor, group=group)
print(f"rank {smp.rank()} pp {smp.pp_rank()} tp {smp.tp_rank()} dp {smp.dp_rank()} ok", flush=True)
if os.environ.get("MP_TEST_RAISE_RANK") == str(smp.rank()):
    raise RuntimeError(f"planned failure on rank {smp.rank()}")
