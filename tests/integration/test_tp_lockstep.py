"""Tensor-parallel ranks of a pipeline run their servers' events in one order, whatever the timing.

GPT-2 on tp=2 x pp=2, with blocks 2 and 3 on pp_rank 1 (two remote calls per microbatch). On tp_rank 1
the backward of block 3 for microbatch 0 answers late (a hook sleeps after its collectives), so that
rank's pp_rank 0 starts microbatch 1's backward before it sends block 2's backward of microbatch 0,
while tp_rank 0's pp_rank 0 (which got its answer at once) sends them the other way round. Served in
arrival order, the two pp_rank-1 ranks would then run block 2 of microbatch 0 against block 3 of
microbatch 1: collectives of equal shapes pairing different samples, silently wrong gradients. With the
TP leader's order (mp_pipeline.sequence) every step still matches single-process PyTorch.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import mp as smp
from mp_pipeline.context import current
from tests.integration._tp_model import (
    PER_RANK,
    _config,
    _data,
    _optimizer,
    _reference,
    assert_losses,
    global_loss,
    gpt_step,
)

transformers = pytest.importorskip("transformers")

LATE = 0.3
"""Seconds tp_rank 1's answer to microbatch 0's backward of block 3 is held back."""


def _late_backward(block: torch.nn.Module) -> None:
    """On tp_rank 1 only: the block's input gradient for microbatch 0 waits LATE seconds after its
    backward's collectives, so that the answer to the requester is late on that rank alone."""
    forward = block.forward

    def delayed(inputs: tuple[Any, ...]) -> Any:  # a distributed layer takes (hidden, mask, ...)
        task, hidden = current(), inputs[0]
        if smp.tp_rank() == 1 and task is not None and task.microbatch == 0 and hidden.requires_grad:
            hidden.register_hook(lambda grad: time.sleep(LATE))
        return forward(inputs)

    block.forward = delayed


def _hold_ready(module: torch.nn.Module) -> None:
    """Microbatch 1 reaches model.backward a little later than microbatch 0 (on every rank)."""
    forward = module.forward

    def delayed(*args: Any, **kwargs: Any) -> Any:
        task = current()
        if task is not None and task.microbatch == 1:
            time.sleep(LATE / 3)
        return forward(*args, **kwargs)

    module.forward = delayed


def _train(world: Any) -> dict[str, Any]:
    smp.init(
        {
            "tensor_parallel_degree": 2,
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "ddp": True,
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    torch.manual_seed(0)
    with smp.tensor_parallelism(whole_stack=False):  # HF's GPT-2 kept, its blocks distributed
        model = transformers.GPT2LMHeadModel(_config(4))
    model = smp.DistributedModel(model)
    blocks = model.get_module().transformer.h  # the distributed blocks (they replace the HF ones)
    for block in (blocks[2], blocks[3]):
        smp.set_partition(block, 1)
    _late_backward(blocks[3])
    _hold_ready(model.get_module().transformer.ln_f)
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    train_step = gpt_step()
    dp, rank = smp.dp_size(), smp.dp_rank()
    losses = []
    for ids in _data(dp):
        opt.zero_grad()
        out = train_step(model, ids[rank * PER_RANK : (rank + 1) * PER_RANK])
        opt.step()
        losses.append(global_loss(out, dp))
    return {"losses": losses, "dp": dp}


def test_tensor_parallel_ranks_serve_one_order_of_events(worlds: Any) -> None:
    results = worlds.run(4, _train, timeout=240)
    ref_losses, _, _ = _reference(results[0]["dp"], False, 4)
    for r, res in enumerate(results):
        assert_losses(res["losses"], ref_losses, r)
