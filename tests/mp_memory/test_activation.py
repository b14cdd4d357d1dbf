"""mp_memory.activation in one process: the same loss and gradients as without checkpointing (dropout
included), fewer saved activation bytes, the strategies' segments, and the argument errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mp_memory import activation
from mp_memory.errors import CheckpointArgumentError


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.down(self.drop(torch.tanh(self.up(x))))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(4)))


def _run(forward: Callable[[nn.Sequential, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """Loss, gradients, bytes saved for backward and block calls of one training step."""
    net = _net()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    torch.manual_seed(2)  # dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(net, x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    assert x.grad is not None
    calls = [b.calls for b in net if isinstance(b, Block)]
    return {"loss": loss.item(), "grads": grads, "x_grad": x.grad, "saved": saved, "calls": calls}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["loss"] == b["loss"]
    assert torch.equal(a["x_grad"], b["x_grad"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name


PLAIN = _run(lambda net, x: net(x))


@pytest.mark.parametrize("strategy", ["each", "group_2", "group_3", "contiguous"])
def test_checkpoint_sequential_equals_plain_and_saves_less(strategy: str) -> None:
    ckpt = _run(lambda net, x: activation.checkpoint_sequential(net, x, strategy))
    _assert_same(PLAIN, ckpt)  # bitwise: the recomputation replays the dropout RNG
    assert ckpt["saved"] < PLAIN["saved"] / 3, (ckpt["saved"], PLAIN["saved"])
    assert ckpt["calls"] == [2, 2, 2, 2]  # every block ran again in backward


def test_checkpoint_of_one_module_call() -> None:
    def forward(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for block in net:
            x = activation.checkpoint_module(block, x)
        return x

    ckpt = _run(forward)
    _assert_same(PLAIN, ckpt)
    assert ckpt["saved"] < PLAIN["saved"] / 3


def test_without_preserved_rng_dropout_differs() -> None:
    # the recomputation draws new masks: the gradients no longer match the forward (why it is the default)
    ckpt = _run(lambda net, x: activation.checkpoint_sequential(net, x, "each", preserve_rng_state=False))
    assert ckpt["loss"] == PLAIN["loss"]
    assert not torch.equal(ckpt["x_grad"], PLAIN["x_grad"])


def test_marks_checkpoint_every_later_call_and_group_segments() -> None:
    def forward(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        activation.mark_sequential(net, "", "group_2", True)
        return net(x)

    ckpt = _run(forward)
    _assert_same(PLAIN, ckpt)
    assert ckpt["calls"] == [2, 2, 2, 2]  # the children of a segment do not nest their own checkpoint
    assert ckpt["saved"] < PLAIN["saved"] / 3


def test_segments_follow_the_strategy_and_never_mix_owners() -> None:
    assert activation.segments("each", 3) == [[0], [1], [2]]
    assert activation.segments("group_2", 5) == [[0, 1], [2, 3], [4]]
    assert activation.segments("contiguous", 4) == [[0, 1, 2, 3]]
    owner = [0, 0, 1, 1, 1].__getitem__
    assert activation.segments("contiguous", 5, owner) == [[0, 1], [2, 3, 4]]
    assert activation.segments("group_3", 5, owner) == [[0, 1], [2, 3, 4]]


def test_pack_args_as_tuple() -> None:
    class Pair(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a * b, a + b

    class Packed(nn.Module):
        def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            return ab[0] * ab[1], ab[0] + ab[1]

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    spread = activation.checkpoint_sequential(nn.Sequential(Pair(), Pair()), (a, b), "group_2")
    packed = activation.checkpoint_sequential(
        nn.Sequential(Packed(), Packed()), (a, b), "each", pack_args_as_tuple=True
    )
    expected = Pair()(*Pair()(a, b))
    for got in (spread, packed):
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    sum(spread).sum().backward()


@pytest.mark.parametrize("strategy", ["pairs", "group_0", "group_", "group_x", ""])
def test_bad_strategies_name_the_value(strategy: str) -> None:
    with pytest.raises(CheckpointArgumentError, match="group_<k>") as info:
        activation.checkpoint_sequential(_net(), torch.zeros(1, 32), strategy)
    assert repr(strategy) in str(info.value)


def test_checkpoint_sequential_needs_a_sequential() -> None:
    with pytest.raises(CheckpointArgumentError, match="Block"):
        activation.checkpoint_sequential(Block(), torch.zeros(1, 32))  # type: ignore[arg-type]
