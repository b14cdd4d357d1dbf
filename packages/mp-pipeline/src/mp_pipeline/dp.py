"""Data parallelism across pipeline replicas: the first-step broadcast and bucketed gradient averaging.

Each rank reduces only what it holds (its partition's parameters) over its data-parallel group, whose
members hold the same partition. Tensors are packed per dtype into buckets of at most ``bucket_bytes``
and each bucket is one collective (``mp_comm.collectives``: MPI for CPU tensors when the group has an
MPI communicator, torch.distributed otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mp_comm.collectives import all_reduce_, broadcast_

__all__ = ["agree_any", "broadcast_tensors", "buckets", "reduce_gradients"]


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``bucket_bytes`` (a larger tensor alone)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, *, bucket_bytes: int = 25 << 20
) -> None:
    """Overwrite ``tensors`` in place with those of the group's first member."""
    if dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for bucket in buckets(tensors, bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            broadcast_(flat, group, 0)  # over MPI when the group has an MPI twin (CPU), else torch's
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def agree_any(flags: Sequence[bool], group: dist.ProcessGroup) -> list[bool]:
    """Element-wise OR of ``flags`` over the group (every member passes the same number)."""
    if not flags:
        return []
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.uint8)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in t.tolist()]


def reduce_gradients(
    params: Sequence[nn.Parameter],
    group: dist.ProcessGroup,
    *,
    bucket_bytes: int = 25 << 20,
    divisor: float | None = None,
) -> None:
    """Sum the gradients of ``params`` over the group and divide by ``divisor`` (default: its size).

    A parameter that has a gradient on some member but not on others counts as zero there; one that
    has none anywhere keeps None (as plain PyTorch on the whole batch would). A divisor other than
    the group's size serves parameters whose gradients already cover several members' samples
    (tensor-parallel shards, reduced over a smaller group than the samples they saw).
    """
    size = dist.get_world_size(group)
    scale = float(size if divisor is None else divisor)
    if size == 1:
        if scale != 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(scale)
        return
    have = agree_any([p.grad is not None for p in params], group)
    live: list[torch.Tensor] = []
    for p, h in zip(params, have, strict=True):
        if not h:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        live.append(p.grad)
    with torch.no_grad():
        for bucket in buckets(live, bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            all_reduce_(flat, group)  # over MPI when the group has an MPI twin (CPU), else torch's
            flat /= scale
            offset = 0
            for g in bucket:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
