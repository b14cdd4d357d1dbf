"""mp_memory's loss scalers and fp32-master optimizer in one process (with mp-memory alone installed;
smp's loss-scaling arguments refused under fp32 are tested in tests/integration/test_memory_precision.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mp_memory.errors import PrecisionError
from mp_memory.loss_scaler import DynamicLossScaler, LossScaler, make_loss_scaler
from mp_memory.precision import Bit16Optimizer, cast_floats, has_overflow


# ---------------------------------------------------------------------------------- loss scalers
def _scales(scaler: LossScaler, overflows: str) -> list[float]:
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.loss_scale)
    return out


def test_dynamic_scaler_halves_on_overflow_and_doubles_after_a_window() -> None:
    s = DynamicLossScaler(init_scale=2.0**10, scale_window=3, min_scale=2.0**8)
    # DeepSpeed's rule: grow when (iter - last_overflow) % window == 0
    assert _scales(s, "..x...xxxx") == [2**10, 2**10, 2**9, 2**9, 2**9, 2**10, 2**9, 2**8, 2**8, 2**8]


def test_delayed_shift_tolerates_overflows_before_lowering() -> None:
    s = DynamicLossScaler(init_scale=64.0, scale_window=100, delayed_shift=2)
    assert _scales(s, "xxx") == [64, 32, 16]  # the first overflow uses up the hysteresis
    c = DynamicLossScaler(init_scale=64.0, scale_window=100, delayed_shift=2, consecutive_hysteresis=True)
    assert _scales(c, "x.x.x") == [64, 64, 64, 64, 64]  # a good step refills it


def test_static_scaler_never_changes_and_the_factory_follows_smp_arguments() -> None:
    assert _scales(LossScaler(128.0), "x.x") == [128, 128, 128]
    assert isinstance(make_loss_scaler(None, True, {"init_scale": 2.0**16}), DynamicLossScaler)
    assert make_loss_scaler(None, True, {}).loss_scale == 2.0**32  # smp's default init_scale
    assert make_loss_scaler(None, False, {}).loss_scale == 1.0
    with pytest.raises(PrecisionError, match="init_scal"):
        make_loss_scaler(None, True, {"init_scal": 2.0})
    with pytest.raises(PrecisionError, match="dynamic_loss_scale=True"):
        make_loss_scaler(None, False, {"scale_window": 10})
    with pytest.raises(PrecisionError, match="scale_factor"):
        DynamicLossScaler(scale_factor=1.0)


def test_scaler_state_round_trips() -> None:
    s = DynamicLossScaler(init_scale=2.0**10, scale_window=2)
    _scales(s, ".x.")
    t = DynamicLossScaler(init_scale=2.0**10, scale_window=2)
    t.load_state_dict(s.state_dict())
    assert _scales(s, "..x.") == _scales(t, "..x.")


# ------------------------------------------------------------------------------ fp32 masters
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _by_hand(dtype: torch.dtype, scale: float, steps: int) -> dict[str, torch.Tensor]:
    """The recipe written out: half model, fp32 copies stepped by AdamW, gradients unscaled."""
    torch.manual_seed(0)
    model = MLP().to(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    for s in range(steps):
        x, y = _data(s)
        model.zero_grad()
        (F.mse_loss(model(x.to(dtype)).float(), y) * scale).backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            assert p.grad is not None
            m.grad = p.grad.float() / scale
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
    return {f"m{i}": m.detach() for i, m in enumerate(masters)}


@pytest.mark.parametrize(("dtype", "check"), [(torch.float16, True), (torch.bfloat16, False)])
def test_bit16_optimizer_equals_the_recipe_by_hand(dtype: torch.dtype, check: bool) -> None:
    scale = 1024.0 if check else 1.0
    torch.manual_seed(0)
    model = MLP().to(dtype)
    opt = Bit16Optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), LossScaler(scale), check_overflow=check
    )
    opt.make_masters()
    assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
    for s in range(3):
        x, y = _data(s)
        opt.zero_grad()
        (F.mse_loss(model(x.to(dtype)).float(), y) * opt.loss_scale).backward()
        opt.step()
        assert not opt.overflow
    want = _by_hand(dtype, scale, 3)
    got = [m for _, m in opt.pairs()]
    for i, m in enumerate(got):
        assert torch.equal(m.detach(), want[f"m{i}"]), i
    for p, m in opt.pairs():
        assert p.dtype == dtype and torch.equal(p.detach(), m.detach().to(dtype))
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values() if v.dim() > 0)


def test_an_overflow_skips_the_step_and_lowers_the_scale() -> None:
    torch.manual_seed(0)
    model = MLP().half()
    opt = Bit16Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), DynamicLossScaler(init_scale=2.0**8, scale_window=5)
    )
    opt.make_masters()
    x, y = _data(0)
    (F.mse_loss(model(x.half()).float(), y) * opt.loss_scale).backward()
    assert model.fc1.weight.grad is not None
    model.fc1.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.overflow and opt.loss_scale == 2.0**7
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    (F.mse_loss(model(x.half()).float(), y) * opt.loss_scale).backward()
    opt.step()
    assert not opt.overflow and not all(
        torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
    )


def test_cast_floats_keeps_structure_and_non_floats() -> None:
    ids = torch.arange(3)
    out = cast_floats({"x": (torch.ones(2), ids), "n": None, "k": [torch.zeros(1)]}, torch.float16)
    assert out["x"][0].dtype == torch.float16 and out["x"][1] is ids and out["n"] is None
    assert out["k"][0].dtype == torch.float16
    assert has_overflow([torch.ones(2), torch.tensor([float("nan")])]) and not has_overflow([torch.ones(2)])
