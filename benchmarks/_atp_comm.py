"""Measure the communication of an ATP layer from outside it (helper of ``atp_meshes.py``).

:class:`CommProbe` wraps ``torch.distributed``'s collective entry points (``all_reduce``,
``all_gather_into_tensor``, ``all_to_all_single``, ...) while it is active. ATP and ``mp_comm`` call
them as ``dist.<name>`` at call time, so the wrappers see every collective the layer issues without any
change to the library. Each wrapper

* adds the time the calling thread spends *blocked* in communication to ``blocked``: the whole call
  for a synchronous collective, the launch plus every ``Work.wait()`` for an asynchronous one (the
  returned ``Work`` is wrapped to time its ``wait``), so communication that overlaps computation is not
  counted, only what the rank actually waits for;
* while recording, keeps the call itself: the function, its arguments with every tensor replaced by a
  zero tensor of the same shape and dtype, its process group, and a category (which part of the layer
  issued it).

:class:`Replay` then issues the recorded collectives again, in the same order, with the same sizes and
the same groups, synchronously and with no computation between them: the communication time of one
layer step on its own, the quantity equation 2 models.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

#: ``torch.distributed`` functions wrapped while a probe is active.
WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_to_all_single",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "batch_isend_irecv",
)

#: Categories of the layer's collectives.
LINEAR = "linear all-reduce"  # f1-f4 in ATPLinear (mp_tensor.atp.overlap): what equation 2 counts
LAYERNORM = "layernorm all-reduce"  # ATPLayerNorm's two moments, forward and backward
ATTENTION = "attention scatter/gather"  # heads scattered/gathered over axis 2 around the core
CATEGORIES = (LINEAR, LAYERNORM, ATTENTION)


def _category(name: str) -> str:
    """Which part of the layer issued the collective being wrapped (from the caller's stack)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith("mp_tensor/atp/overlap.py"):
            return LINEAR
        frame = frame.f_back
    return LAYERNORM if name == "all_reduce" else ATTENTION


def _zeros_like(value: Any) -> Any:
    """``value`` with every tensor (also in lists and P2P ops) replaced by zeros of its shape."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, list | tuple):
        return type(value)(_zeros_like(v) for v in value)
    if isinstance(value, dist.P2POp):
        return dist.P2POp(value.op, torch.zeros_like(value.tensor), value.peer, value.group)
    return value


@dataclass(frozen=True)
class RecordedCall:
    """One collective as the layer issued it, with zero tensors of its shapes."""

    name: str
    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    category: str

    @property
    def nbytes(self) -> int:
        """Bytes this rank contributes (the input tensor: first argument of an all-reduce, else second)."""
        index = 0 if self.name == "all_reduce" else 1
        message = self.args[index] if len(self.args) > index else None
        if isinstance(message, torch.Tensor):
            return message.numel() * message.element_size()
        return 0

    def run(self) -> None:
        """Issue the collective synchronously."""
        kwargs = dict(self.kwargs)
        if "async_op" in kwargs:
            kwargs["async_op"] = False
        result = self.function(*self.args, **kwargs)
        if isinstance(result, list):  # batch_isend_irecv
            for work in result:
                work.wait()


class _TimedWork:
    """A ``dist.Work`` whose ``wait`` counts as blocked time of its probe."""

    def __init__(self, work: Any, probe: CommProbe) -> None:
        self._work, self._probe = work, probe

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._probe.blocked += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommProbe:
    """Times and records the collectives issued through ``torch.distributed`` while :meth:`active`."""

    def __init__(self) -> None:
        self.blocked = 0.0
        """Seconds this thread spent blocked in collectives while active."""
        self.recording: list[RecordedCall] | None = None

    def _wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.recording is not None:
                self.recording.append(
                    RecordedCall(name, function, _zeros_like(args), _zeros_like(kwargs), _category(name))
                )
            start = time.perf_counter()
            try:
                result = function(*args, **kwargs)
            finally:
                self.blocked += time.perf_counter() - start
            if result is None:
                return None
            if isinstance(result, list):
                return [_TimedWork(w, self) for w in result]
            return _TimedWork(result, self)

        return wrapper

    @contextlib.contextmanager
    def active(self) -> Iterator[CommProbe]:
        """Wrap the collectives for the duration of the block."""
        originals = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}
        for name, function in originals.items():
            setattr(dist, name, self._wrap(name, function))
        try:
            yield self
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)

    def record(self, step: Callable[[], object]) -> list[RecordedCall]:
        """The collectives one call of ``step`` issues, in order."""
        self.recording = []
        try:
            with self.active():
                step()
            return self.recording
        finally:
            self.recording = None


class Replay:
    """The recorded collectives of one step, issued back to back; times each category."""

    def __init__(self, calls: list[RecordedCall]) -> None:
        self.calls = calls

    def run(self) -> dict[str, float]:
        """Seconds spent per category in one replay (this rank)."""
        spent = dict.fromkeys(CATEGORIES, 0.0)
        for call in self.calls:
            start = time.perf_counter()
            call.run()
            spent[call.category] += time.perf_counter() - start
        return spent

    def summary(self) -> dict[str, dict[str, int]]:
        """Count and bytes (this rank) of the calls per category."""
        out = {c: {"calls": 0, "bytes": 0} for c in CATEGORIES}
        for call in self.calls:
            out[call.category]["calls"] += 1
            out[call.category]["bytes"] += call.nbytes
        return out
