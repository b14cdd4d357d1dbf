"""What a thread is executing now (microbatch, position in the module graph) and the execution state
(grad mode, autocast) a request carries from the requester to the module's owner.

Grad mode and autocast are thread-local in torch; the step function runs in worker threads, and a
module runs on another rank than its caller, so both are captured where the call is made and applied
where it executes (Appendix B: "whether the requester is in an autocast / no_grad context").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["ExecState", "TaskContext", "applied", "capture", "current", "task_context"]

_LOCAL = threading.local()


@dataclass
class TaskContext:
    """The task a thread executes: one microbatch of the step function, or one request."""

    microbatch: int
    position: tuple[str, ...] = ()
    """Module paths from the step function down to the module executing now."""
    on_backward: Callable[[], None] | None = None
    """Set for the step function's microbatches on pp_rank 0: called at the first ``model.backward`` of
    the microbatch; returns when the schedule starts this microbatch's backward."""
    backward_calls: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def current() -> TaskContext | None:
    """The calling thread's task, or None outside any step."""
    return getattr(_LOCAL, "task", None)


@contextlib.contextmanager
def task_context(task: TaskContext) -> Iterator[TaskContext]:
    previous = current()
    _LOCAL.task = task
    try:
        yield task
    finally:
        _LOCAL.task = previous


def _device_types() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass(frozen=True, slots=True)
class ExecState:
    """Grad mode and autocast state of a thread, to re-create on another thread or rank."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    """(device type, dtype) of each autocast context enabled."""


def capture() -> ExecState:
    """The calling thread's grad mode and autocast state."""
    autocast = tuple(
        (dev, torch.get_autocast_dtype(dev)) for dev in _device_types() if torch.is_autocast_enabled(dev)
    )
    return ExecState(torch.is_grad_enabled(), autocast)


@contextlib.contextmanager
def applied(state: ExecState) -> Iterator[None]:
    """Run the body under ``state`` (grad mode and autocast); autocast contexts not in it are off."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
        enabled = dict(state.autocast)
        for dev in _device_types():
            if dev in enabled:
                stack.enter_context(torch.autocast(dev, dtype=enabled[dev]))
            elif torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield
