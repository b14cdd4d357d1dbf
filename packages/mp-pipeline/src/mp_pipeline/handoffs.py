"""Fast mode on the server: tensors handed straight from one module's owner to the next one's
(mp_pipeline.fast), local waits for work of this rank, and posted calls with their acknowledgements
(mp_pipeline.posted)."""

from __future__ import annotations

import torch

from mp_pipeline.messages import TAG, Handoff, PostedAck, PostedSync, Request, Response
from mp_pipeline.posted import PostedCheck, digest, shape_of
from mp_pipeline.server_base import _Slot
from mp_pipeline.timeline import RECORDER, EventKind
from mp_pipeline.wire import Wire

__all__ = ["Handoffs"]


class Handoffs(Wire):
    def post(self, dest: int, request: Request, check: PostedCheck) -> None:
        """Fast mode: send ``request`` without waiting for its response, whose content the requester
        predicted from earlier steps. On pp_rank 0 (the driver) the owner sends no response unless the
        call fails or returns data; its digest comes in the owner's :class:`PostedAck` (see
        :meth:`sync_posted`). Elsewhere the response comes back. ``check`` runs on either (it raises on a
        failure or a wrong prediction). The step ends only after every posted request is answered."""
        quiet = self._driver is not None and check.digest is not None
        request.posted = quiet
        self._posted[request.request_id] = (dest, check)
        if quiet:
            self._posted_to[dest] = self._posted_to.get(dest, 0) + 1
        if self.replay is not None and self.replay.recording:
            self.replay.record(dest, request, quiet)
        self.stats["posted"] += 1
        if RECORDER.enabled:
            now = RECORDER.now()
            self._record(EventKind.REQUEST, request, dest, now, now)
        self._send_flow(dest, request, request)

    def sync_posted(self) -> None:
        """pp_rank 0, its tasks done: ask each owner of posted calls not acknowledged yet for its
        acknowledgement once it has run as many as were posted to it (once per count)."""
        for dest, count in self._posted_to.items():
            if self._synced.get(dest) != count:
                self._synced[dest] = count
                self.send(dest, PostedSync(self.step, self.rank, count))

    def _acknowledged(self, message: PostedAck) -> None:
        """pp_rank 0: check each acknowledged call's digest against its prediction."""
        self.stats["acks"] += 1
        for request_id, got in message.done:
            entry = self._posted.pop(request_id, None)
            if entry is not None:
                entry[1].acked(got)

    def _sync_wanted(self, message: PostedSync) -> None:
        """Owner: acknowledge ``message.count`` posted calls of its requester once they have run."""
        self._ack_wanted[message.requester] = message.count
        self._maybe_ack(message.requester)

    def _answer_quietly(self, request: Request, response: Response) -> bool:
        """Owner: whether ``response`` (no failure) to pp_rank 0 is not sent as a message of the flow.
        A data-free one carries its digest (awaited: sent in full, outside static mode's recording, which
        must be the same whether or not the call is posted) or is only acknowledged (posted)."""
        if request.requester != self.peers[0]:
            return False
        shape = shape_of(response)
        if shape is None:
            if request.posted:  # data after all: sent (the requester finds the flow change), listed as such
                self._ran_posted(request, None)
            return False
        if request.posted:
            self._ran_posted(request, digest(shape))
        else:
            response.digest = digest(shape)
            self.send(request.requester, response)
        return True

    def _ran_posted(self, request: Request, fingerprint: int | None) -> None:
        requester = request.requester
        self._acks.setdefault(requester, []).append((request.request_id, fingerprint))
        self._ran[requester] = self._ran.get(requester, 0) + 1
        self._maybe_ack(requester)

    def _maybe_ack(self, requester: int) -> None:
        wanted = self._ack_wanted.get(requester)
        if wanted is not None and self._ran.get(requester, 0) >= wanted:
            del self._ack_wanted[requester]
            done = tuple(self._acks.pop(requester, ()))
            self.send(requester, PostedAck(self.step, done))

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
            self.count_sent("Handoff")
            self._sends.append(self.transport.send(Handoff(self.step, key, tensor), dest, TAG))

    def take(self, key: tuple[str, int, int, int]) -> torch.Tensor:
        """Fast mode: the tensor handed over under ``key``, waiting for it (the rank serves other work
        meanwhile): it comes from another rank than the request that names it, in no fixed order."""
        found = self._handed.pop(key, None)
        if found is None:
            found = self._handoff_in_place(key)
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
