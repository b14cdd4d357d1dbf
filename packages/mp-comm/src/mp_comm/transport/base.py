"""What every message transport shares.

:class:`MessageTransport` implements the interface (:mod:`mp_comm.transport.interface`, re-exported
here with the settings of :mod:`mp_comm.transport.config`) above a transport-specific `_submit`,
which hands an outgoing message to the transport's progress thread; transports deliver complete
messages into a :class:`Mailbox`.
"""

from __future__ import annotations

import abc
import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mp_comm.buffers import HostPool
from mp_comm.errors import (
    MessageDecodeError,
    PeerLostError,
    TransportClosedError,
    TransportError,
)
from mp_comm.message import (
    DeviceMap,
    Header,
    MetaCacheReceiver,
    MetaCacheSender,
    Tag,
    TensorMeta,
    allocate,
    default_device_map,
    encode_object,
    finish_tensors,
    inline_payloads,
    land_inline,
    pack_header,
    wire_tensors,
)
from mp_comm.transport.config import POOL_MIN_BYTES, TransportConfig
from mp_comm.transport.interface import Received, SendHandle, Transport, rebuild
from mp_comm.transport.mailbox import ANY_SOURCE, ANY_TAG, Arrival, Mailbox

__all__ = [  # the interface and the config too: transports and routers import them from here
    "ANY_SOURCE",
    "ANY_TAG",
    "POOL_MIN_BYTES",
    "Arrival",
    "Mailbox",
    "MessageTransport",
    "Outgoing",
    "Received",
    "SendHandle",
    "Transport",
    "TransportConfig",
    "rebuild",
]

log = logging.getLogger(__name__)


class OrderCounter:
    """Per-destination order numbers of one sender; shared by the transports of a router."""

    def __init__(self) -> None:
        self._counters: dict[int, Iterator[int]] = {}
        self._lock = threading.Lock()

    def next(self, dest: int) -> int:
        with self._lock:
            counter = self._counters.get(dest)
            if counter is None:
                counter = self._counters[dest] = itertools.count()
            return next(counter)


@dataclass(slots=True)
class Outgoing:
    """A message on its way out, as a transport's progress thread receives it."""

    dest: int
    tag: Tag
    order: int
    wire: int
    body: bytes
    metas: tuple[TensorMeta, ...]
    tensors: list[torch.Tensor]
    """The wire tensors (dense, detached), parallel to `metas`."""
    handle: SendHandle
    send_metas: bool
    slot: int
    channel: int = 0

    def header(self, extra: tuple[Any, ...] = (), inline_limit: int = 0) -> tuple[bytes, frozenset[int]]:
        """The encoded header, and the indices of the tensors it carries inline."""
        inline, blob = inline_payloads(self.tensors, self.metas, inline_limit)
        raw = pack_header(
            self.tag,
            self.order,
            self.wire,
            self.body,
            metas=self.metas if self.send_metas else None,
            slot=self.slot,
            channel=self.channel,
            extra=extra,
            inline=inline,
            blob=blob,
        )
        return raw, frozenset(inline)


class MessageTransport(Transport):
    """The common half of the transports: encoding, static mode, ordering, the mailbox.

    Subclasses implement `_submit` (hand an Outgoing to the progress thread; called with the send lock
    held, so that a transport's headers leave in the order their metadata-cache decisions were made)
    and `_shutdown`.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        config: TransportConfig,
        mailbox: Mailbox | None = None,
        orders: OrderCounter | None = None,
        device_map: DeviceMap = default_device_map,
    ) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self.mailbox = mailbox if mailbox is not None else Mailbox()
        self._orders = orders if orders is not None else OrderCounter()
        self.device_map = device_map
        self._send_lock = threading.Lock()
        self._wires: dict[int, int] = {}
        self._meta_out = MetaCacheSender(config.static_slots)
        self.meta_in = MetaCacheReceiver()
        self.pool = (
            HostPool(config.recv_pool_bytes, min_bytes=POOL_MIN_BYTES) if config.recv_pool_bytes else None
        )
        """Recycled host memory for received CPU tensors (None when TransportConfig turns it off)."""
        self._landing: dict[torch.device, Any] = {}  # per CUDA device: see landing_stream
        self._cuda = torch.cuda.is_available()  # else CUDA tensors arrive on the CPU (default_device_map)
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        """Counters for tests and debugging: "sent", "received", "static_hits" and transport-specific ones."""
        self._sinks: dict[int, Callable[[int, Header, list[torch.Tensor]], None]] = {}
        self.busy = False
        """Whether the rank is marked as computing (`set_busy`)."""

    # -- the interface -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def set_busy(self, busy: bool) -> None:
        self.busy = busy

    def send(self, obj: object, dest: int, tag: Tag = 0, *, static: bool | None = None) -> SendHandle:
        return self._send(obj, dest, tag, static=static, channel=0)

    def recv(self, source: int = ANY_SOURCE, tag: object = ANY_TAG, timeout: float | None = None) -> Received:
        if self._closed:
            raise TransportClosedError(f"recv on the closed {self.name} transport of rank {self.rank}")
        if source != ANY_SOURCE:
            self.check_rank(source, "source")
        limit = self.config.timeout if timeout is None else timeout
        drive = self.drive if self.drives_progress else None
        arrival = self.mailbox.take(source, tag, limit, drive=drive, config=self.config)
        return rebuild(arrival, self.rank)

    # -- for subclasses and routers ------------------------------------------------------------------

    def check_rank(self, rank: int, what: str) -> None:
        """Raise ValueError unless ``rank`` (the argument named ``what``) is a rank of this world."""
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(
                f"{what}={rank!r}; expected a rank in [0, {self.size}) on this {self.name} transport"
            )

    def _send(self, obj: object, dest: int, tag: Tag, *, static: bool | None, channel: int) -> SendHandle:
        self.check_send(dest, tag)
        body, tensors = encode_object(obj)
        return self.send_encoded(body, tensors, dest, tag, static=static, channel=channel)

    def check_send(self, dest: int, tag: Tag) -> None:
        """Raise the error a send to ``dest`` with ``tag`` would raise before encoding anything."""
        if self._closed:
            raise TransportClosedError(f"send on the closed {self.name} transport of rank {self.rank}")
        self.check_rank(dest, "dest")
        try:
            hash(tag)
        except TypeError:
            raise ValueError(f"tag={tag!r} is not hashable; use an int, a str or a tuple of those") from None

    def send_encoded(
        self,
        body: bytes,
        tensors: list[torch.Tensor],
        dest: int,
        tag: Tag,
        *,
        static: bool | None,
        channel: int = 0,
    ) -> SendHandle:
        """Send an object already encoded by `encode_object` (a router encodes once to choose a route)."""
        if self._closed:
            raise TransportClosedError(f"send on the closed {self.name} transport of rank {self.rank}")
        wires, metas_list = wire_tensors(tensors)
        wires = self._stage(wires)
        metas = tuple(metas_list)
        use_static = self.config.static_shapes if static is None else static
        handle = SendHandle(dest, tag, self.config.timeout)
        order = self._orders.next(dest) if channel == 0 else -1
        with self._send_lock:
            wire = self._wires.get(dest, 0)
            self._wires[dest] = wire + 1
            if use_static and channel == 0:
                slot, hit = self._meta_out.lookup(dest, tag, metas)
                if hit:
                    self.stats["static_hits"] += 1
            else:
                slot, hit = -1, False
            self.stats["sent"] += 1
            out = Outgoing(dest, tag, order, wire, body, metas, wires, handle, not hit, slot, channel)
            self._submit(out)
        self.drive()  # post it from this thread when the progress thread is not at it already
        return handle

    def register_channel(self, channel: int, sink: Callable[[int, Header, list[torch.Tensor]], None]) -> None:
        """Deliver messages of an internal `channel` (> 0) to `sink(source, header, tensors)` instead of the
        mailbox; `sink` runs on the progress thread and must not block."""
        if channel <= 0:
            raise ValueError(f"channel={channel}; internal channels are positive (0 is the user's)")
        self._sinks[channel] = sink

    def send_channel(self, obj: object, dest: int, channel: int, tag: Tag = 0) -> SendHandle:
        """Send on an internal channel (see `register_channel`); never seen by `recv`."""
        if channel <= 0:
            raise ValueError(f"channel={channel}; internal channels are positive (0 is the user's)")
        return self._send(obj, dest, tag, static=False, channel=channel)

    def _arrived(
        self, source: int, header: Header, tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...]
    ) -> None:
        """A message is complete: to its channel's sink, or into the mailbox."""
        done = finish_tensors(tensors, metas)
        if self._cuda:
            for t in done:
                if t.is_cuda:  # consumers use it on the default stream: its memory waits for them when freed
                    t.record_stream(torch.cuda.default_stream(t.device))
        self.stats["received"] += 1
        if header.channel != 0:
            sink = self._sinks.get(header.channel)
            if sink is None:
                log.error(
                    "rank %d: message on unknown channel %d from rank %d dropped",
                    self.rank,
                    header.channel,
                    source,
                )
                return
            sink(source, header, done)
            return
        self.mailbox.deliver(Arrival(source, header.tag, header.order, header.body, done))

    def _prepare_arrival(
        self, source: int, header: Header
    ) -> tuple[tuple[TensorMeta, ...], list[torch.Tensor]] | None:
        """The metadata and landed buffers of an arriving message; None (and its waiter failed) if not.

        Resolves the tensor metadata (from the header or the static-mode cache), allocates the receive
        buffers and copies the payloads that travelled inside the header.
        """
        try:
            metas = self.meta_in.resolve(source, header)
            tensors = self._allocate(source, header, metas)
            if header.inline:
                self._land_inline(header, metas, tensors)
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, MessageDecodeError)
                else MessageDecodeError(
                    f"the message from rank {source} with tag {header.tag!r} cannot be received on rank "
                    f"{self.rank}: {type(exc).__name__}: {exc}",
                    peer=source,
                )
            )
            self.mailbox.fail_peer(source, error)
            self._arrival_failed(source, header, error)
            return None
        return metas, tensors

    def _land_inline(
        self, header: Header, metas: tuple[TensorMeta, ...], tensors: list[torch.Tensor]
    ) -> None:
        """Copy the payloads that travelled in the header. Into CUDA tensors on the landing stream,
        waited for before delivery: on the default stream the copy would wait for every kernel queued
        there (a pipeline stage's compute) before the message could be delivered."""
        device = next((t.device for t in tensors if t.is_cuda), None) if self._cuda else None
        if device is None:
            land_inline(header, metas, tensors)
            return
        stream = self.landing_stream(device)
        with torch.cuda.stream(stream):
            land_inline(header, metas, tensors)
        stream.synchronize()

    def _allocate(self, source: int, header: Header, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
        """The tensors an arriving message lands in (a transport may have made them ahead of time).

        CUDA tensors come from the landing stream's memory: their bytes are written outside the
        default stream (by a copy on the landing stream, or by UCX), and memory of the default stream
        may still be read by kernels queued there, which only work on that stream waits for.
        """
        if self._cuda and any(m.device == "cuda" for m in metas):
            with torch.cuda.stream(self.landing_stream(torch.device("cuda", torch.cuda.current_device()))):
                return allocate(metas, self.device_map, self.pool)
        return allocate(metas, self.device_map, self.pool)

    def landing_stream(self, device: torch.device) -> Any:
        """The CUDA stream that received tensors of `device` are allocated and copied on."""
        stream = self._landing.get(device)
        if stream is None:
            stream = self._landing[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _land(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (destination, source) pair. Pairs that touch a GPU run on its landing stream, then
        only that stream is waited for: on the default stream a copy would wait for every kernel queued
        there (a pipeline stage's compute), and synchronizing the device would too."""
        on_gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            if dst.is_cuda or src.is_cuda:
                on_gpu.setdefault(dst.device if dst.is_cuda else src.device, []).append((dst, src))
            else:
                dst.copy_(src)
        for device, copies in on_gpu.items():
            stream = self.landing_stream(device)
            with torch.cuda.stream(stream):
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()

    def _arrival_failed(self, source: int, header: Header, error: BaseException) -> None:
        if header.channel == 0:
            self.mailbox.deliver(Arrival(source, header.tag, header.order, error=error))
        else:
            log.error("rank %d: internal message from rank %d failed: %s", self.rank, source, error)

    def _fail_all(self, error: BaseException) -> None:
        self.mailbox.fail(error)

    drives_progress = False
    """Whether threads waiting in `recv` (and `send`) make progress themselves through `drive`."""

    def drive(self) -> bool:
        """Make progress from the calling thread if no other thread is; whether any work was done."""
        return False

    def _stage(self, wires: list[torch.Tensor]) -> list[torch.Tensor]:
        """Prepare the wire tensors in the caller's thread, before the send lock (e.g. copy to host)."""
        return wires

    @abc.abstractmethod
    def _submit(self, out: Outgoing) -> None:
        """Hand `out` to the progress thread (called with the send lock held; must not block)."""

    def _wrap_error(self, what: str, exc: BaseException, peer: int | None) -> TransportError:
        who = f" with rank {peer}" if peer is not None else ""
        return TransportError(
            f"{self.name} transport of rank {self.rank}: {what}{who} failed: {exc}", peer=peer
        )

    def _lost(self, peer: int, why: str) -> PeerLostError:
        return PeerLostError(
            f"rank {peer} is unreachable from rank {self.rank} over {self.name}: {why}", peer=peer
        )
