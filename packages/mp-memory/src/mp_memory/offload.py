"""Activation offloading: the inputs that checkpointed modules keep move to host memory after their
forward and are loaded back ahead of their backward (smp's ``offload_activations``).

A checkpointed module keeps only its inputs (``torch.utils.checkpoint`` saves them before its own
saved-tensor hooks take over), so an :class:`Offloader`'s ``torch.autograd.graph.saved_tensors_hooks``
pushed around the checkpoint call see exactly those inputs. ``pack`` copies each one to host memory and
lets autograd drop the device tensor; ``unpack`` returns the copy loaded back.

Loading is scheduled by task, where a task is one microbatch's backward on this rank (smp: "the
activations for a particular microbatch are fetched before the backward execution for that
microbatch", ``activation_loading_horizon`` tasks ahead). Backward tasks are expected in microbatch
order (the order of mp's schedules): when the backward of microbatch j starts here (its first unpack),
the activations of microbatches up to ``j + horizon`` are loaded, so microbatch k's load is issued when
backward k - horizon starts (the first ``horizon`` ones with backward 0). Activations packed for a
microbatch whose load was already issued stay on the device. A backward out of that order is still
correct: its unpack issues its own load.

On CUDA the copies run on a side stream (one per device) into pinned host memory, so they overlap the
compute stream; the compute stream waits on an event only where it uses a loaded tensor. Elsewhere (a
CPU-only machine) the target is a separate host buffer, so the same scheduling runs and can be tested:
:attr:`Offloader.events` records, for the last step, each offload, each backward start and each load.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Offloader", "activate", "active", "offloading"]

TaskKey = tuple[int, int]
"""(step, microbatch) of the calling thread's task."""


@dataclass(eq=False, slots=True)
class _Packed:
    """One saved tensor: kept on its device, or copied to host (``host``) and loaded back (``loaded``)."""

    microbatch: int
    kept: torch.Tensor | None = None
    host: torch.Tensor | None = None
    device: torch.device | None = None
    loaded: torch.Tensor | None = None
    ready: Any = None
    """CUDA: the side-stream event after which ``loaded`` (or ``host``, before loading) is complete."""


@dataclass
class _StepState:
    step: int = -1
    pending: dict[int, list[_Packed]] = field(default_factory=dict)
    """Offloaded tensors whose load is not issued yet, by microbatch, in pack order."""
    loaded_through: int = -1
    """Loads are issued for every microbatch up to this one."""
    started: set[int] = field(default_factory=set)


class Offloader:
    """Offloads checkpointed activations and loads them back ``horizon`` backward tasks ahead.

    ``task()`` says which (step, microbatch) the calling thread runs, or None outside a step: nothing is
    offloaded there (a module called outside a step has no scheduled backward)."""

    def __init__(self, horizon: int, task: Callable[[], TaskKey | None]) -> None:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon={horizon!r}; expected an int >= 1")
        self.horizon = horizon
        self._task = task
        self._lock = threading.Lock()
        self._state = _StepState()
        self._streams: dict[torch.device, Any] = {}
        self.events: list[tuple[str, int]] = []
        """This step's events in order: ("offload", mb) per tensor copied to host, ("keep", mb) per
        tensor left on its device because its load was already due, ("backward", mb) when a microbatch's
        backward starts here, ("load", mb) when the loads of a microbatch are issued."""
        self.offloaded_bytes = 0
        """Bytes copied to host in this step."""

    # ------------------------------------------------------------------------------------------- hooks
    def saving(self) -> contextlib.AbstractContextManager[None]:
        """The saved-tensor hooks to run a checkpoint call under (a no-op outside a step)."""
        if self._task() is None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Packed:
        key = self._task()
        # empty tensors too: checkpoint's own zero-size marker is saved here on some torch versions
        if key is None or isinstance(t, nn.Parameter) or t.device.type == "meta" or t.numel() == 0:
            return _Packed(-1, kept=t)
        step, mb = key
        with self._lock:
            st = self._begin(step)
            if mb <= st.loaded_through:  # its load is already due: leave it where it is
                self.events.append(("keep", mb))
                return _Packed(mb, kept=t)
            packed = self._to_host(t, mb)
            st.pending.setdefault(mb, []).append(packed)
            self.events.append(("offload", mb))
            self.offloaded_bytes += t.numel() * t.element_size()
            return packed

    def _unpack(self, p: _Packed) -> torch.Tensor:
        if p.microbatch < 0:  # never scheduled
            assert p.kept is not None
            return p.kept
        with self._lock:
            st = self._state
            if p.microbatch not in st.started:  # this microbatch's backward starts here
                st.started.add(p.microbatch)
                self.events.append(("backward", p.microbatch))
                self._load_through(max(st.loaded_through, p.microbatch + self.horizon))
            if p.kept is not None:
                return p.kept
            if p.loaded is None:  # not scheduled in this step (e.g. a graph kept from an earlier one)
                self._load(p)
        assert p.loaded is not None
        if p.ready is not None:  # CUDA: the compute stream waits only for this tensor's copy
            stream = torch.cuda.current_stream(p.loaded.device)
            stream.wait_event(p.ready)
            p.loaded.record_stream(stream)
        return p.loaded

    # ---------------------------------------------------------------------------------------- schedule
    def _begin(self, step: int) -> _StepState:
        """The state of ``step``; a new step starts afresh (what a step left unused is dropped)."""
        if self._state.step != step:
            self._state = _StepState(step)
            self.events = []
            self.offloaded_bytes = 0
        return self._state

    def _load_through(self, last: int) -> None:
        """Issue the loads of every pending microbatch up to ``last``, the nearest first; within one, in
        reverse pack order (backward needs the last-packed input first)."""
        st = self._state
        st.loaded_through = last
        for mb in sorted(m for m in st.pending if m <= last):
            self.events.append(("load", mb))
            for p in reversed(st.pending.pop(mb)):
                self._load(p)

    # ------------------------------------------------------------------------------------------ copies
    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _to_host(self, t: torch.Tensor, mb: int) -> _Packed:
        if t.device.type != "cuda":  # host to host: a separate buffer stands in for host memory
            return _Packed(mb, host=t.detach().clone(), device=t.device)
        side = self._side_stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is complete on the compute stream
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(side)  # the allocator keeps t's memory until the copy is done
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(side)
        return _Packed(mb, host=host, device=t.device, ready=ready)

    def _load(self, p: _Packed) -> None:
        assert p.host is not None and p.device is not None
        if p.device.type != "cuda":
            p.loaded = p.host.clone()
            return
        side = self._side_stream(p.device)
        with torch.cuda.stream(side):  # after the offload copy: same stream
            p.loaded = p.host.to(p.device, non_blocking=True)
        p.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        p.ready.record(side)


# ---------------------------------------------------------------------------------- the active one
_ACTIVE: list[Offloader | None] = [None]


def activate(offloader: Offloader | None) -> None:
    """Make ``offloader`` the one every checkpoint call uses (None: offloading off)."""
    _ACTIVE[0] = offloader


def active() -> Offloader | None:
    """The offloader checkpoint calls use now, if any."""
    return _ACTIVE[0]


@contextlib.contextmanager
def offloading() -> Iterator[None]:
    """Run a checkpoint call under the active offloader's hooks (nothing without one)."""
    offloader = _ACTIVE[0]
    if offloader is None:
        yield
        return
    with offloader.saving():
        yield
