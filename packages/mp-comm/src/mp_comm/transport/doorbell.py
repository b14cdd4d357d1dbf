"""The doorbell: how a thread waiting for a message sleeps in the kernel and still wakes when it comes.

MPI's shared-memory transport has nothing to block on: a message is seen only by polling. A thread
waiting in `recv` polls for `TransportConfig.spin_time` and then naps, up to `poll_max` at a time, so a
message that arrives during a nap waited for the rest of it; on a loaded host, where a waiting rank is
off the CPU anyway, most messages did (a 16-float round trip took 2.3x gloo's, whose receiver blocks
in the kernel on its socket, at load 17 on 2 cores).

So every rank also binds a datagram socket (Linux's abstract namespace: nothing on disk), and the
sender of a message rings the destination's after posting it: one byte, non-blocking, dropped when the
socket's buffer is full (the bell is ringing already). A napping receiver waits in ``select`` on its own
socket for the length of its nap, which a ring ends at once. The bell is only a hint: a ring that is
lost, or a peer on another host (or another network namespace) that cannot be rung, leaves the nap
as long as it was.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import sys
import time
from typing import Any

__all__ = ["Doorbell"]

log = logging.getLogger(__name__)

_RING = b"\x01"


class Doorbell:
    """One rank's bell and the addresses of the bells of the ranks on its host.

    Collective over `comm` (an mpi4py communicator) to create: the ranks agree on a name for the job's
    bells, tell each other their host names and bind theirs before any rank rings.
    """

    def __init__(self, comm: Any) -> None:
        self.rank = comm.Get_rank()
        token = comm.bcast(secrets.token_hex(8) if self.rank == 0 else None, root=0)
        usable = sys.platform.startswith("linux")  # the abstract namespace is Linux's
        hosts = comm.allgather((socket.gethostname(), usable))
        self._sock: socket.socket | None = None
        self._peers: dict[int, bytes] = {}
        if usable:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self._sock.bind(self._address(token, self.rank))
            self._peers = {
                r: self._address(token, r)
                for r, (host, ok) in enumerate(hosts)
                if ok and host == hosts[self.rank][0]
            }
        comm.Barrier()  # every bell is bound before anyone rings

    @staticmethod
    def _address(token: str, rank: int) -> bytes:
        return f"\0mp-comm-bell-{token}-{os.getuid()}-{rank}".encode()

    def fileno(self) -> int:
        return -1 if self._sock is None else self._sock.fileno()

    @property
    def usable(self) -> bool:
        return self._sock is not None

    def ring(self, dest: int) -> None:
        """Tell rank `dest` that a message is on its way (a no-op for a rank that cannot be rung)."""
        address = self._peers.get(dest)
        if address is None or self._sock is None:
            return
        try:
            self._sock.sendto(_RING, address)
        except BlockingIOError:
            pass  # its buffer is full of rings: it will look in anyway
        except OSError as exc:  # not reachable after all (another network namespace): stop ringing it
            log.debug("rank %d: the doorbell of rank %d cannot be rung (%s)", self.rank, dest, exc)
            self._peers.pop(dest, None)

    def ring_self(self) -> None:
        """Wake a thread of this rank that waits on the bell (a message was delivered by another)."""
        self.ring(self.rank)

    def drain(self) -> None:
        """Forget the rings so far (before looking for messages: what arrives after rings again)."""
        sock = self._sock
        if sock is None:
            return
        try:
            while True:
                sock.recv(64)
        except (BlockingIOError, OSError):
            return

    def wait(self, timeout: float) -> None:
        """Sleep until a ring or for `timeout` seconds (the GIL is released meanwhile)."""
        sock = self._sock
        try:
            if sock is not None:
                select.select([sock], [], [], timeout)
                return
        except (ValueError, OSError):  # closed meanwhile (the transport is closing)
            pass
        time.sleep(timeout)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._peers = {}
