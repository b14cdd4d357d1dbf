"""smp.nn's non-distributed members: scripts written against smp's (apex's) FusedLayerNorm run unchanged."""

from __future__ import annotations

import torch
from torch import nn

import mp as smp


def test_fused_layer_norm_is_torchs_layer_norm_with_apexs_arguments() -> None:
    fused = smp.nn.FusedLayerNorm(8, eps=1e-6, elementwise_affine=True)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5)
        fused.bias.uniform_(-0.5, 0.5)
    plain = nn.LayerNorm(8, eps=1e-6)
    plain.load_state_dict(fused.state_dict())  # apex's parameter names: weight, bias
    x = torch.randn(3, 5, 8, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    torch.testing.assert_close(fused(x), plain(y), rtol=0, atol=0)
    fused(x).square().sum().backward()
    plain(y).square().sum().backward()
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    assert isinstance(fused, nn.LayerNorm) and list(fused.state_dict()) == ["weight", "bias"]
