"""smp's fp16 loss-scaling arguments: refused with a clear error while mp does not build fp16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mp as smp

REFUSED: list[dict[str, Any]] = [
    {"dynamic_loss_scale": True},
    {"static_loss_scale": 128.0},
    {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**16}},
    {"scale_window": 500},
]


def _loss_scaling(world: Any) -> list[str]:
    smp.init({})
    model = smp.DistributedModel(nn.Linear(2, 2))
    messages = []
    for kwargs in REFUSED:
        with pytest.raises(smp.SMPValidationError) as info:
            smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        messages.append(str(info.value))
    # the defaults (and static_loss_scale=None, smp's "no static scale") still work
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=None)
    with (
        pytest.raises(smp.SMPUnsupportedError, match="delayed parameter initialization"),
        smp.delay_param_initialization(),
    ):
        pass
    with smp.delay_param_initialization(enabled=False):
        pass
    return messages


def test_loss_scaling_arguments_are_refused_while_fp16_is_not_built(worlds: Any) -> None:
    for messages in worlds.run(2, _loss_scaling, timeout=120):
        for kwargs, message in zip(REFUSED, messages, strict=True):
            assert "fp16 loss scaling" in message and "mp does not build yet" in message, message
            for key in kwargs:
                if key != "dynamic_loss_args":
                    assert key in message, (key, message)
