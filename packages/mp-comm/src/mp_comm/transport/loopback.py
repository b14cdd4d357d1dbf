"""The in-process loopback transport: world size 1, and ranks simulated as objects in one process.

Every message takes the full path of the other transports (stubs, header bytes, metadata cache,
allocation at the receiver, payload copy, in-order delivery), so the message format and the mailbox
can be tested without processes; the copy into freshly allocated tensors is what "moving the bytes"
means here, so the receiver never shares memory with the sender. Sends complete before `send`
returns; there is no progress thread.
"""

from __future__ import annotations

import logging
import threading

from mp_comm.errors import TransportClosedError
from mp_comm.message import allocate, byte_view, decode_header, land_inline
from mp_comm.transport.base import (
    Mailbox,
    MessageTransport,
    OrderCounter,
    Outgoing,
    TransportConfig,
)

__all__ = ["LoopbackHub", "LoopbackTransport"]

log = logging.getLogger(__name__)


class LoopbackHub:
    """`size` loopback ranks living in this process; `transport(r)` is rank r's endpoint."""

    def __init__(self, size: int = 1, *, config: TransportConfig | None = None) -> None:
        if size < 1:
            raise ValueError(f"size={size}; a loopback world needs at least one rank")
        self.size = size
        self.config = config or TransportConfig()
        self._lock = threading.Lock()
        self._endpoints: dict[int, LoopbackTransport] = {}

    def transport(
        self, rank: int, *, mailbox: Mailbox | None = None, orders: OrderCounter | None = None
    ) -> LoopbackTransport:
        """Rank `rank`'s transport (created on first call; the same object afterwards)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank={rank}; expected a rank in [0, {self.size}) of this loopback hub")
        with self._lock:
            ep = self._endpoints.get(rank)
            if ep is None or ep.closed:
                ep = self._endpoints[rank] = LoopbackTransport(self, rank, mailbox=mailbox, orders=orders)
            return ep

    def peer(self, rank: int, sender: int) -> LoopbackTransport:
        """The open transport of ``rank`` (a send from ``sender`` to a closed one raises)."""
        with self._lock:
            ep = self._endpoints.get(rank)
        if ep is None or ep.closed:
            raise TransportClosedError(
                f"loopback rank {sender} sends to rank {rank}, whose transport is not open; create it "
                f"with hub.transport({rank}) first",
                peer=rank,
            )
        return ep


class LoopbackTransport(MessageTransport):
    """One rank of a :class:`LoopbackHub`. For a world of one: ``LoopbackTransport.single()``."""

    name = "loopback"

    def __init__(
        self,
        hub: LoopbackHub,
        rank: int,
        *,
        mailbox: Mailbox | None = None,
        orders: OrderCounter | None = None,
    ) -> None:
        super().__init__(rank, hub.size, config=hub.config, mailbox=mailbox, orders=orders)
        self._hub = hub
        self._recv_lock = threading.Lock()

    @classmethod
    def single(cls, *, config: TransportConfig | None = None) -> LoopbackTransport:
        """The transport of a one-rank world (sends to itself)."""
        return LoopbackHub(1, config=config).transport(0)

    def _submit(self, out: Outgoing) -> None:
        peer = self._hub.peer(out.dest, self.rank)
        try:
            peer.deliver(self.rank, out)
        except BaseException as exc:
            out.handle.set_failed(exc)
            raise
        out.handle.set_done()

    def deliver(self, source: int, out: Outgoing) -> None:
        """Receive ``out``, sent by ``source``, into this transport's mailbox."""
        # What a remote progress thread does: parse the header, allocate, land the payloads, deliver.
        raw, inline = out.header(inline_limit=self.config.inline_bytes)
        header = decode_header(raw, source=source)
        with self._recv_lock:  # one sender's headers are resolved in order, as on a wire
            metas = self.meta_in.resolve(source, header)
            tensors = allocate(metas, self.device_map, self.pool)
            land_inline(header, metas, tensors)
            for i, (dst, src, meta) in enumerate(zip(tensors, out.tensors, metas, strict=True)):
                if meta.nbytes and i not in inline:
                    byte_view(dst).copy_(byte_view(src).to(dst.device))
            self._arrived(source, header, tensors, metas)

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(TransportClosedError(f"the loopback transport of rank {self.rank} was closed"))
        log.debug("loopback rank %d closed", self.rank)
