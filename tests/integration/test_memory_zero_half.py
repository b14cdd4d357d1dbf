"""shard_optimizer_state (ZeRO-1) together with fp16 and bf16 on 2 data-parallel ranks:
ZeroRedundancyOptimizer steps the fp32 master weights, each rank keeping the state of its share. Training
equals the same mixed-precision run without sharding (whose equality with a single-process recipe is
tests/integration/test_memory_precision.py): the same losses, loss scales, skipped steps (an inf forced
on one rank's gradient skips that step on both) and fp32 masters after every step, bitwise; the optimizer
state per rank is about half; the partial optimizer state round-trips bitwise and the full one is refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp.errors import SMPCheckpointError

STEPS, ROWS, OVERFLOW_STEP = 5, 8, 2
SCALING = {"init_scale": 2.0**12, "scale_window": 2}


def _net() -> nn.Module:
    torch.manual_seed(0)
    widths = (16, 32, 32, 32, 16)  # tensors of similar sizes: whole tensors split evenly over 2 ranks
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 4))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * ROWS, 16, generator=g), torch.randn(2 * ROWS, 4, generator=g)


def _run(precision: str, shard: bool) -> dict[str, Any]:
    smp.init({"microbatches": 2, precision: True, "shard_optimizer_state": shard})
    try:
        model = smp.DistributedModel(_net())
        extra = {"dynamic_loss_scale": True, "dynamic_loss_args": SCALING} if precision == "fp16" else {}
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **extra)
        names = {id(p): n for n, p in model.named_parameters()}

        @smp.step
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        mine = slice(smp.dp_rank() * ROWS, (smp.dp_rank() + 1) * ROWS)

        def step(s: int) -> tuple[float, float, bool]:
            x, y = _data(s)
            opt.zero_grad()
            loss = train_step(x[mine].half() if precision == "fp16" else x[mine], y[mine]).reduce_mean()
            if precision == "fp16" and s == OVERFLOW_STEP and smp.dp_rank() == 1:
                next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            scale = float(opt.loss_scale)
            opt.step()
            return float(loss), scale, bool(opt.overflow)

        def masters() -> dict[str, torch.Tensor]:
            return {names[id(p)]: m.detach().clone() for p, m in opt.pairs()}

        trace, after = [], []
        saved: dict[str, Any] = {}
        for s in range(STEPS):
            trace.append(step(s))
            after.append(masters())
            if s == 1:
                saved = opt.local_state_dict()
        opt.load_state_dict(saved)  # back to step 2's state (masters, moments, scale), then again
        again = []
        for s in range(2, STEPS):
            step(s)
            again.append(masters())
        report = smp.memory_report()
        state_bytes = report.optimizer_state - sum(m.numel() * 4 for m in after[-1].values())
        refused = None
        try:
            opt.state_dict()
        except SMPCheckpointError as exc:
            refused = str(exc)
        return {
            "trace": trace,
            "after": after,
            "again_equal": all(
                all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(again, after[2:], strict=True)
            ),
            "state_bytes": state_bytes,
            "refused": refused,
        }
    finally:
        smp.reset()


def _both(world: Any, precision: str) -> dict[str, Any]:
    return {"plain": _run(precision, shard=False), "sharded": _run(precision, shard=True)}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_zero1_with_half_precision_equals_unsharded(worlds: Any, precision: str) -> None:
    results = worlds.run(2, _both, precision, timeout=300)
    for rank, r in enumerate(results):
        plain, sharded = r["plain"], r["sharded"]
        assert sharded["trace"] == plain["trace"], (rank, sharded["trace"], plain["trace"])
        if precision == "fp16":  # the forced overflow skipped the step on both ranks
            assert [t[2] for t in plain["trace"]][OVERFLOW_STEP], plain["trace"]
        for s, (a, b) in enumerate(zip(sharded["after"], plain["after"], strict=True)):
            for k, v in b.items():
                assert torch.equal(a[k], v), f"rank {rank} step {s} master {k}: {(a[k] - v).abs().max()}"
        assert sharded["again_equal"] and plain["again_equal"], rank
        assert sharded["refused"] is not None and plain["refused"] is None, r
    # each rank keeps the moments of its share: half of the unsharded state (+5%: whole tensors move)
    total = results[0]["plain"]["state_bytes"]
    shares = [r["sharded"]["state_bytes"] for r in results]
    assert sum(shares) == total and max(shares) <= total * (0.5 + 0.05) + 8, (shares, total)
