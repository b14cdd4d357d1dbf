"""The point-to-point transport interface: `Transport`, its `SendHandle` and `Received` message.

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
"""

from __future__ import annotations

import abc
import threading
from types import TracebackType
from typing import Any, NamedTuple

from mp_comm.errors import MessageDecodeError, PeerTimeoutError
from mp_comm.message import Tag, decode_object
from mp_comm.transport.mailbox import ANY_SOURCE, ANY_TAG, Arrival

__all__ = ["Received", "SendHandle", "Transport", "rebuild"]


class Received(NamedTuple):
    """A received message: who sent it, its tag, and the rebuilt object."""

    source: int
    tag: Tag
    obj: Any


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

    def set_done(self) -> None:
        """For the transport: the send finished (the first outcome set wins)."""
        with _HANDLES:
            if not self._done:
                self._done = True
                self._lock.release()

    def set_failed(self, error: BaseException) -> None:
        """For the transport: the send failed with ``error`` (the first outcome set wins)."""
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
