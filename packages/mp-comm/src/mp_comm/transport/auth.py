"""Messages only from the job's own ranks: a per-job secret, and a MAC checked before anything is parsed.

A transport that listens on a port (UCX) can be reached by any process that reaches the port, and its
headers are pickles: unpickling a stranger's bytes runs the stranger's code. So rank 0 draws a secret
when the transport starts and shares it over the bootstrap (MPI or torch.distributed, channels the
launcher set up between the job's processes only); every header, control message and hello then
carries an HMAC-SHA256 of its bytes and its UCX tag (which names the sender and the message), and a
receiver checks it before it parses anything. A message that fails the check is dropped and counted.

The raw tensor payloads that follow a header are not signed: they are never parsed, only copied into
tensors that a checked header asked for. The secret never leaves the job's processes; it does not
protect against someone who can read their memory or the bootstrap's traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Final

__all__ = ["MAC_BYTES", "hello", "new_secret", "open_hello", "seal", "unseal"]

MAC_BYTES: Final = 32
SECRET_BYTES: Final = 32
_HELLO = struct.Struct("<q")


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _mac(secret: bytes, tag: int, data: bytes) -> bytes:
    return hmac.new(secret, struct.pack("<Q", tag) + data, hashlib.sha256).digest()


def seal(secret: bytes, tag: int, data: bytes) -> bytes:
    """``data`` followed by its MAC (bound to ``tag``, so a message cannot be replayed under another)."""
    return data + _mac(secret, tag, data)


def unseal(secret: bytes, tag: int, sealed: bytes) -> bytes | None:
    """The data of a sealed message, or None when its MAC does not match (not from the job)."""
    if len(sealed) < MAC_BYTES:
        return None
    data, mac = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
    return data if hmac.compare_digest(mac, _mac(secret, tag, data)) else None


HELLO_BYTES: Final = _HELLO.size + MAC_BYTES


def hello(secret: bytes, rank: int) -> bytes:
    """What a rank sends first on a new connection: its rank, sealed."""
    return seal(secret, 0, _HELLO.pack(rank))


def open_hello(secret: bytes, data: bytes) -> int | None:
    """The rank a hello names, or None when it is not from the job."""
    body = unseal(secret, 0, data)
    return None if body is None or len(body) != _HELLO.size else int(_HELLO.unpack(body)[0])
