"""Saves that run in the background: the caller blocks only while the state is copied.

:class:`BackgroundSave` holds at most one save in flight. :meth:`BackgroundSave.stage` copies what a
save writes (tensors into host buffers kept from the previous save, everything else by
``copy.deepcopy``), so steps taken after it returns cannot change what is written; :meth:`start` runs
the write (the caller's function: mp's whole publication protocol) on a thread; :meth:`wait` joins it
and raises what it raised. The next :meth:`stage` waits first, so the buffers are never overwritten
while a write reads them.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BackgroundSave"]

log = logging.getLogger(__name__)


class BackgroundSave:
    """One background save at a time, with the host buffers its copies reuse."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        self._buffers: dict[str, torch.Tensor] = {}
        self.finished_at: float | None = None

    @property
    def in_flight(self) -> bool:
        """True while a started save has not been waited for."""
        return self._thread is not None

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` (nested dicts, lists and tuples) that later changes of ``obj`` leave alone.

        Tensors are copied into host memory (pinned when CUDA is available, so device tensors copy
        asynchronously; the copies are complete when this returns), reusing the buffer of the same
        place, shape and dtype from the previous call; one tensor object reached twice (tied weights)
        is copied once and stays shared. Call :meth:`wait` first (so the previous save no longer reads
        the buffers)."""
        assert self._thread is None, "stage() while a save is in flight: wait() first"
        used: dict[str, torch.Tensor] = {}
        seen: dict[int, torch.Tensor] = {}
        out = self._copy(obj, "", used, seen)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._buffers = used  # buffers of places that no longer exist are dropped
        return out

    def _copy(
        self, obj: Any, where: str, used: dict[str, torch.Tensor], seen: dict[int, torch.Tensor]
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:
                return seen[id(obj)]
            copied = self._copy_tensor(obj, where, used)
            seen[id(obj)] = copied
            return copied
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's type (OrderedDict) and attributes
            for key, value in obj.items():
                out[key] = self._copy(value, f"{where}/{key!r}", used, seen)
            return out
        if isinstance(obj, list):
            return [self._copy(v, f"{where}[{i}]", used, seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._copy(v, f"{where}({i})", used, seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_tensor(self, t: torch.Tensor, where: str, used: dict[str, torch.Tensor]) -> torch.Tensor:
        t = t.detach()
        if type(t) is not torch.Tensor or t.is_sparse or t.layout != torch.strided or t.is_quantized:
            return t.clone()  # a tensor subclass or an unusual layout: torch's own copy, no reuse
        buf = self._buffers.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t, non_blocking=t.is_cuda)
        used[where] = buf
        return buf

    def start(self, write: Callable[[], None], what: str) -> None:
        """Run ``write`` on a thread; its exception is kept for :meth:`wait`."""
        assert self._thread is None, "start() while a save is in flight: wait() first"
        self._error, self._what, self.finished_at = None, what, None

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # kept for wait(); a failed save must reach the caller
                self._error = exc
                log.error("%s failed in the background: %s: %s", what, type(exc).__name__, exc)
            finally:
                self.finished_at = time.monotonic()

        # Not a daemon: the interpreter joins it before it exits, so a save that started completes.
        self._thread = threading.Thread(target=run, name="mp-checkpoint-save", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the save in flight (if any); raise its exception, once."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def release(self) -> None:
        """Drop the host buffers (after :meth:`wait`)."""
        assert self._thread is None, "release() while a save is in flight: wait() first"
        self._buffers = {}
