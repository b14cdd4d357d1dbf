"""Waiting in place: the thread that holds the rank takes the next message itself when the main thread
would do nothing else (see mp_pipeline.server's docstring)."""

from __future__ import annotations

from typing import Any

import torch

from mp_pipeline.messages import Handoff, Request, Response
from mp_pipeline.server_base import _Slot
from mp_pipeline.wire import Wire

__all__ = ["InPlace"]


class InPlace(Wire):
    def _polls_in_place(self) -> bool:
        """Whether the thread holding the rank may wait for the next message itself: the main thread
        would do nothing else (tasks become startable only through messages, which go to it)."""
        if (
            self.sequencer is not None
            or self.finished
            or self.closed
            or self._inbox
            or self._deferred
            or self._ready
        ):
            return False
        driver = self._driver
        return driver is None or not (driver.failure is not None or driver.done or driver.has_task())

    def _take_in_place(self) -> Any:
        """The next message of this step, taken by the thread holding the rank; None if it may not wait
        (or the wait failed: the main thread raises the error)."""
        if not self._polls_in_place():
            return None
        self.transport.set_busy(False)
        try:
            return self._poll(self._timeout)
        except BaseException as exc:
            self._inbox_error = exc
            return None
        finally:
            self.transport.set_busy(True)

    def _response_in_place(self, slot: _Slot) -> bool:
        """Wait for the response ``slot`` waits for in this thread; False, after handing what came instead
        to the main thread, when it must wait the usual way."""
        message = self._take_in_place()
        if message is None:
            return False
        if isinstance(message, Response) and self._pending.get(message.request_id) is slot:
            del self._pending[message.request_id]
            self.stats["responses"] += 1
            self.stats["in_place"] += 1
            slot.response = message
            return True
        self._inbox.append(message)
        return False

    def _handoff_in_place(self, key: tuple[str, int, int, int]) -> torch.Tensor | None:
        """Wait for the tensor handed over under ``key`` in this thread; None, after handing what came
        instead to the main thread, when it must wait the usual way."""
        message = self._take_in_place()
        if message is None:
            return None
        if isinstance(message, Handoff) and message.key == key:
            self.stats["in_place"] += 1
            return message.tensor
        self._inbox.append(message)
        return None

    def _request_in_place(self) -> Request | None:
        """After answering a request: the next one, if it is the next message and this thread may wait."""
        message = self._take_in_place()
        if message is None:
            return None
        if isinstance(message, Request):
            self.stats["requests"] += 1
            self.stats["in_place"] += 1
            return message
        self._inbox.append(message)
        return None
