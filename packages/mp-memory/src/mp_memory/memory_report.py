"""A rank's memory report: bytes of parameters, gradients, optimizer state and peak activations.

Parameters, gradients and optimizer state are counted from the tensors themselves when the report is
made (a tensor reached twice counts once; a sharded tensor counts its local shard). Activations are
counted while they live: an :class:`ActivationTracker` pushes ``torch.autograd.graph.saved_tensors_hooks``
that see every tensor autograd keeps for backward, and records the peak of their live bytes (a storage
kept by several saved tensors counts once; parameters and their views are not activations). Tensors
that a checkpoint does not keep (it recomputes them) or that offloading moved to host memory are not
counted: the peak is the activation memory the memory savers act on.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ActivationTracker", "MemoryReport", "tensor_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each distinct one (device, address, size) once; meta tensors count 0."""
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for tensor in tensors:
        t = _local(tensor)
        if t.device.type == "meta":
            continue
        key = (str(t.device), t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class MemoryReport:
    """One rank's memory, in bytes."""

    rank: int
    parameters: int
    """This rank's parameters (its pipeline stage, its tensor-parallel and sharded shares)."""
    gradients: int
    """Their gradients, where set."""
    optimizer_state: int
    """The optimizer's state tensors on this rank, with fp32 master weights under fp16/bf16."""
    peak_activations: int | None
    """The peak of the bytes kept for backward during the traced steps (None: not traced)."""
    device_peak: int | None = None
    """CUDA only: ``torch.cuda.max_memory_allocated`` of this rank's device (everything, all steps)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """One line, e.g. for a log."""
        text = (
            f"rank {self.rank} memory: parameters {_mib(self.parameters)}, gradients {_mib(self.gradients)}, "
            f"optimizer state {_mib(self.optimizer_state)}, peak activations {_mib(self.peak_activations)}"
        )
        if self.device_peak is not None:
            text += f", device peak {_mib(self.device_peak)}"
        return text


class _Held:
    """A saved tensor counted by the tracker until autograd releases it."""

    __slots__ = ("__weakref__", "key", "tensor", "tracker")

    def __init__(self, tracker: ActivationTracker, key: tuple[str, int], tensor: torch.Tensor) -> None:
        self.tracker = tracker
        self.key = key
        self.tensor = tensor

    def __del__(self) -> None:
        self.tracker.release(self.key)


class ActivationTracker:
    """Live and peak bytes of the tensors autograd keeps for backward, under :meth:`hooks` (module
    docstring). Thread-safe: each thread that runs forward pushes the hooks (they are per thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple[str, int], tuple[int, int]] = {}
        """storage (device, address) -> (saved tensors holding it, its bytes)."""
        self._released: collections.deque[tuple[str, int]] = collections.deque()
        """Releases not yet accounted: a finalizer only appends (atomic), so it never waits for the lock
        (it may run inside a locked region of its own thread, from the garbage collector)."""
        self._live_bytes = 0
        self._peak = 0

    @property
    def live(self) -> int:
        """Bytes kept for backward now."""
        with self._lock:
            self._drain()
            return self._live_bytes

    @property
    def peak(self) -> int:
        """The most bytes kept for backward at once since tracing (or :meth:`reset_peak`)."""
        with self._lock:
            return self._peak

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        with self._lock:
            self._drain()
            self._peak = self._live_bytes

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        with self._lock:
            self._drain()
            count, nbytes = self._live.get(key, (0, storage.nbytes()))
            if count == 0:
                self._live_bytes += nbytes
                self._peak = max(self._peak, self._live_bytes)
            self._live[key] = (count + 1, nbytes)
        return _Held(self, key, t)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: tuple[str, int]) -> None:
        """Note that the activation ``key`` was freed (from its holder's finalizer; counted later)."""
        self._released.append(key)

    def _drain(self) -> None:
        """Account the releases so far (under the lock)."""
        while self._released:
            key = self._released.popleft()
            count, nbytes = self._live[key]
            if count == 1:
                del self._live[key]
                self._live_bytes -= nbytes
            else:
                self._live[key] = (count - 1, nbytes)
