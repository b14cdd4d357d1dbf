"""``atp.spm``: the paper's sharding-spec namespace (its Figure 9), ``Shard``, ``Replicate``, ``Partial``."""

from __future__ import annotations

from mp_tensor.atp.spec import (
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute,
    local_shape,
    shard_tensor,
    to_global,
    unshard_tensors,
)

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute",
    "local_shape",
    "shard_tensor",
    "to_global",
    "unshard_tensors",
]
