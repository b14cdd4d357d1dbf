"""Forward and backward time of every module, measured on a real training step (forward + backward).

The trace (:mod:`mp_partition.trace`) keeps no activations, so it cannot run backward. The
:class:`StepTimer` times a normal step instead: forward pre/post hooks say which module is running, so
every forward interval goes to the innermost running module; a ``TorchFunctionMode`` tags each autograd
node created in the forward with that module (a module's outputs are tagged too, for ops the mode does
not see, such as custom autograd Functions), and a pre-hook on the node attributes the backward time
from that node to the next one to it. Time spent outside every module (the loss in a step function, the
autograd engine between nodes) goes to the model itself, path ``""``: the parent, which runs on
pipeline rank 0. The timer also counts calls between modules (caller -> callee), which the balancer
needs to charge the cost of remote calls.

Times are exclusive (a module's own work, not its submodules'), in seconds, summed over its calls. On
CUDA each hook synchronizes, so the numbers are exact but the pass is slower than a real step. The
random number generators, the buffers and the parameters' ``.grad`` are restored on exit, so timing
does not change what the next real step computes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ._walk import walk_modules
from .errors import TracingError
from .trace import _preserved_state

__all__ = ["ModuleTimes", "StepTimer", "time_step"]

ROOT = ""


@dataclass(frozen=True)
class ModuleTimes:
    """Measured exclusive times per canonical module path (``""``: the model and the code around it)."""

    forward_s: Mapping[str, float]
    backward_s: Mapping[str, float]
    call_counts: Mapping[tuple[str, str], int]
    """(caller path, callee path) -> number of calls; the caller is the innermost running module."""
    device: str

    def total_s(self, path: str) -> float:
        """Forward plus backward time of one module."""
        return self.forward_s.get(path, 0.0) + self.backward_s.get(path, 0.0)

    @property
    def step_s(self) -> float:
        """The whole measured step: forward and backward of every module and of the code around them."""
        return sum(self.forward_s.values()) + sum(self.backward_s.values())

    @staticmethod
    def fastest(runs: Sequence[ModuleTimes]) -> ModuleTimes:
        """Per module, the fastest of several runs of the same step (a loaded host only adds time)."""
        if not runs:
            raise ValueError("fastest() needs at least one run")
        paths = {p for r in runs for p in (*r.forward_s, *r.backward_s)}
        return ModuleTimes(
            forward_s=MappingProxyType({p: min(r.forward_s.get(p, 0.0) for r in runs) for p in paths}),
            backward_s=MappingProxyType({p: min(r.backward_s.get(p, 0.0) for r in runs) for p in paths}),
            call_counts=runs[-1].call_counts,
            device=runs[-1].device,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "forward_s": dict(self.forward_s),
            "backward_s": dict(self.backward_s),
            "call_counts": [[a, b, n] for (a, b), n in self.call_counts.items()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModuleTimes:
        return cls(
            forward_s=MappingProxyType({str(k): float(v) for k, v in data["forward_s"].items()}),
            backward_s=MappingProxyType({str(k): float(v) for k, v in data["backward_s"].items()}),
            call_counts=MappingProxyType({(str(a), str(b)): int(n) for a, b, n in data["call_counts"]}),
            device=str(data["device"]),
        )


class _TagMode(TorchFunctionMode):
    """Tags the autograd node of every tensor an op returns with the module running the op."""

    def __init__(self, timer: StepTimer) -> None:
        super().__init__()
        self._timer = timer

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self._timer.tag(out)
        return out


class StepTimer:
    """Context manager that times forward and backward of each module of ``model``.

    Run one step inside it and call :meth:`backward` (instead of ``loss.backward()``) so that the end of
    the backward pass is timed too::

        with StepTimer(model) as timer:
            loss = loss_fn(model(x), y)
            timer.backward(loss)
        times = timer.result()
    """

    def __init__(self, model: nn.Module, *, preserve_state: bool = True) -> None:
        self._model = model
        self._preserve_state = preserve_state
        self._entries = walk_modules(model)
        device = next((t.device.type for t in model.parameters()), "cpu")
        self._device = device
        self._cuda = device == "cuda"
        self._thread = threading.get_ident()
        self._stack: list[str] = []
        self._forward: dict[str, float] = {}
        self._backward: dict[str, float] = {}
        self._calls: dict[tuple[str, str], int] = {}
        self._tagged: dict[int, str] = {}
        self._nodes: list[Any] = []  # keeps tagged nodes alive, so their ids stay unique
        self._handles: list[Any] = []
        self._mark = 0.0
        self._bwd_owner: str | None = None
        self._exit_stack: contextlib.ExitStack | None = None

    # -- clock -----------------------------------------------------------------------------------------
    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _switch(self, table: dict[str, float], owner: str) -> None:
        now = self._now()
        table[owner] = table.get(owner, 0.0) + (now - self._mark)
        self._mark = now

    def _current(self) -> str:
        return self._stack[-1] if self._stack else ROOT

    # -- forward ---------------------------------------------------------------------------------------
    def _pre(self, path: str) -> None:
        if threading.get_ident() != self._thread:
            return
        self._close_backward()
        caller = self._current()
        self._switch(self._forward, caller)
        if caller != path:  # the model called from outside is no call between modules
            key = (caller, path)
            self._calls[key] = self._calls.get(key, 0) + 1
        self._stack.append(path)

    def _post(self, path: str, output: object) -> None:
        if threading.get_ident() != self._thread or not self._stack:
            return
        self.tag(output)  # outputs of ops the mode does not see (custom autograd Functions)
        self._switch(self._forward, self._current())
        while self._stack and self._stack.pop() != path:  # an exception unwound past inner modules
            pass

    def tag(self, out: object) -> None:
        """Mark the tensors of an op's output with the module running now (on the timed thread)."""
        if threading.get_ident() != self._thread:
            return
        owner = self._current()
        for t in _tensors(out):
            node = t.grad_fn
            if node is None or id(node) in self._tagged:
                continue
            self._tagged[id(node)] = owner
            self._nodes.append(node)
            self._handles.append(node.register_prehook(lambda _g, owner=owner: self._enter_node(owner)))

    # -- backward --------------------------------------------------------------------------------------
    def _enter_node(self, owner: str) -> None:
        if self._bwd_owner is None:  # the first node of a backward pass: forward time ends here
            self._switch(self._forward, self._current())
            self._bwd_owner = owner
            return
        self._switch(self._backward, self._bwd_owner)
        self._bwd_owner = owner

    def _close_backward(self) -> None:
        if self._bwd_owner is not None:
            self._switch(self._backward, self._bwd_owner)
            self._bwd_owner = None

    def backward(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        grad_tensors: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """``torch.autograd.backward`` with its end timed (the last node's time ends here)."""
        torch.autograd.backward(tensors, grad_tensors)
        self._close_backward()

    # -- context ---------------------------------------------------------------------------------------
    def __enter__(self) -> StepTimer:
        if self._exit_stack is not None:
            raise TracingError("a StepTimer was entered twice: expected a fresh StepTimer each time")
        stack = contextlib.ExitStack()
        try:
            if self._preserve_state:
                stack.enter_context(_preserved_state(self._model))
                stack.enter_context(_preserved_grads(self._model))
            for entry in self._entries:
                path = entry.path
                handle: RemovableHandle = entry.module.register_forward_pre_hook(
                    lambda _m, _a, path=path: self._pre(path)
                )
                self._handles.append(handle)
                self._handles.append(
                    entry.module.register_forward_hook(
                        lambda _m, _a, out, path=path: self._post(path, out), always_call=True
                    )
                )
            stack.callback(self._remove_hooks)
            stack.enter_context(_TagMode(self))
            stack.enter_context(torch.enable_grad())
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack
        self._mark = self._now()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._exit_stack is not None
        try:
            self._close_backward()
            self._switch(self._forward, ROOT)  # code after the last module, before exit
        finally:
            self._exit_stack.close()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()
        self._tagged.clear()

    def result(self) -> ModuleTimes:
        """The times recorded (call after the ``with`` block)."""
        return ModuleTimes(
            forward_s=MappingProxyType(dict(self._forward)),
            backward_s=MappingProxyType(dict(self._backward)),
            call_counts=MappingProxyType(dict(self._calls)),
            device=self._device,
        )


def _tensors(obj: object, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)


@contextlib.contextmanager
def _preserved_grads(model: nn.Module) -> Iterator[None]:
    """Puts every parameter's ``.grad`` back as it was (the timed backward accumulates into it)."""
    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in saved:
            p.grad = grad


def time_step(
    model: nn.Module,
    step: Callable[[StepTimer], Any],
    *,
    passes: int = 3,
) -> ModuleTimes:
    """Runs ``step(timer)`` ``passes`` times under fresh :class:`StepTimer`s and keeps, per module, the
    fastest pass. ``step`` runs the forward and calls ``timer.backward(loss)``. The first pass also
    warms up (allocator, kernel choice); with ``passes`` 1 its one-time costs stay in the numbers."""
    if passes < 1:
        raise TracingError(f"passes {passes!r} is invalid: expected an int >= 1; pass e.g. 2")
    runs = []
    for _ in range(passes):
        with StepTimer(model) as timer:
            step(timer)
        runs.append(timer.result())
    return ModuleTimes.fastest(runs)
