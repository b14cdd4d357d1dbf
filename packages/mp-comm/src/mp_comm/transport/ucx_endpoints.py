"""Connections of the UCX transport: endpoints created from the peers' worker addresses (no listener),
opened lazily, each introducing its rank with the job's secret (transport/auth.py), and what a peer's
closed connection means.

A rank's first message on a new endpoint is a sealed hello (a HELLO tag message). The peer checks it
and opens its own endpoint back to that rank's worker address, as given by the bootstrap (never taken
from the message), so that it sees the rank go away even if it never sends to it.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np

from mp_comm.transport import auth
from mp_comm.transport.base import MessageTransport
from mp_comm.transport.ucx_setup import UCXConfig
from mp_comm.transport.ucx_wire import _HELLO, _SendOp, _tag

__all__ = ["UCXEndpoints"]

log = logging.getLogger("mp_comm.transport.ucx")  # the logger these messages always had


class UCXEndpoints(MessageTransport):
    """Endpoints and their authentication (the base of UCXTransport; UCX calls on its progress thread)."""

    ucx_config: UCXConfig
    rejected: int
    _ucx: Any
    _array: Any
    _worker: Any
    _secret: bytes
    _ready: bool
    _closing: bool
    _peers: list[bytes]
    _same_node: list[bool]
    _eps: dict[int, Any]
    _ep_keep: list[Any]
    _ep_errors: collections.deque[tuple[int, str]]
    _sends: list[_SendOp]
    _deferred: list[_SendOp]
    _awaiting: dict[tuple[int, int], _SendOp]

    def _on_outgoing_closed(self, rank: int, *_: Any) -> None:
        if not self._closing:
            self._ep_errors.append((rank, "this rank's connection to it closed"))

    def _endpoint(self, rank: int) -> Any:
        ep = self._eps.get(rank)
        if ep is None:
            ucx = self._ucx
            address = ucx.UCXAddress.create_from_buffer(np.frombuffer(self._peers[rank], dtype=np.uint8))
            errors = self.ucx_config.error_handling
            ep = ucx.UCXEndpoint.create_from_worker_address(self._worker, address, errors)
            ep.set_close_callback(self._on_outgoing_closed, cb_args=(rank,))
            hello = np.frombuffer(bytearray(auth.hello(self._secret, self.rank)), dtype=np.uint8)
            tag = ucx.UCXXTag(_tag(_HELLO, self.rank, 0))
            self._ep_keep.append((ep.tag_send(self._array(hello), tag), hello))
            self._eps[rank] = ep
        return ep

    def _on_hello(self, source: int, data: bytes) -> None:
        """A rank's first message to this one: open an endpoint back to it (to see it go away)."""
        rank = auth.open_hello(self._secret, data)
        if rank is None or rank != source or not 0 <= rank < self.size:
            self._refuse(source, "hello")
            return
        if rank not in self._eps and not self._closing:
            try:
                self._endpoint(rank)
            except Exception as exc:  # it went away already: its sends will say so
                log.warning("rank %d: cannot open an endpoint back to rank %d: %s", self.rank, rank, exc)

    def _handle_ep_errors(self) -> bool:
        if not self._ep_errors:
            return False
        while self._ep_errors:
            rank, why = self._ep_errors.popleft()
            error = self._lost(rank, why)
            log.error("%s", error)
            self.mailbox.fail_peer(rank, error)
            for op in [*self._sends, *self._deferred]:
                if op.out.dest == rank:
                    op.out.handle._fail(error)
            for op in self._sends:
                if op.out.dest == rank:
                    for manager, region in op.regions:
                        manager.release(region)
            self._sends = [op for op in self._sends if op.out.dest != rank]
            self._deferred = [op for op in self._deferred if op.out.dest != rank]
            self._awaiting = {k: v for k, v in self._awaiting.items() if k[0] != rank}
            self._eps.pop(rank, None)
        return True

    def _refuse(self, claimed: int, what: str) -> None:
        # Not the job's: dropped unread. The rank it claims to come from is not failed (it may be fine).
        self.rejected += 1
        log.error(
            "rank %d: dropped a %s that claims to come from rank %d but does not carry the job's MAC "
            "(a process outside the job reached this rank's UCX worker)",
            self.rank,
            what,
            claimed,
        )
