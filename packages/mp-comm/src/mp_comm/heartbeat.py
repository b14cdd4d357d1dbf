"""Liveness: tell a slow rank from a stopped or dead one, and name it.

Every rank runs one daemon thread that sends a small UDP datagram to its peers every `interval`
seconds: its rank and what it is waiting for (mp_comm.waits), or where its main thread is. The thread
runs whatever the rank computes (torch and MPI release the GIL; pure Python gives it a turn every
few milliseconds), so a slow rank keeps beating; a rank that is stopped (SIGSTOP, a frozen
container or VM), dead, or cut off from the network falls silent. A peer silent for
``MP_HEARTBEAT_TIMEOUT`` seconds (default 30; 0 turns the heartbeat off) ends the job: the rank
that notices reports which rank went silent (global rank, its pp/tp/rdp ranks, host, PID) and what
every rank was last doing, leaves that report for mp-launch, SIGKILLs the silent ranks on its own
host (a stopped process ignores the SIGTERM torchrun's agent sends first), and aborts the MPI job (or
exits under torchrun, whose agent stops the rest).

The socket binds to the address the job uses (127.0.0.1 on one host, else the address the host's name
resolves to), and every datagram carries an HMAC of the job's secret (rank 0 draws it and shares it
over the bootstrap), checked before the JSON is parsed: other processes are not heard.

When a rank falls silent because one of its own threads holds Python's GIL (a C call that never
releases it, so the heartbeat thread cannot run), its Python stacks explain the silence, and only the
rank itself can take them: each rank re-arms faulthandler's watchdog (a C thread: it needs no GIL) every
``REARM_AFTER`` of the timeout, to write all its threads' stacks to an in-memory file (memfd, gone with
the process) once the heartbeat thread has not run for up to ``STACKS_AFTER`` of the timeout. A rank
that notices a silent peer on its own host reads that file (/proc/PID/fd/N) into its report.
``MP_HEARTBEAT_STACKS=0`` leaves faulthandler's watchdog (one per process) to the script.

A rank that ends normally says goodbye, and its peers stop watching it. A rank that finds its own
thread was not scheduled for half the timeout (the rank itself was stopped, then continued) forgets
what it heard before instead of blaming its peers. Jobs above `FULL_MESH` ranks send to their
`RING` nearest ranks on each side only (a silent rank is still noticed, by its neighbours).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from mp_comm import waits
from mp_comm.errors import WorldError
from mp_comm.transport import auth

__all__ = ["DEFAULT_TIMEOUT", "ENV", "Heartbeat", "Peer", "start", "stop", "timeout_from_env"]

log = logging.getLogger(__name__)

ENV: Final = "MP_HEARTBEAT_TIMEOUT"
DEFAULT_TIMEOUT: Final = 30.0
"""Seconds without a heartbeat after which a rank is declared stopped or dead: far below the 10 minutes
after which a torch.distributed collective fails, far above how late a loaded host runs the thread (the
fault tests use 5 s, with no false alarm at a load of 14-27 on 2 cores)."""
FAILURE_DIR_ENV: Final = "MP_LAUNCH_FAILURE_DIR"
STACKS_ENV: Final = "MP_HEARTBEAT_STACKS"
STACKS_AFTER: Final = 0.6
"""The fraction of the timeout after a beat at which a rank whose heartbeat thread has not run since writes
its stacks: early enough that the file is there when a peer reports it (at the timeout, plus one interval)."""
REARM_AFTER: Final = 0.2
"""The fraction of the timeout after which a beat re-arms the watchdog (well below STACKS_AFTER)."""
FULL_MESH: Final = 64
RING: Final = 8
_TAG: Final = 0x4842  # "HB": the MAC's tag, apart from the UCX transport's
_MAX_WAITS: Final = 6
_REPORT_GRACE: Final = 1.0  # seconds for the launcher to forward the report before MPI_Abort


def timeout_from_env(environ: dict[str, str] | None = None) -> float:
    """MP_HEARTBEAT_TIMEOUT in seconds (0: off), or the default."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise WorldError(
            f"{ENV}={raw!r} is not a number of seconds; expected a finite number >= 0 (default "
            f"{DEFAULT_TIMEOUT:g}; 0 turns the heartbeat off). Fix: export {ENV}=30, say"
        )
    return value


@dataclass(frozen=True, slots=True)
class Peer:
    rank: int
    host: str
    pid: int
    address: tuple[str, int]
    label: str
    """Its coordinates, e.g. "pp_rank 1, tp_rank 0, rdp_rank 0" (may be empty)."""
    stacks: str = ""
    """Where its watchdog writes its threads' stacks (/proc/PID/fd/N on its host); "" if it writes none."""

    def name(self) -> str:
        where = f"host {self.host}, PID {self.pid}"
        return f"rank {self.rank} ({self.label}; {where})" if self.label else f"rank {self.rank} ({where})"


@dataclass
class _Heard:
    at: float
    """time.monotonic() here when the last heartbeat came."""
    waits: list[tuple[str, int | None, float, str]] = field(default_factory=list)
    """(what, peer, age when sent, thread)."""
    frame: str = ""


class Heartbeat:
    """The heartbeat thread of one rank (see the module docstring). `start` builds one for a World."""

    def __init__(
        self,
        rank: int,
        peers: list[Peer],
        sock: socket.socket,
        secret: bytes,
        timeout: float,
        *,
        interval: float | None = None,
        on_silent: Callable[[str, list[int]], None] | None = None,
        stacks: int | None = None,
    ) -> None:
        self.rank = rank
        self.peers = peers
        self.timeout = timeout
        self.interval = interval if interval is not None else min(1.0, timeout / 5)
        self.report: str | None = None
        """The message this rank raised, once it found a peer silent."""
        self._sock = sock
        self._secret = secret
        self._on_silent = on_silent or self._end_job
        self._stacks = stacks  # the descriptor of this rank's peers[rank].stacks, which faulthandler writes
        size = len(peers)
        if size <= FULL_MESH:
            near = [r for r in range(size) if r != rank]
        else:
            near = sorted({(rank + d) % size for d in range(-RING, RING + 1)} - {rank})
        self._targets = [peers[r].address for r in near]
        self._heard = {r: _Heard(time.monotonic()) for r in near}
        self._gone: set[int] = set()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # `stop` wakes the thread at once (a rank's exit waits on it)
        self._thread = threading.Thread(target=self._run, name="mp-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Say goodbye (the peers stop watching this rank) and end the thread. Local; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval + 1.0)
        if self._stacks is not None:
            faulthandler.cancel_dump_traceback_later()
            os.close(self._stacks)
        with contextlib.suppress(OSError):
            self._send({"r": self.rank, "k": "bye"})
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        last_turn = time.monotonic()
        next_beat = last_turn
        armed = -math.inf
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_turn > self.timeout / 2:
                    # This thread did not run for that long: this rank was the one stopped. Start over.
                    log.warning("rank %d was not scheduled for %.1f s", self.rank, now - last_turn)
                    for heard in self._heard.values():
                        heard.at = now
                last_turn = now
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.interval
                    if self._stacks is not None and now - armed >= self.timeout * REARM_AFTER:
                        # each arming starts a C thread, so not at every beat: it fires once this thread
                        # stopped for between STACKS_AFTER - REARM_AFTER and STACKS_AFTER of the timeout
                        faulthandler.dump_traceback_later(self.timeout * STACKS_AFTER, file=self._stacks)
                        armed = now
                self._listen(max(0.0, next_beat - time.monotonic()))
                silent = self._silent(time.monotonic())
                if silent:
                    self.report = self.describe(silent)
                    self._on_silent(self.report, silent)
                    return
        except OSError as exc:  # the socket closed under us (stop) or the network failed
            if not self._stop.is_set():
                log.warning("rank %d: heartbeat stopped: %s", self.rank, exc)

    def _beat(self) -> None:
        now = time.monotonic()
        mine = [
            (w.what[:200], w.peer, round(now - w.since, 2), w.thread) for w in waits.current()[:_MAX_WAITS]
        ]
        with contextlib.suppress(OSError):  # a full buffer or a peer gone: the next beat tries again
            self._send({"r": self.rank, "k": "hb", "w": mine, "f": waits.main_frame()[-200:]})

    def _send(self, body: dict[str, Any]) -> None:
        data = auth.seal(self._secret, _TAG, json.dumps(body).encode())
        for address in self._targets:
            with contextlib.suppress(BlockingIOError):
                self._sock.sendto(data, address)

    def _listen(self, wait: float) -> None:
        fd = self._sock.fileno()
        poller = select.poll()  # not select.select: a busy process's descriptors may pass 1024
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        ready = [ready_fd for ready_fd, _ in poller.poll(wait * 1000)]
        while fd in ready and not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return
            self._heard_from(data)

    def _heard_from(self, data: bytes) -> None:
        body = auth.unseal(self._secret, _TAG, data)
        if body is None:
            log.debug("rank %d: dropped a datagram that is not from the job", self.rank)
            return
        try:
            message = json.loads(body)
            rank = int(message["r"])
            heard = self._heard.get(rank)
            if heard is None:
                return
            if message["k"] == "bye":
                self._gone.add(rank)
                return
            heard.at = time.monotonic()
            heard.waits = [(str(w), p, float(a), str(t)) for w, p, a, t in message.get("w", [])]
            heard.frame = str(message.get("f", ""))
        except (ValueError, KeyError, TypeError) as exc:  # signed by the job, yet malformed: a bug of ours
            log.warning("rank %d: a heartbeat it cannot read: %s", self.rank, exc)

    def _silent(self, now: float) -> list[int]:
        return sorted(r for r, h in self._heard.items() if r not in self._gone and now - h.at > self.timeout)

    # -- the report --------------------------------------------------------------------------------------
    def describe(self, silent: list[int]) -> str:
        now = time.monotonic()
        names = ", ".join(self.peers[r].name() for r in silent)
        took = max(now - self._heard[r].at for r in silent)
        verb = "has" if len(silent) == 1 else "have"
        lines = [
            f"{names} {verb} sent no heartbeat for {took:.1f} s ({ENV}={self.timeout:g}): stopped (SIGSTOP, "
            f"a frozen container or VM), dead, or cut off from the network. Rank {self.rank} noticed and "
            "ends the job.",
            "What each rank was doing (its last heartbeat):",
        ]
        mine = [waits.describe(w, now) for w in waits.current()]
        lines.append(self._doing(self.peers[self.rank], "now", mine, waits.main_frame()))
        for rank, heard in sorted(self._heard.items()):
            if rank in self._gone:
                lines.append(f"  {self.peers[rank].name()}: finished (said goodbye)")
                continue
            age = now - heard.at
            described = [waits.describe(waits.Wait(w, p, heard.at - a, t), now) for w, p, a, t in heard.waits]
            lines.append(self._doing(self.peers[rank], f"{age:.1f} s ago", described, heard.frame))
        lines += self._stacks_of(silent)
        lines.append(
            f"Fix: look at what the silent rank was doing (a debugger, py-spy dump --pid); raise {ENV} if "
            "ranks legitimately hold Python's GIL for that long (one C call that never releases it)."
        )
        return "\n".join(lines)

    def _stacks_of(self, silent: list[int]) -> list[str]:
        """The stacks each silent rank on this host wrote when its heartbeat thread stopped running (a
        stopped or dead rank writes none: its watchdog stopped with it)."""
        here = self.peers[self.rank].host
        lines = []
        for r in silent:
            peer = self.peers[r]
            if peer.host != here or not peer.stacks:
                continue
            try:
                text = Path(peer.stacks).read_text(errors="replace").strip()
            except OSError:
                continue
            if text:
                lines.append(f"{peer.name()}: its threads when its heartbeat stopped (faulthandler):")
                lines += ["    " + line for line in text.splitlines()[-60:]]
        return lines

    def _end_job(self, report: str, silent: list[int]) -> None:
        """Report the silent ranks (to mp-launch, which prints it once for the job, else to the log), then
        end the whole job."""
        rank = self.rank
        folder = os.environ.get(FAILURE_DIR_ENV)
        names = [self.peers[r].name() for r in silent]
        entry = {"rank": rank, "silent": silent, "names": names, "report": report}
        try:
            if not (folder and os.path.isdir(folder)):
                raise OSError("not under mp-launch")
            tmp = Path(folder) / f".hang-{rank}.tmp"
            tmp.write_text(json.dumps(entry))
            tmp.replace(Path(folder) / f"hang-{rank}.json")
            log.error("rank %d: %s stopped answering; ending the job (mp-launch prints why)", rank, names)
        except OSError:  # plain mpiexec, torchrun: printed, not logged (a script's logging may drop it)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                print(f"[rank {rank}] mp: {report}", file=sys.stderr, flush=True)
        time.sleep(_REPORT_GRACE)
        for r in silent:  # a stopped process on this host ignores the SIGTERM torchrun sends it first
            if self.peers[r].host == self.peers[rank].host:
                with contextlib.suppress(OSError):
                    os.kill(self.peers[r].pid, signal.SIGKILL)
        try:
            mpi = sys.modules.get("mpi4py.MPI")  # not imported here: that would start MPI (torchrun)
            if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Abort(1)  # the launcher ends every rank
        finally:
            os._exit(1)  # torchrun's agent ends the others

    @staticmethod
    def _doing(peer: Peer, when: str, described: list[str], frame: str) -> str:
        doing = (
            "; ".join(described)
            if described
            else "no wait registered (computing, or in a call mp does not track)"
        )
        where = f"; main thread at {frame}" if frame else ""
        return f"  {peer.name()}, {when}: {doing}{where}"


_HEARTBEAT: list[Heartbeat] = []  # the one of this process, for `stop`


def _address(world: Any) -> str:
    if world.info.num_nodes == 1:
        return "127.0.0.1"
    network = getattr(world, "network", None)  # the job's address (mp_comm.network)
    fallback = network.address if network is not None else socket.gethostbyname(socket.gethostname())
    return os.environ.get("MP_HEARTBEAT_ADDR") or fallback


def start(world: Any, label: str = "", *, timeout: float | None = None) -> Heartbeat | None:
    """Start this rank's heartbeat for `world` (an mp_comm World). Collective over the world.

    None for a world of one rank, or with the heartbeat off (MP_HEARTBEAT_TIMEOUT=0).
    """
    from mp_comm.transport.bootstrap import bootstrap_for_world

    stop()
    limit = timeout_from_env() if timeout is None else timeout
    if world.size == 1 or limit == 0:
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((_address(world), 0))
    sock.setblocking(False)
    stacks = _stacks_file() if os.environ.get(STACKS_ENV, "1").strip() != "0" else None
    stacks_at = f"/proc/{os.getpid()}/fd/{stacks}" if stacks is not None else None
    bootstrap = bootstrap_for_world(world)
    try:
        secret = auth.new_secret() if world.rank == 0 else None
        entries = bootstrap.allgather(
            (
                sock.getsockname(),
                socket.gethostname(),
                os.getpid(),
                label,
                secret,
                limit,
                stacks_at,
            )
        )
    finally:
        bootstrap.close()
    limits = {e[5] for e in entries}
    if len(limits) > 1:
        sock.close()
        if stacks is not None:
            os.close(stacks)
        raise WorldError(
            f"{ENV} differs between ranks ({sorted(limits)}); expected one value for the whole job. "
            f"Fix: export the same {ENV} to every rank"
        )
    peers = [
        Peer(r, e[1], int(e[2]), (str(e[0][0]), int(e[0][1])), str(e[3]), e[6] or "")
        for r, e in enumerate(entries)
    ]
    beat = Heartbeat(world.rank, peers, sock, entries[0][4], limit, stacks=stacks)
    _HEARTBEAT.append(beat)
    log.debug("rank %d: heartbeat every %.1f s, timeout %g s", world.rank, beat.interval, limit)
    return beat.start()


def _stacks_file() -> int | None:
    """A descriptor of this rank's (empty) in-memory stacks file, or None where Linux's memfd is missing."""
    try:
        return os.memfd_create("mp-heartbeat-stacks")
    except (AttributeError, OSError):
        return None


def who_is_at(text: str) -> str | None:
    """Which hosts and ranks the IPv4 addresses in an error message are (gloo names a peer that went away
    only by address: "Connection closed by peer [10.0.0.2]:41217"), from this process's heartbeat, or
    None when it names none of the job's addresses or the job runs on one host."""
    if not _HEARTBEAT:
        return None
    peers = _HEARTBEAT[-1].peers
    if len({p.address[0] for p in peers}) < 2:
        return None
    found = []
    for address in dict.fromkeys(re.findall(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])", text)):
        at = [p for p in peers if p.address[0] == address]
        if at:
            ranks = ", ".join(str(p.rank) for p in at)
            found.append(f"{address} is host {at[0].host} (rank{'s' if len(at) > 1 else ''} {ranks})")
    return "; ".join(found) or None


def stop() -> None:
    """Stop this process's heartbeat, if any (a rank that ends normally: its peers stop watching it)."""
    while _HEARTBEAT:
        _HEARTBEAT.pop().stop()
