"""`smp.DistributedOptimizer`: the user's optimizer, made to step only this rank's parameters.

As in smp's implementation, it returns the same optimizer object (so LR schedulers and
``isinstance`` checks keep working), registered with mp and given ``local_state_dict``. Once the model
is partitioned its parameter groups keep only the parameters this rank holds; this works whether the
optimizer was built before or after ``smp.DistributedModel``, on the raw or the wrapped model's
parameters.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from mp.errors import SMPValidationError
from mp.state import state

__all__ = ["DistributedOptimizer", "keep_local_parameters"]


def keep_local_parameters(optimizer: torch.optim.Optimizer, is_remote: Any) -> None:
    """Drop the parameters ``is_remote(p)`` says another rank holds from every parameter group."""
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if not is_remote(p)]
        for p in group["params"]:
            if is_remote(p):
                optimizer.state.pop(p, None)
        group["params"] = kept


def _local_state_dict(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> dict[str, Any]:
    sd = dict(self.state_dict())
    sd["_smp_is_partial"] = True
    return sd


def _load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    sd = dict(state_dict)
    partial = bool(sd.pop("_smp_is_partial", False))
    model = state.model
    if partial and model is not None and not model.partitioned and model._pp > 1:
        model._pending_optimizer_state = sd  # applied once the optimizer keeps only local params
        return
    torch.optim.Optimizer.load_state_dict(self, sd)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    static_loss_scale: float | None = 1.0,
    dynamic_loss_scale: bool = False,
    **dynamic_loss_args: Any,
) -> torch.optim.Optimizer:
    """Register ``optimizer`` with mp and return it (see the module docstring). The loss-scale
    arguments only matter with fp16, which the mixed-precision package handles."""
    state.require()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SMPValidationError(
            f"smp.DistributedOptimizer needs a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    optimizer.local_state_dict = types.MethodType(_local_state_dict, optimizer)  # type: ignore[attr-defined]
    optimizer.load_state_dict = types.MethodType(_load_state_dict, optimizer)  # type: ignore[method-assign]
    state.optimizer = optimizer
    model = state.model
    if model is not None and model.partitioned:
        keep_local_parameters(optimizer, model._is_remote)
    return optimizer
