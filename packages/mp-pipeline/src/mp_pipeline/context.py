"""What a thread is executing now (microbatch, position in the module graph) and the execution state
(grad mode, autocast) a request carries from the requester to the module's owner.

Grad mode and autocast are thread-local in torch; the step function runs in worker threads, and a
module runs on another rank than its caller, so both are captured where the call is made and applied
where it executes: a request carries whether the requester is in an autocast / no_grad context.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from mp_pipeline.structure import pickled_by_position

__all__ = ["TASK_HOOKS", "ExecState", "TaskContext", "applied", "capture", "current", "task_context"]

_LOCAL = threading.local()

TASK_HOOKS: list[Callable[[], contextlib.AbstractContextManager[None]]] = []
"""Context managers every task runs under, in its own thread (the umbrella's memory trace adds one to
count the tensors saved for backward; saved-tensor hooks are per thread)."""


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
    computed: bool = False
    """pp_rank 0: a module of this rank returned in this task before its first call to another rank."""
    opened: bool | None = None
    """pp_rank 0's step function: whether its first call to another rank came before any of this rank's
    modules returned (it feeds another rank first: Replay.opened); None until that call."""
    extra: dict[str, object] = field(default_factory=dict)


def current() -> TaskContext | None:
    """The calling thread's task, or None outside any step."""
    return getattr(_LOCAL, "task", None)


class task_context:  # lower case: used like the function it replaced
    """Run the body as ``task`` (a plain class: this runs for every request, twice per microbatch)."""

    __slots__ = ("_hooks", "_previous", "_task")

    def __init__(self, task: TaskContext) -> None:
        self._task = task
        self._previous: TaskContext | None = None
        self._hooks: contextlib.ExitStack | None = None

    def __enter__(self) -> TaskContext:
        self._previous = getattr(_LOCAL, "task", None)
        _LOCAL.task = self._task
        if TASK_HOOKS:
            self._hooks = contextlib.ExitStack()
            for hook in TASK_HOOKS:
                self._hooks.enter_context(hook())
        return self._task

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None
        _LOCAL.task = self._previous


@functools.cache
def _device_types() -> tuple[str, ...]:
    # cached: asked for every request (capture and apply), and CUDA does not appear mid-run
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@pickled_by_position
@dataclass(frozen=True, slots=True)
class ExecState:
    """Grad mode and autocast state of a thread, to re-create on another thread or rank."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    """(device type, dtype) of each autocast context enabled."""


def capture() -> ExecState:
    """The calling thread's grad mode and autocast state."""
    devices = _device_types()
    if not any(torch.is_autocast_enabled(dev) for dev in devices):  # the common case, allocation-free
        return _PLAIN[torch.is_grad_enabled()]
    autocast = tuple(
        (dev, torch.get_autocast_dtype(dev)) for dev in devices if torch.is_autocast_enabled(dev)
    )
    return ExecState(torch.is_grad_enabled(), autocast)


_PLAIN = {True: ExecState(True), False: ExecState(False)}


@contextlib.contextmanager
def _applied(state: ExecState) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
        enabled = dict(state.autocast)
        for dev in _device_types():
            if dev in enabled:
                stack.enter_context(torch.autocast(dev, dtype=enabled[dev]))
            elif torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield


class _GradMode:
    """Sets the grad mode on entry and restores it on exit (what ``applied`` needs without autocast)."""

    __slots__ = ("_mode", "_previous")

    def __init__(self, mode: bool) -> None:
        self._mode = mode
        self._previous = mode

    def __enter__(self) -> None:
        # set only where it changes: torch.set_grad_enabled builds a context-manager object each time
        # (0.7 µs here, twice per request), and a request's mode is nearly always the thread's already
        self._previous = previous = torch.is_grad_enabled()
        if previous != self._mode:
            torch.set_grad_enabled(self._mode)

    def __exit__(self, *exc: object) -> None:
        if torch.is_grad_enabled() != self._previous:  # (the body may have changed it too)
            torch.set_grad_enabled(self._previous)


def _autocast_on() -> bool:
    """Whether an autocast context is enabled in this thread (asked once per request: a map over the one
    or two device types, cheaper than a generator)."""
    return True in map(torch.is_autocast_enabled, _device_types())


def applied(state: ExecState) -> contextlib.AbstractContextManager[None]:
    """Run the body under ``state`` (grad mode and autocast); autocast contexts not in it are off."""
    if state.autocast or _autocast_on():
        return _applied(state)
    return _GradMode(state.grad_enabled)  # the common case (once per request), cheaply
