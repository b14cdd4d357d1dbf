"""Small models for the planner's tests, built by ``tests.mp.plan_models:blocks`` (a factory, as
``mp-plan`` and ``mp-partition`` take them)."""

from __future__ import annotations

import torch
from torch import nn

from mp.plan import Cluster, get_cluster

FACTORY = "tests.mp.plan_models:blocks"
GB = 10**9


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Stack(nn.Module):
    """``layers`` blocks of Linear(hidden, hidden) + ReLU and a Linear(hidden, 4) head."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def blocks(layers: int = 4, hidden: int = 16, seq: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model and one sample's input, shape (1, seq, hidden)."""
    return Stack(layers, hidden), (torch.zeros(1, seq, hidden),)


class StemStack(Stack):
    """A ``stem`` (Linear + ReLU) before the blocks of :class:`Stack`: activations before the layers."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__(layers, hidden)
        self.stem = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.stem(x) * 2.0)


def stem_blocks(layers: int = 4, hidden: int = 16, seq: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """:class:`StemStack` and one sample's input, shape (1, seq, hidden), requiring grad."""
    return StemStack(layers, hidden), (torch.zeros(1, seq, hidden, requires_grad=True),)


class Scale(nn.Module):
    """A layer mp has no distributed implementation for (a per-channel scale)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight)


def scales(layers: int = 3, hidden: int = 16, seq: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``layers`` :class:`Scale` layers in a ModuleList (run by :class:`ScaleStack`), one sample's input."""
    return ScaleStack(layers, hidden), (torch.zeros(1, seq, hidden, requires_grad=True),)


class ScaleStack(nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Scale(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def free_cluster(**changes: object) -> Cluster:
    """A cluster with free communication and 1 FLOP/s, so that times are FLOP counts."""
    base = get_cluster("cpu").with_(
        peak_flops_half=1.0,
        peak_flops_fp32=1.0,
        compute_efficiency=1.0,
        intra_bandwidth=1e30,
        intra_latency=1e-30,
        inter_bandwidth=1e30,
        inter_latency=1e-30,
        memory_bandwidth=1e30,
        c10d_latency=0.0,
        c10d_bandwidth=0.0,
        c10d_reduce_scatter_latency=0.0,
        c10d_reduce_scatter_bandwidth=0.0,
        call_overhead=0.0,
        device_memory_bytes=1000 * GB,
        devices_per_host=64,
    )
    return base.with_(**changes)
