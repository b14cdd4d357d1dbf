"""The point-to-point transport interface, and what every transport shares.

A transport moves messages (:mod:`mp_comm.message`) between the ranks of a world without any
agreement on their order: any rank sends to any rank at any time, and the receiver takes them by
(source, tag) or from any source, from as many threads as it likes::

    handle = transport.send(obj, dest, tag)        # returns at once; handle.wait() for completion
    source, tag, obj = transport.recv(source=ANY_SOURCE, tag=ANY_TAG, timeout=10.0)
    transport.close()

Guarantees: messages from one sender to one receiver are delivered in the order they were sent (also
when a router sends them over different transports); a wait never lasts past its timeout
(`TransportConfig.timeout` unless given); errors surface in the waiting thread as exceptions that
name the peer and the tag (:mod:`mp_comm.errors`).

:class:`MessageTransport` implements the interface above a transport-specific `_submit`, which hands
an outgoing message to the transport's progress thread; transports deliver complete messages into a
:class:`Mailbox`.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, NamedTuple

import torch

from mp_comm.buffers import HostPool
from mp_comm.errors import (
    MessageDecodeError,
    PeerLostError,
    PeerTimeoutError,
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
    decode_object,
    default_device_map,
    encode_object,
    finish_tensors,
    inline_payloads,
    land_inline,
    pack_header,
    wire_tensors,
)
from mp_comm.transport.mailbox import ANY_SOURCE, ANY_TAG, Arrival, Mailbox

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "Arrival",
    "Mailbox",
    "MessageTransport",
    "Outgoing",
    "Received",
    "SendHandle",
    "Transport",
    "TransportConfig",
]

log = logging.getLogger(__name__)


POOL_MIN_BYTES: Final = 4 << 20
"""Received CPU tensors from this size come from the transport's HostPool. Smaller ones are allocated
fresh: measured interleaved here, the pool's bookkeeping (~10 µs a tensor, more inside a stream) cost
1 MB streams 10-20% of their bandwidth, while malloc mostly reuses memory it has already faulted in;
from 4 MiB fresh memory's page faults cost more (16 MB messages up to 2x slower without the pool)."""


class Received(NamedTuple):
    """A received message: who sent it, its tag, and the rebuilt object."""

    source: int
    tag: Tag
    obj: Any


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Settings shared by every transport."""

    timeout: float = 300.0
    """Seconds a receive, a send handle's wait or a close waits before raising PeerTimeoutError, when the
    call gives no timeout of its own. Must be positive and finite: nothing waits forever."""
    static_shapes: bool = False
    """Static mode: a message whose (destination, tag) repeats with the same tensor metadata sends no
    metadata; the receiver reuses what it cached. Safe to leave on when shapes change: a changed
    message sends its metadata again. `send(..., static=...)` overrides it per message."""
    static_slots: int = 1024
    """Metadata cache slots per sender at each receiver (least recently used tags give theirs up)."""
    recv_pool_bytes: int = 256 << 20
    """Idle host memory kept to recycle for received CPU tensors of at least 4 MiB (`POOL_MIN_BYTES`;
    see buffers.HostPool: fresh memory that large costs a page fault per page, up to several times the
    copy); 0 turns the pool off. Tensors received into it cannot be resized in place (`resize_`)."""
    spin_time: float = 1e-3
    """Seconds a thread waiting in `recv` keeps polling (yielding the CPU between polls) after its last
    progress before it starts to nap, so that a quick reply (a ping-pong, a pipeline hand-off) is seen
    at once."""
    inline_bytes: int = 4096
    """Tensors of at most this many bytes travel inside the header instead of as messages of their
    own (one small copy instead of a message round; 0 turns it off)."""
    poll_min: float = 20e-6
    """Shortest sleep, in seconds, of a polling progress thread between rounds while it has work in
    flight or a thread waits on a receive."""
    poll_max: float = 1e-3
    """Longest sleep of a polling progress thread when nothing is in flight and nobody waits: the
    latency a message sees when it reaches an idle rank."""
    poll_busy: float = 5e-3
    """Sleep of a polling progress thread between rounds while the rank is marked busy
    (`Transport.set_busy`; the pipeline runtime marks it while a module-server worker runs, and
    between steps while the script runs): what arrives then waits for that work anyway, and where
    the compute threads use every core, each round preempts one (benchmarks/pipeline_vs_torch.py:
    pp_rank 0's stage computed 1.12-1.18x its single-process time with polls up to every
    millisecond, 1.07-1.11x with busy marking). Larger values defer more of the transfers that need
    this rank's help to that work's end. This applies while the rank has transfers in flight (one of
    its own sends or receives may need its progress); with none, `poll_busy_idle` does."""
    poll_busy_idle: float = 50e-3
    """Sleep of a polling progress thread between rounds while the rank is busy and has no transfer in
    flight: a round could then only take new arrivals, which wait for the work anyway, and each round
    costs the computing thread on the same core far more than its own CPU (a GPT microbatch's forward
    and backward beside its busy transport, one core: 2.3-2.9% slower with a round every 5 ms, 0-1.1%
    every 50 ms; measured with a one-off probe). The rank still looks in now and then, so a peer's
    send to it completes within this time."""
    oversubscribed: bool | None = None
    """Whether the host runs more ranks than it has cores. A thread waiting in `recv` then sleeps
    `poll_min` between its polls instead of only yielding the CPU, which on Linux leaves it to the
    waiter again: the ranks that compute need those cores (4 ranks of a pipeline on 2 cores ran their
    steps 1.5x faster). None: decided from the world where a transport is made from one (`for_world`),
    else False."""

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(
                f"timeout={self.timeout!r}; expected a positive, finite number of seconds (nothing may "
                "wait forever). Use a large value, e.g. 3600, for very long steps."
            )
        if self.static_slots < 1:
            raise ValueError(f"static_slots={self.static_slots}; expected at least 1")
        if self.recv_pool_bytes < 0:
            raise ValueError(f"recv_pool_bytes={self.recv_pool_bytes}; expected >= 0 (0 turns the pool off)")
        if self.inline_bytes < 0:
            raise ValueError(f"inline_bytes={self.inline_bytes}; expected >= 0 (0 turns inlining off)")
        if self.spin_time < 0:
            raise ValueError(f"spin_time={self.spin_time}; expected >= 0 seconds")
        if not (0 <= self.poll_min <= self.poll_max):
            raise ValueError(
                f"poll_min={self.poll_min}, poll_max={self.poll_max}; expected 0 <= poll_min <= poll_max"
            )
        for name in ("poll_busy", "poll_busy_idle"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"{name}={value!r}; expected a positive, finite number of seconds (a busy rank still "
                    "looks in now and then)"
                )

    def for_world(self, world: Any) -> TransportConfig:
        """This config with `oversubscribed` decided from the world's processes on this host."""
        if self.oversubscribed is not None:
            return self
        info = getattr(world, "info", None)  # a bare world (one rank, no launcher) has none
        return dataclasses.replace(self, oversubscribed=bool(getattr(info, "oversubscribed", False)))


_HANDLES = (
    threading.Lock()
)  # serializes completing handles (a send may be failed by close and completed at once)


class SendHandle:
    """Completion of one send. The sent tensors must not be modified until it is done."""

    __slots__ = ("_default_timeout", "_done", "_error", "_lock", "dest", "tag")

    def __init__(self, dest: int, tag: Tag, default_timeout: float) -> None:
        self.dest = dest
        self.tag = tag
        self._default_timeout = default_timeout
        self._lock = threading.Lock()  # held until the send finishes (much cheaper than an Event)
        self._lock.acquire()
        self._done = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the send has finished (successfully or not)."""
        return self._done

    def exception(self) -> BaseException | None:
        """The send's error, if it finished with one."""
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the send has finished; raise its error, or PeerTimeoutError after `timeout`."""
        limit = self._default_timeout if timeout is None else timeout
        if not self._done:
            if not self._lock.acquire(timeout=limit):
                raise PeerTimeoutError(
                    f"the send to rank {self.dest} with tag {self.tag!r} did not complete within {limit:g} s "
                    "(is the receiving rank alive and its transport open?)",
                    peer=self.dest,
                    tag=self.tag,
                    waited=limit,
                )
            self._lock.release()  # let other waiters of the same handle through
        if self._error is not None:
            raise self._error

    def _complete(self) -> None:
        with _HANDLES:
            if not self._done:
                self._done = True
                self._lock.release()

    def _fail(self, error: BaseException) -> None:
        with _HANDLES:
            if not self._done:
                self._error = error
                self._done = True
                self._lock.release()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "pending"
        return f"SendHandle(dest={self.dest}, tag={self.tag!r}, {state})"


def rebuild(arrival: Arrival, rank: int) -> Received:
    """The received object of a taken arrival; raises the arrival's error or the unpickling error."""
    if arrival.error is not None:
        raise arrival.error
    try:
        obj = decode_object(arrival.body, arrival.tensors)
    except Exception as exc:
        raise MessageDecodeError(
            f"the message from rank {arrival.source} with tag {arrival.tag!r} cannot be unpickled on "
            f"rank {rank}: {type(exc).__name__}: {exc}. Every rank needs the classes the message refers "
            "to (same code, same versions).",
            peer=arrival.source,
        ) from exc
    return Received(arrival.source, arrival.tag, obj)


class Transport(abc.ABC):
    """A point-to-point transport between the `size` ranks of a world; this process is `rank`."""

    name: str = "transport"
    rank: int
    size: int

    @abc.abstractmethod
    def send(self, obj: object, dest: int, tag: Tag = 0, *, static: bool | None = None) -> SendHandle:
        """Start sending `obj` to rank `dest`; returns at once. Unpicklable objects raise here."""

    @abc.abstractmethod
    def recv(self, source: int = ANY_SOURCE, tag: object = ANY_TAG, timeout: float | None = None) -> Received:
        """Take the next message matching (source, tag), waiting at most `timeout` seconds."""

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Finish pending sends, stop the progress thread and release every resource. Idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether close has been called."""

    def set_busy(self, busy: bool) -> None:
        """Mark this rank as busy with other work (True) or back at communication (False).

        While busy, a transport whose progress thread polls does so only every
        `TransportConfig.poll_busy`: on a host whose cores all compute, each poll preempts the
        compute, and nothing that arrives is taken before the work ends. Threads waiting in `recv`
        still make progress themselves. The default does nothing
        (transports whose progress waits on events instead of polling)."""
        return None

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


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
            self._check_rank(source, "source")
        limit = self.config.timeout if timeout is None else timeout
        drive = self._drive if self.drives_progress else None
        arrival = self.mailbox.take(source, tag, limit, drive=drive, config=self.config)
        return rebuild(arrival, self.rank)

    # -- for subclasses and routers ------------------------------------------------------------------

    def _check_rank(self, rank: int, what: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(
                f"{what}={rank!r}; expected a rank in [0, {self.size}) on this {self.name} transport"
            )

    def _send(self, obj: object, dest: int, tag: Tag, *, static: bool | None, channel: int) -> SendHandle:
        self._check_send(dest, tag)
        body, tensors = encode_object(obj)
        return self._send_encoded(body, tensors, dest, tag, static=static, channel=channel)

    def _check_send(self, dest: int, tag: Tag) -> None:
        if self._closed:
            raise TransportClosedError(f"send on the closed {self.name} transport of rank {self.rank}")
        self._check_rank(dest, "dest")
        try:
            hash(tag)
        except TypeError:
            raise ValueError(f"tag={tag!r} is not hashable; use an int, a str or a tuple of those") from None

    def _send_encoded(
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
        self._drive()  # post it from this thread when the progress thread is not at it already
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
            land_inline(header, metas, tensors)
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

    def _allocate(self, source: int, header: Header, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
        """The tensors an arriving message lands in (a transport may have made them ahead of time).

        CUDA tensors come from the landing stream's memory: their bytes are written outside the
        default stream (by a copy on the landing stream, or by UCX), and memory of the default stream
        may still be read by kernels queued there, which only work on that stream waits for.
        """
        if any(m.device == "cuda" for m in metas) and torch.cuda.is_available():
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
    """Whether threads waiting in `recv` (and `send`) make progress themselves through `_drive`."""

    def _drive(self) -> bool:
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
