"""mp_memory.offload in one process: what is offloaded (the checkpointed modules' inputs, nothing else),
when each microbatch is loaded back (exactly ``horizon`` backward tasks ahead, under a GPipe and a 1F1B
order), and gradients equal to plain PyTorch. The CUDA path (side stream, pinned host memory) runs where
a GPU is present and is skipped elsewhere."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from mp_memory import activation, offload

BLOCKS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        x = x * 2.0
        for b in self.blocks:
            x = activation.checkpoint_module(b, x) if checkpointed else b(x)
        return x.square().mean()


class Driver:
    """Runs microbatch forwards and backwards in a given order under an Offloader."""

    def __init__(self, horizon: int, device: str = "cpu") -> None:
        self.key: tuple[int, int] | None = None
        self.offloader = offload.Offloader(horizon, lambda: self.key)
        torch.manual_seed(0)
        self.net = Net().to(device)
        self.inputs = [
            torch.randn(4, 8, generator=torch.Generator().manual_seed(m)).to(device) for m in range(8)
        ]
        self.losses: dict[int, torch.Tensor] = {}

    def run(self, order: list[str], step: int = 0) -> None:
        for task in order:
            mb = int(task[1:])
            self.key = (step, mb)
            if task[0] == "F":
                self.losses[mb] = self.net(self.inputs[mb], checkpointed=True)
            else:
                self.losses.pop(mb).backward()
        self.key = None

    def reference_grads(self, mbs: int) -> list[torch.Tensor]:
        ref = Net().to(self.inputs[0].device)
        ref.load_state_dict(self.net.state_dict())
        for mb in range(mbs):
            ref(self.inputs[mb], checkpointed=False).backward()
        return [p.grad for p in ref.parameters()]  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _no_offloader_left() -> Iterator[None]:
    yield
    offload.activate(None)


def _gpipe(n: int) -> list[str]:
    return [f"F{m}" for m in range(n)] + [f"B{m}" for m in range(n)]


def _one_f_one_b(n: int, active: int) -> list[str]:
    order = [f"F{m}" for m in range(active)]
    for m in range(n):
        order.append(f"B{m}")
        if m + active < n:
            order.append(f"F{m + active}")
    return order


def _check_grads(d: Driver, mbs: int) -> None:
    for (name, p), ref in zip(d.net.named_parameters(), d.reference_grads(mbs), strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_gpipe_order_loads_exactly_horizon_tasks_ahead() -> None:
    d = Driver(horizon=2)
    offload.activate(d.offloader)
    d.run(_gpipe(6))
    expected = [("offload", m) for m in range(6) for _ in range(BLOCKS)]
    expected += [("backward", 0), ("load", 0), ("load", 1), ("load", 2)]
    for m in range(1, 6):
        expected += [("backward", m)] + ([("load", m + 2)] if m + 2 < 6 else [])
    assert d.offloader.events == expected
    assert d.offloader.offloaded_bytes == 6 * BLOCKS * 4 * 8 * 4  # each block's input: 4 x 8 fp32
    _check_grads(d, 6)


def test_1f1b_order_keeps_what_is_already_due() -> None:
    d = Driver(horizon=1)
    offload.activate(d.offloader)
    d.run(_one_f_one_b(6, active=3))
    ev = d.offloader.events
    # load k is issued right when backward k - 1 starts (k >= 1); loads 0 and 1 at backward 0
    for k in range(6):
        i = ev.index(("load", k))
        last_backward = next(e for e in reversed(ev[:i]) if e[0] == "backward")
        assert last_backward == ("backward", max(0, k - 1)), (k, ev)
        if k:  # microbatch 0 is loaded when its own backward starts: nothing runs before it
            assert i < ev.index(("backward", k))
    assert [e for e in ev if e[0] == "keep"] == []  # every forward ran before its load came due
    _check_grads(d, 6)


def test_forward_after_its_load_is_due_keeps_the_tensor_on_its_device() -> None:
    d = Driver(horizon=1)
    offload.activate(d.offloader)
    d.run(["F0", "B0", "F1", "B1", "F2", "F3", "B2", "B3"])  # one process, microbatch after microbatch
    ev = d.offloader.events
    assert ev.count(("offload", 0)) == BLOCKS and ev.count(("keep", 1)) == BLOCKS  # 1 came due at B0
    assert ev.count(("keep", 2)) == BLOCKS and ev.count(("offload", 3)) == BLOCKS  # 3 only at B2
    _check_grads(d, 4)


def test_offloaded_input_is_released_and_only_inside_a_task() -> None:
    d = Driver(horizon=1)
    offload.activate(d.offloader)
    alive = []
    for key in (None, (0, 0)):
        d.key = key
        x = d.inputs[0] * 2.0  # mul by a scalar keeps nothing: only the checkpoint keeps x
        y = activation.checkpoint_module(d.net.blocks[0], x)
        ref = weakref.ref(x)
        del x
        gc.collect()
        alive.append(ref() is not None)  # between forward and backward
        y.sum().backward()
    # outside a task (key None) the checkpoint keeps its input on the device; inside, only a host copy
    assert alive == [True, False]
    assert d.offloader.events == [("offload", 0), ("backward", 0), ("load", 0)]


def test_parameters_are_never_offloaded() -> None:
    d = Driver(horizon=1)
    offload.activate(d.offloader)
    d.key = (0, 0)
    w = nn.Parameter(torch.randn(3, 3))
    activation.checkpoint_module(lambda t: t.exp(), w).sum().backward()
    assert d.offloader.events == [] and w.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (side stream, pinned host memory)")
def test_cuda_offload_to_pinned_host_and_load_on_a_side_stream() -> None:
    d = Driver(horizon=2, device="cuda")
    offload.activate(d.offloader)
    seen: list[torch.Tensor] = []
    original = d.offloader._to_host

    def spy(t: torch.Tensor, mb: int) -> offload._Packed:
        p = original(t, mb)
        assert p.host is not None
        seen.append(p.host)
        return p

    d.offloader._to_host = spy  # type: ignore[method-assign]
    d.run(_gpipe(6))
    assert seen and all(h.device.type == "cpu" and h.is_pinned() for h in seen)
    assert ("load", 5) in d.offloader.events
    _check_grads(d, 6)
