"""Tracing: one forward pass that records what the partitioner needs about every module.

For each module the trace records how often it ran, when it first ran (a global sequence number, which
gives every parent the order in which its children execute), its forward time when measured (inclusive,
and exclusive of its direct submodules), the bytes that autograd saved for backward while the module was
the innermost one running (its activation memory), the bytes of its outputs, and how many torch
operations returning a tensor its own code ran (not its submodules': a ``TorchFunctionMode`` counts each
operation for the innermost running module). A module that ran none only hands tensors between its
submodules, as ``nn.Sequential`` does, or never ran at all, as ``nn.ModuleList``: a pure container, which
the balancer may split between stages (:mod:`mp_partition.balance`).

Saved tensors are counted through ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook keeps only
a byte count, so tracing holds no activations: memory stays that of inference. On the meta device
nothing is allocated and no time is measured; sizes still are. The module's parameters and buffers are
never counted as activations.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ._walk import walk_modules
from .errors import TracingError

__all__ = ["ModuleStats", "TraceResult", "Tracer", "is_tracing", "trace_model"]

_log = logging.getLogger(__name__)

_TRACING = threading.local()


def is_tracing() -> bool:
    """True while a :class:`Tracer` is active in the calling thread (smp's ``is_tracing``)."""
    return bool(getattr(_TRACING, "depth", 0))


@dataclass(frozen=True)
class ModuleStats:
    """What the trace saw of one module (summed over all its calls).

    Sizes are in bytes, times in seconds.
    """

    calls: int = 0
    """How many times the module's forward ran."""
    first_call: int | None = None
    """Global sequence number of its first forward call; None if it never ran."""
    forward_time_s: float | None = None
    """Forward time including its submodules; None when times were not measured."""
    self_time_s: float | None = None
    """Forward time minus the time of its direct submodule calls; None when not measured."""
    saved_bytes: int = 0
    """Bytes autograd saved for backward by operations run directly in this module."""
    output_bytes: int = 0
    """Bytes of the tensors the module returned."""
    own_ops: int | None = None
    """Torch operations returning a tensor that the module's own code ran (its submodules' excluded);
    None when the trace did not count them (a trace saved by an older version)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "first_call": self.first_call,
            "forward_time_s": self.forward_time_s,
            "self_time_s": self.self_time_s,
            "saved_bytes": self.saved_bytes,
            "output_bytes": self.output_bytes,
            "own_ops": self.own_ops,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModuleStats:
        return cls(
            calls=int(data["calls"]),
            first_call=None if data["first_call"] is None else int(data["first_call"]),
            forward_time_s=None if data["forward_time_s"] is None else float(data["forward_time_s"]),
            self_time_s=None if data["self_time_s"] is None else float(data["self_time_s"]),
            saved_bytes=int(data["saved_bytes"]),
            output_bytes=int(data["output_bytes"]),
            own_ops=None if data.get("own_ops") is None else int(data["own_ops"]),
        )


@dataclass(frozen=True)
class TraceResult:
    """The outcome of tracing a model; keyed by canonical module path (``""`` is the model itself)."""

    modules: Mapping[str, ModuleStats]
    """Stats of every distinct module of the model, including those that never ran."""
    execution_order: Mapping[str, tuple[str, ...]]
    """For each module that called others: the modules it called, in order of their first call."""
    device: str
    """Device type the trace ran on (``cpu``, ``cuda``, ``meta``, ...)."""
    measured_time: bool
    """Whether forward times were measured."""
    grad_recorded: bool
    """Whether autograd saved any tensor; if not, outputs stand in for activation memory."""

    def stats(self, path: str) -> ModuleStats:
        """Stats of the module at canonical ``path`` (empty stats if the trace does not know it)."""
        return self.modules.get(path, ModuleStats())

    def activation_bytes(self, path: str) -> int:
        """Activation memory attributed to one module: saved tensors, or outputs without autograd."""
        s = self.stats(path)
        return s.saved_bytes if self.grad_recorded else s.output_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "measured_time": self.measured_time,
            "grad_recorded": self.grad_recorded,
            "modules": {p: s.to_dict() for p, s in self.modules.items()},
            "execution_order": {p: list(c) for p, c in self.execution_order.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceResult:
        return cls(
            modules=MappingProxyType({p: ModuleStats.from_dict(s) for p, s in data["modules"].items()}),
            execution_order=MappingProxyType({p: tuple(c) for p, c in data["execution_order"].items()}),
            device=str(data["device"]),
            measured_time=bool(data["measured_time"]),
            grad_recorded=bool(data["grad_recorded"]),
        )


def _tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _has_tensor(obj: object, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth < 4 and isinstance(obj, (list, tuple)):
        return any(_has_tensor(v, depth + 1) for v in obj)
    return False


def _output_bytes(obj: object, seen: set[int], depth: int = 0) -> int:
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return _tensor_bytes(obj)
    if depth > 8:
        return 0
    if isinstance(obj, Mapping):
        return sum(_output_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_output_bytes(v, seen, depth + 1) for v in obj)
    return 0


@dataclass
class _Call:
    path: str
    parent: int | None
    start: Any
    end: Any = None
    children: list[int] = field(default_factory=list)


class _Unpackable:
    """What the pack hook keeps of a saved tensor: its size only. The traced graph cannot run backward."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _unpack(_: object) -> torch.Tensor:
    raise TracingError(
        "backward was called on a graph built during mp_partition tracing: expected tracing to run "
        "forward only; call backward outside the Tracer context (tracing keeps no activations)"
    )


class _OpCounter(TorchFunctionMode):
    """Counts, for the innermost running module, the torch operations that return a tensor."""

    def __init__(self, count: Callable[[], None]) -> None:
        super().__init__()
        self._count = count

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if _has_tensor(out):
            self._count()
        return out


class Tracer:
    """Context manager that records module statistics for whatever forward passes run inside it.

    ``trace_model`` runs one forward pass inside a Tracer; use the Tracer directly to trace code that is
    not a plain ``model(*args)`` call (a training step function, for instance)::

        with Tracer(model) as tracer:
            loss = step(model, batch)
        trace = tracer.result()

    With ``preserve_state`` (the default) the random number generators and the model's buffers are
    restored on exit, so tracing does not change what the next real step computes.
    """

    def __init__(self, model: nn.Module, *, measure_time: bool = False, preserve_state: bool = True) -> None:
        self._model = model
        self._measure_requested = measure_time
        self._preserve_state = preserve_state
        self._entries = walk_modules(model)
        self._param_ids: set[int] = set()
        for entry in self._entries:
            self._param_ids.update(id(p) for p in entry.module._parameters.values() if p is not None)
            self._param_ids.update(id(b) for b in entry.module._buffers.values() if b is not None)
        self._device = _model_device(model)
        self._cuda = self._device == "cuda"
        self.measures = measure_time and self._device in ("cpu", "cuda")
        """Whether this trace measures times (asked for, and the model is on the CPU or CUDA)."""
        if measure_time and not self.measures:
            _log.info("forward times are not measured on device %r; using module counts", self._device)
        self._handles: list[RemovableHandle] = []
        self._calls: list[_Call] = []
        self._stack: list[int] = []
        self._count: dict[str, int] = {}
        self._first: dict[str, int] = {}
        self._saved: dict[str, int] = {}
        self._outputs: dict[str, int] = {}
        self._ops: dict[str, int] = {}
        self._order: dict[str, list[str]] = {}
        self._seen_saved: dict[Any, weakref.ReferenceType[torch.Tensor]] = {}
        self._grad_recorded = False
        self._seq = 0
        self._exit_stack: contextlib.ExitStack | None = None
        self._done = False
        self._thread = threading.get_ident()

    # -- hooks -----------------------------------------------------------------------------------------
    def _now(self) -> Any:
        if not self.measures:
            return None
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, path: str) -> None:
        if threading.get_ident() != self._thread:
            return
        parent = self._stack[-1] if self._stack else None
        if parent is not None:
            caller = self._calls[parent].path
            order = self._order.setdefault(caller, [])
            if path not in order:
                order.append(path)
        self._count[path] = self._count.get(path, 0) + 1
        if path not in self._first:
            self._first[path] = self._seq
            self._seq += 1
        index = len(self._calls)
        self._calls.append(_Call(path, parent, self._now()))
        if parent is not None:
            self._calls[parent].children.append(index)
        self._stack.append(index)

    def _post(self, path: str, output: object) -> None:
        if threading.get_ident() != self._thread or not self._stack:
            return
        index = self._stack.pop()
        call = self._calls[index]
        if call.path != path:  # an exception unwound past modules whose hooks did not run
            while self._stack and self._calls[index].path != path:
                index = self._stack.pop()
            call = self._calls[index]
        call.end = self._now()
        self._outputs[path] = self._outputs.get(path, 0) + _output_bytes(output, set())

    def _count_op(self) -> None:
        if self._stack and threading.get_ident() == self._thread:
            path = self._calls[self._stack[-1]].path
            self._ops[path] = self._ops.get(path, 0) + 1

    def _pack(self, tensor: torch.Tensor) -> _Unpackable:
        nbytes = _tensor_bytes(tensor)
        if not self._stack or threading.get_ident() != self._thread:
            return _Unpackable(nbytes)
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) in self._param_ids or id(base) in self._param_ids:
            return _Unpackable(nbytes)
        keys: list[Any] = [("id", id(tensor))]
        if tensor.device.type != "meta" and tensor.layout == torch.strided:
            with contextlib.suppress(RuntimeError):  # tensors without storage (wrapper subclasses)
                keys.append(("ptr", tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride()))
        for key in keys:
            ref = self._seen_saved.get(key)
            alive = ref() if ref is not None else None
            if alive is not None and (key[0] == "ptr" or alive is tensor):
                return _Unpackable(nbytes)
        ref_new = weakref.ref(tensor)
        for key in keys:
            self._seen_saved[key] = ref_new
        self._grad_recorded = True
        path = self._calls[self._stack[-1]].path
        self._saved[path] = self._saved.get(path, 0) + nbytes
        return _Unpackable(nbytes)

    # -- context ---------------------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        if self._exit_stack is not None or self._done:
            raise TracingError("a Tracer can be entered once: expected a fresh Tracer; create a new one")
        stack = contextlib.ExitStack()
        try:
            if self._preserve_state:
                stack.enter_context(_preserved_state(self._model))
            for entry in self._entries:
                path = entry.path
                self._handles.append(
                    entry.module.register_forward_pre_hook(lambda _m, _a, path=path: self._pre(path))
                )
                self._handles.append(
                    entry.module.register_forward_hook(
                        lambda _m, _a, out, path=path: self._post(path, out), always_call=True
                    )
                )
            stack.callback(self._remove_hooks)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
            stack.enter_context(_OpCounter(self._count_op))
            _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
            stack.callback(_leave_tracing)
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._exit_stack is not None
        try:
            if self._cuda and self.measures:
                torch.cuda.synchronize()
        finally:
            self._exit_stack.close()
            self._exit_stack = None
            self._done = True

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _duration(self, call: _Call) -> float:
        if call.start is None or call.end is None:
            return 0.0
        if self._cuda:
            return float(call.start.elapsed_time(call.end)) / 1000.0
        return float(call.end - call.start)

    def result(self) -> TraceResult:
        """The statistics recorded so far (call after the ``with`` block)."""
        if self._exit_stack is not None:
            raise TracingError("Tracer.result() was called inside the with block: expected after it")
        inclusive: dict[str, float] = {}
        exclusive: dict[str, float] = {}
        if self.measures:
            durations = [self._duration(c) for c in self._calls]
            for call, dur in zip(self._calls, durations, strict=True):
                inner = sum(durations[i] for i in call.children)
                inclusive[call.path] = inclusive.get(call.path, 0.0) + dur
                exclusive[call.path] = exclusive.get(call.path, 0.0) + max(0.0, dur - inner)
        modules: dict[str, ModuleStats] = {}
        for entry in self._entries:
            p = entry.path
            ran = p in self._count
            modules[p] = ModuleStats(
                calls=self._count.get(p, 0),
                first_call=self._first.get(p),
                forward_time_s=(inclusive.get(p, 0.0) if ran else 0.0) if self.measures else None,
                self_time_s=(exclusive.get(p, 0.0) if ran else 0.0) if self.measures else None,
                saved_bytes=self._saved.get(p, 0),
                output_bytes=self._outputs.get(p, 0),
                own_ops=self._ops.get(p, 0),
            )
        return TraceResult(
            modules=MappingProxyType(modules),
            execution_order=MappingProxyType({k: tuple(v) for k, v in self._order.items()}),
            device=self._device,
            measured_time=self.measures,
            grad_recorded=self._grad_recorded,
        )


def _leave_tracing() -> None:
    _TRACING.depth = getattr(_TRACING, "depth", 1) - 1


def _model_device(model: nn.Module) -> str:
    for tensor in model.parameters():
        return tensor.device.type
    for buffer in model.buffers():
        return buffer.device.type
    return "cpu"


@contextlib.contextmanager
def _preserved_state(model: nn.Module) -> Iterator[None]:
    """Restores the RNG states and every (non-meta) buffer of ``model`` on exit."""
    cpu_rng = torch.get_rng_state()
    cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_rng = torch.cuda.get_rng_state_all() if cuda_ready else None
    saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] = []
    with torch.no_grad():
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    copy = None if buf.device.type == "meta" else buf.detach().clone()
                    saved.append((module, name, buf, copy))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buf, copy in saved:
                module._buffers[name] = buf
                if copy is not None:
                    buf.copy_(copy)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def trace_model(
    model: nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    measure_time: bool = False,
    warmup: int = 1,
) -> TraceResult:
    """Runs ``model(*args, **kwargs)`` once under a :class:`Tracer` and returns what it recorded.

    Gradients are enabled during the pass (so that saved tensors can be counted) but no activation is
    kept. With ``measure_time`` on CPU or CUDA, ``warmup`` untraced passes run first (under ``no_grad``)
    so that one-time costs do not land on the first modules. The model's buffers and the random number
    generators are left as they were.
    """
    if not isinstance(model, nn.Module):
        raise TracingError(f"trace_model got {type(model).__name__}: expected a torch.nn.Module")
    kwargs = dict(kwargs or {})
    tracer = Tracer(model, measure_time=measure_time)
    if tracer.measures and warmup > 0:
        with _preserved_state(model), torch.no_grad():
            for _ in range(warmup):
                model(*args, **kwargs)
    with tracer, torch.enable_grad():
        model(*args, **kwargs)
    return tracer.result()
