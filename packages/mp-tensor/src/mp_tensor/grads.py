"""Data-parallel gradient reduction for a model with tensor-parallel modules.

A parameter whose gradient already covers the whole TP group's batch (``is_scaled_batch_parameter``:
the shards of distributed modules, and the parameters they replicate but apply to the exchanged batch)
is summed over the *reduced* data-parallel group; every other parameter over the data-parallel group.
Averaging matches one process training on the global batch:

- without ``prescaled_batch`` each rank's loss is over its own samples and the global batch is
  ``dp_size`` such losses, so both kinds are divided by ``dp_size = rdp_size * tp_size``;
- with ``prescaled_batch`` the TP ranks share one batch and compute the same loss, so the global batch
  is ``rdp_size`` batches: scaled-batch gradients are divided by ``rdp_size``, and the others (identical
  on the TP ranks) by ``dp_size``, which averages identical copies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mp_comm.waits import collective_wait
from mp_tensor.nn.base import is_scaled_batch_parameter

__all__ = ["gradient_group", "reduce_gradients"]


def gradient_group(param: torch.Tensor) -> str:
    """ "rdp" for parameters whose gradients are reduced over the reduced-data-parallel group, else "dp"."""
    return "rdp" if is_scaled_batch_parameter(param) else "dp"


@torch.no_grad()
def reduce_gradients(
    params: Iterable[nn.Parameter],
    *,
    dp_group: dist.ProcessGroup | None,
    rdp_group: dist.ProcessGroup | None,
    tp_size: int,
    prescaled_batch: bool = False,
    average: bool = True,
) -> None:
    """All-reduce the gradients of ``params`` in place (a group of None means a single rank)."""
    dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
    rdp_size = 1 if rdp_group is None else dist.get_world_size(rdp_group)
    for p in params:
        if p.grad is None:
            continue
        scaled = is_scaled_batch_parameter(p)
        group = rdp_group if scaled else dp_group
        if group is not None and dist.get_world_size(group) > 1:
            with collective_wait("all_reduce", group):
                dist.all_reduce(p.grad, group=group)
        if average:
            divisor = (rdp_size if prescaled_batch else rdp_size * tp_size) if scaled else dp_size
            if divisor > 1:
                p.grad.div_(divisor)
