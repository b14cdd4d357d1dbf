"""Fast mode's handed-off tensors on one rank (mp_pipeline.fast), and the threads waiting for them.

A tensor handed to this rank (by another rank's :class:`~mp_pipeline.messages.Handoff`, or by this rank's
own work) is kept under its key until the request that names it takes it; a thread that wants it first
waits under that key, as does one that waits for this rank's own work (a posted forward whose output a
later request refers to). A wait that this rank's own work ends is resumed by the server's main thread
next (:attr:`HandoffStore.ready`).
"""

from __future__ import annotations

import collections

import torch

from mp_pipeline.messages import Response

__all__ = ["HandoffKey", "HandoffStore", "Waiter"]

HandoffKey = tuple[str, int, int, int]
"""(kind, requester, forward or call id, index): see mp_pipeline.fast."""


class Waiter:
    """A paused thread of the server (its baton token) and what resumes it: the response it waits for
    (Server.call) or the tensor handed over for it."""

    __slots__ = ("handed", "response")

    def __init__(self) -> None:
        self.response: Response | None = None
        self.handed: torch.Tensor | None = None


class HandoffStore:
    """One step's handed-off tensors and the waits for them, by key (see the module docstring)."""

    def __init__(self) -> None:
        self._handed: dict[HandoffKey, torch.Tensor] = {}
        """Tensors handed to this rank (or kept here) for a later request."""
        self._awaited: dict[HandoffKey, Waiter] = {}
        self.ready: collections.deque[Waiter] = collections.deque()
        """Threads whose wait this rank's own work ended (resumed by the main thread next)."""

    def put(self, key: HandoffKey, tensor: torch.Tensor) -> Waiter | None:
        """Keep ``tensor`` under ``key``; or, if a thread waits for it, give it to that thread's waiter,
        returned (the caller resumes it)."""
        waiter = self._awaited.pop(key, None)
        if waiter is None:
            self._handed[key] = tensor
        else:
            waiter.handed = tensor
        return waiter

    def pop(self, key: HandoffKey) -> torch.Tensor | None:
        """The tensor kept under ``key``, no longer kept (None: not here yet)."""
        return self._handed.pop(key, None)

    def wait(self, key: HandoffKey) -> Waiter:
        """The waiter of a thread that waits for ``key`` (paused on it by the caller)."""
        waiter = Waiter()
        self._awaited[key] = waiter
        return waiter

    def wake(self, key: HandoffKey) -> None:
        """This rank's own work ended the wait for ``key``, if any: its thread is ready to resume."""
        waiter = self._awaited.pop(key, None)
        if waiter is not None:
            self.ready.append(waiter)

    def __contains__(self, key: object) -> bool:
        """Whether a tensor is kept under ``key``."""
        return key in self._handed

    @property
    def waiting(self) -> int:
        """How many threads wait for a key."""
        return len(self._awaited)
