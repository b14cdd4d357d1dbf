"""mp_memory.delayed_init in one process: parameters built on meta take no memory, materialize keeps the
parameter objects, initializes with each module's own init and only what it is told to keep."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mp_memory.delayed_init import DelayedInitError, has_meta_parameters, materialize, parameters_on_meta


class Scaled(nn.Module):
    """A module with parameters created constant and no reset_parameters (like a hand-made norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.shift = nn.Parameter(torch.zeros(4))
        self.register_buffer("mask", torch.arange(4.0))  # computed in __init__: stays real

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.shift + self.mask


def test_parameters_on_meta_then_materialized_in_place() -> None:
    with parameters_on_meta():
        net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4), Scaled())
    assert all(p.is_meta for p in net.parameters()) and not net[3].mask.is_meta
    before = list(net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    n = materialize(net, lambda p: True)
    assert n == sum(p.numel() for p in net.parameters())
    assert all(a is b for a, b in zip(before, net.parameters(), strict=True))  # the optimizer's objects
    assert not has_meta_parameters(net) and opt.param_groups[0]["params"][0] is net[0].weight
    assert torch.equal(net[1].weight, torch.ones(8)) and torch.equal(net[1].bias, torch.zeros(8))
    assert torch.equal(net[3].gain, torch.ones(4)) and torch.equal(net[3].shift, torch.zeros(4))
    bound = 1 / 4**0.5  # nn.Linear's reset_parameters: uniform within 1/sqrt(fan_in)
    assert net[0].weight.abs().max() <= bound and net[0].weight.std() > bound / 4
    net(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_only_kept_parameters_get_memory() -> None:
    with parameters_on_meta():
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    keep = {id(p) for p in net[1].parameters()}
    materialize(net, lambda p: id(p) in keep)
    assert all(p.is_meta for p in net[0].parameters())
    assert not any(p.is_meta for p in net[1].parameters())


def test_hf_models_use_their_init_weights() -> None:
    transformers = pytest.importorskip("transformers")  # not a dependency of mp-memory alone
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=16)
    with parameters_on_meta():
        model = GPT2LMHeadModel(config)
    assert has_meta_parameters(model)
    materialize(model, lambda p: True)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay tied
    std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(std - config.initializer_range) < 0.002, std  # HF's normal(0, 0.02), not Conv1D's own
    # HF's rule on the parents (GPT2Attention, GPT2MLP), run after their children's as HF does: the
    # residual projections scaled by 1/sqrt(2 n_layer)
    scaled = config.initializer_range / (2 * config.n_layer) ** 0.5
    for proj in (model.transformer.h[0].attn.c_proj, model.transformer.h[1].mlp.c_proj):
        assert abs(proj.weight.std().item() - scaled) < 0.002, proj.weight.std()
    assert torch.equal(model.transformer.h[0].ln_1.weight, torch.ones(64))
    ids = torch.randint(0, 128, (2, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_a_parameter_nothing_can_initialize_is_named() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

    with parameters_on_meta():
        net = nn.Sequential(Odd())
    with pytest.raises(DelayedInitError, match=r"'0' \(Odd\).*reset_parameters"):
        materialize(net, lambda p: True)
