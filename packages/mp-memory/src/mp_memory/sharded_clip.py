"""Gradient clipping by the global L2 norm of a sharded model (``sdp_gradient_clipping``): shards summed
over the sharding group and, under tensor parallelism, TP shards over the TP group."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mp_memory.sharded_state import _local

if TYPE_CHECKING:
    from mp_memory.sharded import ShardedDataParallel, TensorParallel

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    sharding: ShardedDataParallel | None = None,
    owners: Mapping[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale the gradients so that the global L2 norm over every shard is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on the unsharded model; returns that norm (float64).
    Collective over the mesh of the DTensor gradients (and the TP group of ``sharding``, whose TP
    shards count once each): call it on every rank. ``owners``: for a tensor that stands for a model
    parameter (an fp32 master, by id), that parameter, whose TP layout it has."""
    pairs = [(p, p.grad) for p in params if p.grad is not None]
    grads = [g for _, g in pairs]
    if sharding is not None and sharding.tp is not None:
        found = owners or {}
        laid_out = [(found.get(id(p), p), g) for p, g in pairs]
        total = _tp_norm(laid_out, sharding.shard_group, sharding.tp)
    else:
        total = _norm(grads)
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return total


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    square = torch.zeros((), dtype=torch.float64)
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded, 2.0)
        assert isinstance(norm, DTensor)
        square += norm.full_tensor().double().cpu() ** 2
    if plain:
        square += torch.nn.utils.get_total_norm(plain, 2.0).double().cpu() ** 2
    return square.sqrt()


def _tp_norm(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup, tp: TensorParallel
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient: shards summed over ``group`` (one replica's sharding
    group), TP shards over the TP group too, TP-replicated parameters counted once."""
    squares = torch.zeros(4, dtype=torch.float64)  # [sharded+split, sharded, split, neither]
    for p, g in pairs:
        index = (0 if tp.split(p) else 1) if isinstance(g, DTensor) else (2 if tp.split(p) else 3)
        squares[index] += _local(g).detach().double().square().sum().cpu()
    shard_part = squares[:2].clone()
    dist.all_reduce(shard_part, group=group)
    split_part = torch.stack([shard_part[0] + squares[2]])
    dist.all_reduce(split_part, group=tp.group)
    return (split_part[0] + shard_part[1] + squares[3]).sqrt()
