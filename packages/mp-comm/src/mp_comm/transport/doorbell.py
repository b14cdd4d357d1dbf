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

A ring costs the sender a system call, and most messages find their receiver polling, not napping (a
waiter polls for `spin_time` before its first nap). So each rank also publishes whether a thread of it
naps on its bell: one byte in shared memory (a file in /dev/shm, unlinked as soon as the host's ranks
have mapped it), which the waiter sets before its last look for messages and clears when it wakes
(`arm`, `disarm`); a sender rings only a rank whose byte is set. A sender that reads the byte just
before the waiter sets it has posted its message before that last look, which then finds it. A peer
whose byte cannot be mapped is always rung.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import select
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["Doorbell"]

log = logging.getLogger(__name__)

_RING = b"\x01"
_SHM_DIR = "/dev/shm"


class Doorbell:
    """One rank's bell and the addresses of the bells of the ranks on its host.

    Collective over `comm` (an mpi4py communicator) to create: the ranks agree on a name for the job's
    bells, tell each other their host names and bind theirs before any rank rings.
    """

    def __init__(self, comm: Any) -> None:
        self.rank = comm.Get_rank()
        token = comm.bcast(secrets.token_hex(8) if self.rank == 0 else None, root=0)
        usable = sys.platform.startswith("linux")  # the abstract namespace is Linux's
        self._flag = self._create_flag(token) if usable else None
        hosts = comm.allgather((socket.gethostname(), usable, self._flag is not None))
        self._sock: socket.socket | None = None
        self._peers: dict[int, bytes] = {}
        self._flags: dict[int, mmap.mmap] = {}
        self._armed = 0  # threads of this rank napping on the bell (its flag is set while > 0)
        self._arm_lock = threading.Lock()
        self.rung = 0
        """Rings sent (for tests and benchmarks)."""
        self.skipped = 0
        """Rings not sent: the destination had no thread napping on its bell."""
        if usable:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self._sock.bind(self._address(token, self.rank))
            self._peers = {
                r: self._address(token, r)
                for r, (host, ok, _) in enumerate(hosts)
                if ok and host == hosts[self.rank][0]
            }
            for r in self._peers:
                if hosts[r][2]:
                    flag = self._open_flag(token, r)
                    if flag is not None:
                        self._flags[r] = flag
        comm.Barrier()  # every bell is bound, and every flag mapped, before anyone rings
        if self._flag is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._flag_path(token, self.rank))  # the mappings stay; nothing is left on disk

    @staticmethod
    def _address(token: str, rank: int) -> bytes:
        return f"\0mp-comm-bell-{token}-{os.getuid()}-{rank}".encode()

    @staticmethod
    def _flag_path(token: str, rank: int) -> str:
        return os.path.join(_SHM_DIR, f"mp-comm-bell-{token}-{os.getuid()}-{rank}")

    def _create_flag(self, token: str) -> mmap.mmap | None:
        """This rank's flag byte (0: no thread naps on its bell), shared through /dev/shm; None on failure."""
        try:
            fd = os.open(self._flag_path(token, self.rank), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            log.debug(
                "rank %d: no doorbell flag in %s (%s): its senders always ring", self.rank, _SHM_DIR, exc
            )
            return None
        try:
            os.ftruncate(fd, 1)
            return mmap.mmap(fd, 1)
        except OSError as exc:
            log.debug("rank %d: the doorbell flag cannot be mapped (%s)", self.rank, exc)
            with contextlib.suppress(OSError):
                os.unlink(self._flag_path(token, self.rank))
            return None
        finally:
            os.close(fd)

    def _open_flag(self, token: str, rank: int) -> mmap.mmap | None:
        try:
            fd = os.open(self._flag_path(token, rank), os.O_RDONLY)
        except OSError:  # another mount namespace: that rank is always rung
            return None
        try:
            return mmap.mmap(fd, 1, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)

    def fileno(self) -> int:
        return -1 if self._sock is None else self._sock.fileno()

    @property
    def usable(self) -> bool:
        return self._sock is not None

    def ring(self, dest: int) -> None:
        """Tell rank `dest` that a message is on its way, if a thread of it naps on its bell (a no-op for
        a rank that cannot be rung)."""
        flag = self._flags.get(dest)
        if flag is not None and not flag[0]:
            self.skipped += 1
            return
        self._send_ring(dest)

    def ring_self(self) -> None:
        """Wake a thread of this rank that waits on the bell (a message was delivered by another)."""
        self._send_ring(self.rank)

    def _send_ring(self, dest: int) -> None:
        address = self._peers.get(dest)
        if address is None or self._sock is None:
            return
        try:
            self._sock.sendto(_RING, address)
            self.rung += 1
        except BlockingIOError:
            pass  # its buffer is full of rings: it will look in anyway
        except OSError as exc:  # not reachable after all (another network namespace): stop ringing it
            log.debug("rank %d: the doorbell of rank %d cannot be rung (%s)", self.rank, dest, exc)
            self._peers.pop(dest, None)

    def arm(self) -> None:
        """A thread of this rank is about to nap on the bell: from now on, senders ring it. Call before
        the thread's last look for messages, and `disarm` after the nap."""
        with self._arm_lock:
            self._armed += 1
            if self._flag is not None:
                self._flag[0] = 1

    def disarm(self) -> None:
        with self._arm_lock:
            self._armed -= 1
            if self._armed == 0 and self._flag is not None:
                self._flag[0] = 0

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
        flags, self._flags = self._flags, {}
        for flag in flags.values():
            if flag is not self._flag:
                flag.close()
        with self._arm_lock:  # a napping thread may still arm or disarm
            if self._flag is not None:
                self._flag.close()
                self._flag = None
