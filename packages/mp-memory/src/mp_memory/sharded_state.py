"""Sharded data parallelism's tensors in and out of their shards: a full tensor cut to this rank's piece,
optimizer states with shards as plain tensors, the bytes a rank holds (``mp_memory.sharded``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["as_like", "load_local_optimizer_state", "local_optimizer_state", "local_part", "state_bytes"]


def _unique_params(modules: Iterable[nn.Module]) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_part(value: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``value``, a full tensor of ``like``'s global shape, as ``like`` holds it
    (no communication: every rank holds the full value)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(value.shape) != tuple(like.shape):
        from mp_memory.sharded import ShardingError

        raise ShardingError(
            f"a full tensor of shape {tuple(value.shape)} for a sharded parameter of shape "
            f"{tuple(like.shape)}. Fix: load a state saved from the same model"
        )
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return value[index]


def as_like(value: torch.Tensor, like: torch.Tensor, *, full: bool) -> torch.Tensor:
    """``value`` (a full tensor when ``full``, else this rank's shard) in ``like``'s form: a DTensor
    sharded as ``like`` when it is one, on its device."""
    if not isinstance(like, DTensor) or value.dim() == 0:
        return value.to(like.device)
    local = local_part(value, like) if full else value
    return DTensor.from_local(
        local.to(like.device), like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's optimizer state dict with every DTensor replaced by this rank's shard."""
    sd = torch.optim.Optimizer.state_dict(optimizer)
    state = {
        i: {k: _local(v).detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load what :func:`local_optimizer_state` saved: shards become DTensors like their parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, Any] = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        entry: dict[str, Any] = {}
        for k, v in s.items():
            entry[k] = v
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0:
                entry[k] = DTensor.from_local(
                    v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
        state[i] = entry
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": state, "param_groups": sd["param_groups"]})


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (shards counted locally)."""
    params = list(_unique_params([module]))
    out = {
        "params": sum(_local(p).numel() * p.element_size() for p in params),
        "grads": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for s in optimizer.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    out["optimizer"] += _local(v).numel() * v.element_size()
    return out
