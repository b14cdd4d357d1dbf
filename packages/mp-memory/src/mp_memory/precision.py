"""Half-precision training with fp32 master weights (smp's fp16/bf16, after DeepSpeed's FP16 optimizer).

The model's parameters are fp16 or bf16; forward and backward run in that dtype. :class:`Bit16Optimizer`
keeps an fp32 copy (the master) of every half parameter and runs the user's optimizer on the masters:

1. the loss is multiplied by the loss scale before backward (fp16; the caller does it, e.g.
   ``model.backward``), so that small gradients do not flush to zero in fp16;
2. :meth:`Bit16Optimizer.prepare_grads` checks the half gradients for inf/NaN (the verdict agreed over
   all ranks by ``agree``), and without an overflow sets each master's gradient to the half gradient in
   fp32 divided by the scale;
3. :meth:`Bit16Optimizer.step` skips the step on an overflow, else steps the masters and copies them
   back into the half parameters; the loss scaler then updates its scale.

Parameters already in fp32 are their own masters. The optimizer's state (Adam's moments) is kept for the
masters, in fp32. bf16 has fp32's exponent range: no loss scaling and no overflow check (scale 1).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mp_memory.errors import PrecisionError
from mp_memory.loss_scaler import LossScaler

__all__ = ["HALF_DTYPES", "Bit16Optimizer", "cast_floats", "has_overflow"]

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(cast_floats(v, dtype) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(cast_floats(v, dtype) for v in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, HF ModelOutput)
        for k, v in obj.items():
            out[k] = cast_floats(v, dtype)
        return out
    return obj


def has_overflow(tensors: list[torch.Tensor]) -> bool:
    """Whether any tensor holds an inf or NaN (of a sharded ``DTensor``, this rank's shard only: the
    caller agrees on the verdict over the ranks)."""
    if not tensors:
        return False
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return bool(torch.stack([(~torch.isfinite(t)).any() for t in local]).any())


class Bit16Optimizer:
    """The user's optimizer, run on fp32 masters of half-precision parameters (module docstring).

    ``agree(flag)`` turns this rank's overflow flag into the job's (an all-reduce); ``check_overflow``
    is off for bf16. Masters are made by :meth:`make_masters`, once the parameter groups hold only the
    parameters this rank keeps (the caller decides when: after partitioning)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_scaler: LossScaler,
        *,
        agree: Callable[[bool], bool] = lambda flag: flag,
        check_overflow: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PrecisionError(
                f"Bit16Optimizer needs a torch.optim.Optimizer; got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.overflow = False
        """Whether the last step (or the gradients prepared for the next one) overflowed."""
        self._agree = agree
        self._check = check_overflow
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._grads_ready = False

    # -- the optimizer's face ------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def masters_ready(self) -> bool:
        return self._pairs is not None

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its fp32 master) for every parameter this optimizer steps."""
        if self._pairs is None:
            raise PrecisionError("the fp32 master weights are not made yet (make_masters)")
        return self._pairs

    def make_masters(self) -> None:
        """Replace every half parameter in the groups by an fp32 master copy (its state moved along)."""
        if self._pairs is not None:
            return
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype in (torch.float16, torch.bfloat16):
                    m = torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                    if p in state:
                        state[m] = {
                            k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                            for k, v in state.pop(p).items()
                        }
                else:
                    m = p
                pairs.append((p, m))
                masters.append(m)
            group["params"] = masters
        self._pairs = pairs

    # -- a step --------------------------------------------------------------------------------------
    def prepare_grads(self) -> bool:
        """Check for an overflow and, without one, set the masters' unscaled fp32 gradients (once per
        step). Returns whether the step overflowed."""
        if self._grads_ready:
            return self.overflow
        pairs = self.pairs()
        grads = [p.grad for p, _ in pairs if p.grad is not None]
        local = self._check and has_overflow(grads)
        self.overflow = self._agree(local) if self._check else False
        if not self.overflow:
            inv = 1.0 / self.loss_scaler.loss_scale
            for p, m in pairs:
                if p.grad is None:
                    m.grad = None
                elif m is p:
                    if inv != 1.0:
                        p.grad.mul_(inv)
                else:
                    g = p.grad.detach().float()
                    m.grad = g.mul_(inv) if inv != 1.0 else g
        self._grads_ready = True
        return self.overflow

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters and copy them into the half parameters, or skip the step on an overflow;
        then update the loss scale."""
        if closure is not None:
            raise PrecisionError(
                "the fp16/bf16 optimizer takes no closure (its loss would need scaling); call step()"
            )
        overflow = self.prepare_grads()
        if not overflow:
            self.optimizer.step()
            with torch.no_grad():
                for p, m in self.pairs():
                    if m is not p:
                        p.copy_(m)
        self.loss_scaler.update(overflow)
        self._grads_ready = False
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the half parameters' gradients (and the masters')."""
        params = [t for pair in self._pairs for t in pair] if self._pairs is not None else []
        params += [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        self._grads_ready = False
