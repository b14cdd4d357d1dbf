"""Connections of the UCX transport: endpoints opened lazily, each introducing its rank with the job's
secret (transport/auth.py), and what a peer's closed connection means.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np

from mp_comm.transport import auth
from mp_comm.transport.base import MessageTransport
from mp_comm.transport.ucx_setup import UCXConfig
from mp_comm.transport.ucx_wire import _Incoming, _SendOp

__all__ = ["UCXEndpoints"]

log = logging.getLogger("mp_comm.transport.ucx")  # the logger these messages always had


class UCXEndpoints(MessageTransport):
    """Endpoints and their authentication (the base of UCXTransport; UCX calls on its progress thread)."""

    ucx_config: UCXConfig
    rejected: int
    _ucx: Any
    _array: Any
    _worker: Any
    _listener: Any
    _secret: bytes
    _ready: bool
    _closing: bool
    _peers: list[tuple[str, int]]
    _same_node: list[bool]
    _eps: dict[int, Any]
    _ep_keep: list[Any]
    _incoming: list[_Incoming]
    _ep_errors: collections.deque[tuple[int, str]]
    _sends: list[_SendOp]
    _deferred: list[_SendOp]
    _awaiting: dict[tuple[int, int], _SendOp]

    def _on_connect(self, conn_request: Any) -> None:
        ep = self._listener.create_endpoint_from_conn_request(conn_request, self.ucx_config.error_handling)
        buf = np.zeros(auth.HELLO_BYTES, dtype=np.uint8)
        entry = _Incoming(ep, None, buf)
        ep.set_close_callback(self._on_incoming_closed, cb_args=(entry,))
        entry.hello = ep.stream_recv(self._array(buf))
        self._incoming.append(entry)

    def _on_incoming_closed(self, entry: _Incoming, *_: Any) -> None:
        if not self._closing:
            self._ep_errors.append((entry.rank, "its connection to this rank closed"))

    def _on_outgoing_closed(self, rank: int, *_: Any) -> None:
        if not self._closing:
            self._ep_errors.append((rank, "this rank's connection to it closed"))

    def _endpoint(self, rank: int) -> Any:
        ep = self._eps.get(rank)
        if ep is None:
            host, port = self._peers[rank]
            ep = self._ucx.UCXEndpoint.create(self._worker, host, port, self.ucx_config.error_handling)
            ep.set_close_callback(self._on_outgoing_closed, cb_args=(rank,))
            hello = np.frombuffer(bytearray(auth.hello(self._secret, self.rank)), dtype=np.uint8)
            self._ep_keep.append((ep.stream_send(self._array(hello)), hello))
            self._eps[rank] = ep
        return ep

    def _check_hellos(self) -> bool:
        worked = False
        if not self._ready:
            return worked  # the secret that checks them comes with the addresses
        for entry in self._incoming:
            if entry.rank < 0 and entry.hello is not None and entry.hello.completed:
                entry.hello.check_error()
                rank = auth.open_hello(self._secret, entry.hello_buf.tobytes())
                entry.hello = None
                worked = True
                if rank is None or not 0 <= rank < self.size:
                    self.rejected += 1
                    log.error(
                        "rank %d: refused a connection that did not introduce itself with the job's secret "
                        "(a process outside the job reached this rank's UCX port)",
                        self.rank,
                    )
                    continue
                entry.rank = rank
        return worked

    def _handle_ep_errors(self) -> bool:
        if not self._ep_errors:
            return False
        while self._ep_errors:
            rank, why = self._ep_errors.popleft()
            if rank < 0:
                log.warning(
                    "rank %d: a connection from a rank that had not introduced itself closed", self.rank
                )
                continue
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
            "(a process outside the job reached this rank's UCX port)",
            self.rank,
            what,
            claimed,
        )
