"""LAMB as apex's FusedLAMB computes it, on torch tensors, with whole-model norms under mp's layouts.

apex's update, per step t (You et al., "Large Batch Optimization for Deep Learning", with apex's
choices): the global gradient norm N over every gradient clips them (g / (N / max_grad_norm) when N is
above ``max_grad_norm`` > 0); then per parameter p

    g' = g + wd * p                          (adam_w_mode=False: L2 inside the moments)
    m = b1 * m + (1 - b1 if grad_averaging else 1) * g'
    v = b2 * v + (1 - b2) * g'^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)   (bias corrections only with bias_correction)
    u = u + wd * p                           (adam_w_mode=True: decoupled weight decay)
    r = |p| / |u| if (use_nvlamb or wd != 0) and both norms are > 0, else 1
    p = p - lr * r * u

Under mp a rank holds only its pipeline stage and its tensor-parallel shards, so N sums over the
pipeline (and over the TP group for sharded parameters), and |p|, |u| of a sharded parameter sum over
its TP group: the step equals LAMB on the unpartitioned model. Collective over the pipeline and TP
groups when mp is initialized with them: call ``step()`` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mp.errors import SMPUnsupportedError
from mp.state import state
from mp_comm import GroupKind

__all__ = ["FusedLAMB"]


def _group_of(kind: GroupKind) -> dist.ProcessGroup | None:
    group = state.process_groups.get(kind)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _is_sharded(p: torch.Tensor) -> bool:
    from mp_tensor import is_distributed_parameter

    return bool(is_distributed_parameter(p))


class FusedLAMB(torch.optim.Optimizer):
    """``smp.optimizers.FusedLAMB`` with apex's arguments and defaults (see the module docstring)."""

    def __init__(  # noqa: PLR0917  (apex's positional signature)
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise SMPUnsupportedError(
                "FusedLAMB(amsgrad=True): apex's FusedLAMB has no AMSGrad variant and neither does smp's. "
                "Expected amsgrad=False. Fix: remove the argument"
            )
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _sum_squares(self, tensors: list[torch.Tensor], sharded: list[bool]) -> torch.Tensor:
        """Per tensor: its squared norm, over the whole tensor for TP shards (one collective)."""
        sq = torch.stack([t.detach().double().square().sum() for t in tensors]) if tensors else None
        if sq is None:
            return torch.zeros(0, dtype=torch.float64)
        tp = _group_of(GroupKind.TP)
        if tp is not None and any(sharded):
            mask = torch.tensor(sharded, dtype=torch.bool, device=sq.device)
            part = torch.where(mask, sq, torch.zeros_like(sq))
            dist.all_reduce(part, group=tp)
            sq = torch.where(mask, part, sq)
        return sq

    def _global_grad_norm(self, grads: list[torch.Tensor], sharded: list[bool]) -> float:
        # After the step's reduction a replicated gradient is the same on every TP rank and a sharded one's
        # square was summed over its TP group: the total is the same on the TP ranks; stages add up.
        total = self._sum_squares(grads, sharded).sum()
        pp = _group_of(GroupKind.PP)
        if pp is not None:
            dist.all_reduce(total, group=pp)
        return float(total.sqrt())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return loss
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise SMPUnsupportedError("FusedLAMB does not support sparse gradients; use dense ones")
        sharded = [_is_sharded(p) for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        norm = self._global_grad_norm(grads, sharded)
        updates: list[torch.Tensor] = []
        lrs: list[tuple[float, bool]] = []  # (lr, whether the trust ratio applies)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
            wd, max_norm = group["weight_decay"], group["max_grad_norm"]
            clip = norm / max_norm if max_norm > 0 and norm > max_norm else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                g = p.grad / clip
                if not self.adam_w_mode and wd != 0:
                    g = g + wd * p
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=beta3)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                bc1 = 1.0 - beta1**t if group["bias_correction"] else 1.0
                bc2 = 1.0 - beta2**t if group["bias_correction"] else 1.0
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode and wd != 0:
                    update = update + wd * p
                updates.append(update)
                lrs.append((group["lr"], self.use_nvlamb or wd != 0))
        w_sq = self._sum_squares(list(params), sharded)
        u_sq = self._sum_squares(updates, sharded)
        for p, update, (lr, trust), w2, u2 in zip(
            params, updates, lrs, w_sq.tolist(), u_sq.tolist(), strict=True
        ):
            ratio = (w2 / u2) ** 0.5 if trust and w2 > 0 and u2 > 0 else 1.0
            p.add_(update, alpha=-lr * ratio)
        return loss
