"""Small models for the mp_partition tests (also CLI factories: ``tests.mp_partition.models:build_stack``)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A small residual MLP block."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Stack(nn.Module):
    """``layers`` identical blocks in a ModuleList."""

    def __init__(self, layers: int = 48, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TiedLM(nn.Module):
    """Embedding and LM head sharing one weight, under different parents, plus an unused module."""

    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = Stack(layers, width)
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab, bias=False))
        self.head[1].weight = self.embed.weight
        self.unused = nn.Linear(width, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


class HugeEmbedding(nn.Module):
    """One huge embedding and many small layers, all children of the root."""

    def __init__(self, vocab: int = 20000, width: int = 8, small: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.small = nn.ModuleList(nn.Linear(width, width) for _ in range(small))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.small:
            x = torch.tanh(layer(x))
        return x


class HugeTrunk(nn.Module):
    """A costly trunk of four big layers and many small layers beside it, all under the root."""

    def __init__(self, width: int = 8, big: int = 256, small: int = 12) -> None:
        super().__init__()
        self.proj = nn.Linear(width, big)
        self.trunk = nn.Sequential(*(nn.Linear(big, big) for _ in range(4)))
        self.small = nn.ModuleList(nn.Linear(width, width) for _ in range(small))
        self.back = nn.Linear(big, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.back(self.trunk(self.proj(x)))
        for layer in self.small:
            y = layer(y)
        return y


def build_stack(layers: int = 8, width: int = 16) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """CLI factory: a Stack and an example input."""
    return Stack(layers, width), (torch.randn(2, width),)


def build_stack_without_inputs(layers: int = 8) -> nn.Module:
    """CLI factory returning only a module."""
    return Stack(layers)
