"""`smp.amp.GradScaler`: torch's loss scaler, made to agree across the ranks of a partitioned model.

torch's `GradScaler` decides from the gradients it can see whether a step overflowed: it unscales
them, skips `optimizer.step()` if any is inf or NaN, and halves the scale. Under smp every rank holds
only its own part of the model, so each would decide alone: a stage whose gradients overflowed would
skip its step while the others took theirs (the model is then no longer one model), and the scales
would drift apart. This scaler shares the verdict: after unscaling, the inf/NaN flag is all-reduced
(MAX) over every rank of the job, so all ranks skip the same steps and keep the same scale.

The loss is scaled where the step function computes it (pp_rank 0), and the gradients that reach the
other stages carry that scale; those ranks never call `scale`, so the scale starts from `init_scale` on
first use there, as it does on pp_rank 0, and every rank then updates it with the same verdicts::

    scaler = smp.amp.GradScaler()

    @smp.step
    def train_step(model, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    train_step(model, x, y)
    scaler.step(optimizer)  # every rank: skipped everywhere if any rank's gradients overflowed
    scaler.update()

`unscale_`, `step` and `update` are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose overflow checks agree across all ranks (see the module docstring).

    The arguments are those of `torch.cuda.amp.GradScaler`, which smp's scaler replaced, in its order;
    `device` (keyword) defaults to "cuda" when CUDA is available, else "cpu".
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    def _start_scale(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        # Ranks other than pp_rank 0 never call `scale`, which is where torch creates the scale, on the
        # loss's device. Create it where this rank's gradients are: torch copies a CUDA scale to CPU
        # gradients without waiting for the copy, so a CPU model on a GPU machine read stale scales.
        if self._enabled and self._scale is None:
            params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []
            mine = [p for p in params if p.grad is not None] or params
            device = mine[0].device if mine else torch.device(self._device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._lazy_init_scale_growth_tracker(device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._start_scale(optimizer)
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        self._start_scale(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._start_scale()
        super().update(new_scale)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # Every overflow check of torch's scaler (unscale_, and step for optimizers that unscale
        # themselves) goes through here: the one place to make the verdict the job's.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        flag = torch.zeros((), dtype=torch.float32)
        for found in per_device.values():
            flag = torch.maximum(flag, found.detach().float().cpu())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        assert self._scale is not None
        if not per_device:  # no gradient on this rank: it must still skip when another rank overflowed
            per_device[self._scale.device] = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for found in per_device.values():
            found.fill_(flag.item())
        return per_device
