"""smp.checkpoint and smp.checkpoint_sequential on real worlds: training equals plain single-process
PyTorch (loss of every step and every parameter after 3 SGD steps, rtol 1e-5), and every checkpointed
block is recomputed in backward on the rank that owns it (its activations were not kept).

The model calls the blocks from its own forward: through smp.checkpoint one by one, or through
smp.checkpoint_sequential with a strategy. At pp=2 blocks 2 and 3 live on pp_rank 1: pp_rank 0 calls them
remotely and pp_rank 1 recomputes them. The bytes saved are measured in tests/mp_memory/test_activation.py
(saved-tensor hooks see only this thread; pp_rank 1 runs its modules in server threads).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp.errors import CheckpointingConfigError
from mp_partition import set_partition

STEPS, MICROBATCHES = 3, 2
PP2 = {
    "pipeline_parallel_degree": 2,
    "microbatches": MICROBATCHES,
    "auto_partition": False,
    "default_partition": 0,
}


class Block(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.down(torch.tanh(self.up(x)))


class Deep(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(Block(), Block(), Block(), Block())
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.how == "plain":
            x = self.blocks(x)
        elif self.how == "checkpoint":
            for block in self.blocks:
                x = smp.checkpoint(block, x)
        else:
            x = smp.checkpoint_sequential(self.blocks, x, strategy=self.how)
        return self.out(x)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    net = Deep("plain")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for s in range(STEPS):
        x, y = _data(s)
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            loss = F.mse_loss(net(xs), ys)
            (loss / MICROBATCHES).backward()
            total += loss.item() / MICROBATCHES
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    if a.keys() != b.keys():
        return f"keys differ: {sorted(a.keys() ^ b.keys())}"
    for k, value in a.items():
        if not torch.allclose(value, b[k], rtol=1e-5, atol=1e-6):
            return f"{k}: max |diff| {(value - b[k]).abs().max().item()}"
    return None


def _train(world: Any, config: dict[str, Any], how: str) -> dict[str, Any]:
    smp.init(config)
    torch.manual_seed(0)
    net = Deep(how)
    if config.get("pipeline_parallel_degree", 1) > 1:
        for m in (net.blocks[2], net.blocks[3], net.out):
            set_partition(m, 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for s in range(STEPS):
        x, y = _data(s)
        opt.zero_grad()
        Block.calls = 0
        losses.append(train_step(x, y).reduce_mean().item())
        opt.step()
    calls = Block.calls  # of the last step
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_losses, ref_params = _reference()
    return {
        "rank": smp.rank(),
        "pp_rank": smp.pp_rank(),
        "loss_ok": all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(losses, ref_losses, strict=True)),
        "losses": (losses, ref_losses),
        "difference": _first_difference(params, ref_params),
        "calls": calls,
    }


HOWS = ["checkpoint", "each", "group_2", "contiguous"]


@pytest.mark.parametrize("how", HOWS)
def test_pp1_equals_torch_and_recomputes(worlds: Any, how: str) -> None:
    (r,) = worlds.run(1, _train, {"microbatches": MICROBATCHES}, how, timeout=60)
    assert r["loss_ok"] and r["difference"] is None, r
    assert r["calls"] == 2 * 4 * MICROBATCHES, r  # 4 blocks per microbatch, each run again in backward


@pytest.mark.parametrize("how", HOWS)
def test_pp2_equals_torch_and_recomputes_on_the_owner(worlds: Any, how: str) -> None:
    for r in worlds.run(2, _train, PP2, how, timeout=120):
        assert r["loss_ok"] and r["difference"] is None, r
        # each rank owns 2 blocks: 2 forwards per microbatch, and 2 recomputations on the owner
        assert r["calls"] == 2 * 2 * MICROBATCHES, r


def test_pp2_plain_does_not_recompute(worlds: Any) -> None:
    for r in worlds.run(2, _train, PP2, "plain", timeout=120):
        assert r["difference"] is None and r["calls"] == 2 * MICROBATCHES, r


def _errors(world: Any) -> list[str]:
    smp.init({})
    out = []
    for call in (
        lambda: smp.checkpoint(torch.tanh, torch.zeros(2)),  # type: ignore[arg-type]
        lambda: smp.checkpoint_sequential(Block(), torch.zeros(2, 16)),  # type: ignore[arg-type]
        lambda: smp.checkpoint_sequential(nn.Sequential(Block()), torch.zeros(2, 16), strategy="pairs"),
    ):
        with pytest.raises(CheckpointingConfigError) as info:
            call()
        out.append(str(info.value))
    return out


def test_argument_errors_name_what_was_passed(worlds: Any) -> None:
    (out,) = worlds.run(1, _errors, timeout=60)
    assert "got builtin_function_or_method" in out[0] and "nn.Module" in out[0]
    assert "got Block" in out[1]
    assert "'pairs'" in out[2] and "group_<k>" in out[2]


def test_smp_checkpoint_is_the_call_and_save_load_still_work() -> None:
    import mp.checkpoint as _  # noqa: F401  (the save/load module stays importable)

    assert callable(smp.checkpoint) and smp.checkpoint.__module__ == "mp.activation_checkpointing"
    assert smp.save.__module__ == smp.load.__module__ == "mp.checkpoint"
