"""Exceptions raised by mp_comm.

Every user-facing error names the value it received, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = ["MPCommError", "NetworkError", "TopologyError", "WorldError"]


class MPCommError(Exception):
    """Base class of every error raised by mp_comm."""


class TopologyError(ValueError, MPCommError):
    """An impossible rank layout: bad world size, parallel degrees, placement strategy or ranks per node."""


class WorldError(RuntimeError, MPCommError):
    """The process world cannot be started: launcher variables, backend or an existing group disagree."""


class NetworkError(WorldError):
    """The job's hosts do not reach each other: no address of rank 0 answers every rank, or a host cannot
    reach another within the preflight's bound. Raised on every rank, naming hosts, addresses and errors."""


# --- point-to-point transports (mp_comm.message, mp_comm.transport, mp_comm.router) ---------------------


class TransportError(RuntimeError, MPCommError):
    """A transport failed: an MPI or UCX call returned an error, or the progress thread stopped.

    `peer` is the rank on the other side when one is known, else None. Every field has a default, so
    the errors pickle (the fields travel in `__dict__`) and can be sent to another rank.
    """

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class TransportUnavailableError(TransportError):
    """A transport cannot start here: its library is missing or lacks a capability it needs."""


class TransportClosedError(TransportError):
    """The transport was closed (or is closing) while this call needed it."""


class PeerTimeoutError(TransportError, TimeoutError):
    """A receive or a send did not complete within its timeout; names the peer, the tag and the wait."""

    def __init__(
        self, message: str, *, peer: int | None = None, tag: object = None, waited: float = 0.0
    ) -> None:
        super().__init__(message, peer=peer)
        self.tag = tag
        self.waited = waited


class PeerLostError(TransportError):
    """The peer's connection failed (it died or its endpoint closed) with messages still owed."""


class MessageEncodeError(TransportError, TypeError):
    """An object cannot be sent: it (or something inside it) cannot be pickled."""


class MessageDecodeError(TransportError):
    """A received message cannot be rebuilt: its header is corrupt or the object cannot be unpickled."""


__all__ += [
    "MessageDecodeError",
    "MessageEncodeError",
    "PeerLostError",
    "PeerTimeoutError",
    "TransportClosedError",
    "TransportError",
    "TransportUnavailableError",
]


class CollectiveError(ValueError, MPCommError):
    """A collective cannot run on the given tensor and group: sizes that do not divide, bad dims or modes."""


__all__ += ["CollectiveError"]
