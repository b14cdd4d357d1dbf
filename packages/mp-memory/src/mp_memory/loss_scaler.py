"""smp's fp16 loss scalers: a static scale, and the dynamic scaler with smp's arguments.

smp's ``DistributedOptimizer(static_loss_scale=..., dynamic_loss_scale=..., dynamic_loss_args=...)``
took the arguments of DeepSpeed's ``DynamicLossScaler`` (which smp's FP16 optimizer came from):

- ``init_scale`` (2**32): the first scale;
- ``scale_factor`` (2.0): divide by it on an overflow, multiply after ``scale_window`` good steps;
- ``scale_window`` (1000): good steps since the last overflow before the scale grows;
- ``min_scale`` (1): the scale never goes below it;
- ``delayed_shift`` (1): hysteresis, the overflows tolerated before the scale is lowered;
- ``consecutive_hysteresis`` (False): refill the hysteresis after every good step (else only when the
  scale grows).

:meth:`DynamicLossScaler.update` follows DeepSpeed's ``update_scale`` line for line, so a run reproduces
DeepSpeed's (and smp's) sequence of scales.
"""

from __future__ import annotations

from typing import Any

from mp_memory.errors import PrecisionError

__all__ = ["DYNAMIC_DEFAULTS", "DynamicLossScaler", "LossScaler", "make_loss_scaler"]

DYNAMIC_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}


class LossScaler:
    """A static loss scale: the loss is multiplied by ``scale``, the gradients divided by it."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise PrecisionError(f"static_loss_scale={scale!r}; expected a number > 0 (e.g. 128.0)")
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """A static scale does not change (an overflowed step is still skipped by the optimizer)."""

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": False, "cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(LossScaler):
    """The loss scale that falls on overflows and grows after ``scale_window`` good steps."""

    dynamic = True

    def __init__(  # noqa: PLR0917 (smp's positional order, as DeepSpeed's DynamicLossScaler)
        self,
        init_scale: float = 2.0**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
    ) -> None:
        for name, value, ok in (
            ("init_scale", init_scale, init_scale > 0),
            ("scale_factor", scale_factor, scale_factor > 1),
            ("scale_window", scale_window, isinstance(scale_window, int) and scale_window >= 1),
            ("min_scale", min_scale, min_scale > 0),
            ("delayed_shift", delayed_shift, isinstance(delayed_shift, int) and delayed_shift >= 1),
        ):
            if not ok:
                raise PrecisionError(
                    f"dynamic_loss_args {name}={value!r} is out of range; expected init_scale > 0, "
                    "scale_factor > 1, scale_window an int >= 1, min_scale > 0, delayed_shift an int >= 1"
                )
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update(self, overflow: bool) -> None:
        """After a step: lower the scale on an overflow (once the hysteresis is used up), raise it after
        ``scale_window`` steps without one."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "dynamic": True,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])
        self.cur_iter = int(sd.get("cur_iter", 0))
        self.last_overflow_iter = int(sd.get("last_overflow_iter", -1))
        self.cur_hysteresis = int(sd.get("cur_hysteresis", self.delayed_shift))


def make_loss_scaler(
    static_loss_scale: float | None, dynamic_loss_scale: bool, dynamic_loss_args: dict[str, Any]
) -> LossScaler:
    """The scaler smp's ``DistributedOptimizer`` arguments ask for (unknown argument names raise)."""
    unknown = sorted(set(dynamic_loss_args) - set(DYNAMIC_DEFAULTS))
    if unknown:
        raise PrecisionError(
            f"unknown dynamic_loss_args {unknown}; expected some of {sorted(DYNAMIC_DEFAULTS)}. Fix: "
            "rename or remove them"
        )
    if dynamic_loss_scale:
        return DynamicLossScaler(**{**DYNAMIC_DEFAULTS, **dynamic_loss_args})
    if dynamic_loss_args:
        raise PrecisionError(
            f"dynamic_loss_args {sorted(dynamic_loss_args)} given with dynamic_loss_scale=False; they "
            "configure the dynamic scaler only. Fix: pass dynamic_loss_scale=True, or remove them"
        )
    return LossScaler(1.0 if static_loss_scale is None else static_loss_scale)
