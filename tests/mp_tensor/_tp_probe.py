"""Probes for the tensor-parallelism tests and benchmarks: collectives issued, activation bytes saved."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_CANONICAL = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "batch_isend_irecv": "p2p",
}


@contextlib.contextmanager
def count_collectives() -> Iterator[list[tuple[str, int]]]:
    """Record every torch.distributed collective issued inside: (kind, numel of its first tensor)."""
    issued: list[tuple[str, int]] = []
    saved: dict[str, Callable[..., Any]] = {}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else None
            numel = first.numel() if isinstance(first, torch.Tensor) else 0
            issued.append((_CANONICAL[name], numel))
            return fn(*args, **kwargs)

        return counted

    for name in _CANONICAL:
        fn = getattr(dist, name, None)
        if fn is not None:
            saved[name] = fn
            setattr(dist, name, wrap(name, fn))
    try:
        yield issued
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def tally(issued: list[tuple[str, int]]) -> dict[str, int]:
    return dict(Counter(kind for kind, _ in issued))


def saved_activation_bytes(model: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct tensors autograd saves while ``run()`` executes (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out
