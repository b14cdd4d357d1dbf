"""Fast mode on the server: tensors handed straight from one module's owner to the next one's
(mp_pipeline.fast), local waits for work of this rank, and posted calls (mp_pipeline.posted)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_pipeline.messages import TAG, Handoff, Request, Response
from mp_pipeline.server_base import _Slot
from mp_pipeline.timeline import RECORDER, EventKind
from mp_pipeline.wire import Wire

__all__ = ["Handoffs"]


class Handoffs(Wire):
    def post(self, dest: int, request: Request, check: Callable[[Response], None]) -> None:
        """Fast mode: send ``request`` without waiting for its response, whose content the requester
        predicted from earlier steps; ``check`` runs on the response when it arrives (it raises on a
        failure or a wrong prediction). The step ends only after every posted request is answered."""
        self._posted[request.request_id] = check
        self.stats["posted"] += 1
        if RECORDER.enabled:
            now = RECORDER.now()
            self._record(EventKind.REQUEST, request, dest, now, now)
        self._send_flow(dest, request, request)

    def hand(self, dest: int, key: tuple[str, int, int, int], tensor: torch.Tensor) -> None:
        """Fast mode: give ``tensor`` to rank ``dest`` (this rank too) for the request that will name
        ``key`` (see mp_pipeline.fast)."""
        self.stats["handoffs"] += 1
        if dest == self.rank:
            # the consumer here may already wait for it: its request was posted before this one ended
            waiter = self._awaited.pop(key, None)
            if waiter is None:
                self._handed[key] = tensor
            else:
                waiter.handed = tensor
                self._ready.append(waiter)
        elif not self.closed:
            self.stats["tensor_bytes"] += tensor.nbytes
            self._sends.append(self.transport.send(Handoff(self.step, key, tensor), dest, TAG))

    def take(self, key: tuple[str, int, int, int]) -> torch.Tensor:
        """Fast mode: the tensor handed over under ``key``, waiting for it (the rank serves other work
        meanwhile): it comes from another rank than the request that names it, in no fixed order."""
        found = self._handed.pop(key, None)
        if found is not None:
            return found
        slot = _Slot()
        self._awaited[key] = slot
        self.pause(slot)
        assert slot.handed is not None
        return slot.handed

    def await_local(self, key: tuple[str, int, int, int]) -> None:
        """Fast mode: wait (the rank serves other work meanwhile) until this rank's own work calls
        :meth:`wake` with ``key``."""
        slot = _Slot()
        self._awaited[key] = slot
        self.pause(slot)

    def wake(self, key: tuple[str, int, int, int]) -> None:
        """Resume the thread that waits for ``key`` in :meth:`await_local`, if any."""
        waiter = self._awaited.pop(key, None)
        if waiter is not None:
            self._ready.append(waiter)
