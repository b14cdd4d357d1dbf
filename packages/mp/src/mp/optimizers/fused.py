"""apex's FusedAdam signature on ``torch.optim.Adam`` (fused kernels where torch has them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from mp.errors import SMPUnsupportedError, SMPValidationError

__all__ = ["FusedAdam", "FusedNovoGrad", "fused_supported"]


def fused_supported(params: Iterable[Any]) -> bool:
    """Whether torch's fused Adam kernel takes every parameter (floating point, on a device it covers)."""
    devices = set(_get_fused_kernels_supported_devices())
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    return bool(tensors) and all(p.is_floating_point() and p.device.type in devices for p in tensors)


def _flat(params: Any) -> list[Any]:
    out: list[Any] = []
    for item in params:
        if isinstance(item, dict):
            out += list(item["params"]) if not isinstance(item["params"], torch.Tensor) else [item["params"]]
        else:
            out.append(item)
    return out


class FusedAdam(torch.optim.Adam):
    """``smp.optimizers.FusedAdam`` (apex's arguments): Adam, or AdamW with ``adam_w_mode=True`` (the
    default), on torch's fused kernel where the parameters' device has one, otherwise torch's foreach
    implementation. ``zero_grad()`` sets gradients to None unless ``set_grad_none=False``."""

    def __init__(  # noqa: PLR0917  (apex's positional signature)
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise SMPUnsupportedError(
                "FusedAdam(amsgrad=True): apex's FusedAdam has no AMSGrad variant and neither does "
                "smp's. Expected amsgrad=False. Fix: use torch.optim.Adam(params, amsgrad=True)"
            )
        if not bias_correction:
            raise SMPValidationError(
                "FusedAdam(bias_correction=False): torch's Adam always corrects the moments' bias, so "
                "mp cannot build this variant on it. Expected bias_correction=True. Fix: remove the "
                "argument (or keep apex for this optimizer)"
            )
        params = list(params)
        fused = fused_supported(_flat(params))
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
            fused=True if fused else None,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class FusedNovoGrad:
    """``smp.optimizers.FusedNovoGrad``: not built in mp (torch has no NovoGrad); constructing it raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(
            "smp.optimizers.FusedNovoGrad is not built in mp: torch has no NovoGrad and mp does not "
            "implement one. Expected FusedAdam or FusedLAMB. Fix: use smp.optimizers.FusedLAMB (also "
            "layer-wise adaptive) or smp.optimizers.FusedAdam, or a NovoGrad implementation of your "
            "own wrapped in smp.DistributedOptimizer"
        )
