"""The job's network: which address every layer uses, chosen once per job, and the preflight that
proves each rank reaches the others before any layer waits on them.

On one node everything talks over loopback. Across nodes, rank 0 offers the addresses peers may reach
it by (``MASTER_ADDR`` or the address of ``MP_IFNAME`` when the user names one; else this host's name,
then every other non-loopback interface), listens briefly on each, and every rank tries them. The first
address that every rank reached becomes the rendezvous store's; each rank's own end of that connection
is its address on the job's network, and the interface holding it is what gloo, NCCL, UCX and the
heartbeat use. Then every rank checks that it reaches one listener per other host, so that a host whose
route to the others is broken is named at start, on every rank, within a bound instead of hanging in
the first collective.

The checks are collective over the MPI communicator that started the job (the one channel that works
before any of mp's own).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mp_comm.errors import NetworkError

__all__ = [
    "DEFAULT_PREFLIGHT_TIMEOUT",
    "Interface",
    "JobAddress",
    "address_towards",
    "choose_job_address",
    "interface_of",
    "interfaces",
    "preflight_timeout",
]

log = logging.getLogger(__name__)

DEFAULT_PREFLIGHT_TIMEOUT = 60.0
"""Seconds the preflight waits for a peer to become reachable before it names it (MP_PREFLIGHT_TIMEOUT)."""
_ATTEMPT = 3.0  # seconds one connection attempt may take, so that one dead address cannot use the bound
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Interface:
    """A network interface of this host with its IPv4 address."""

    name: str
    address: str


@dataclass(frozen=True)
class JobAddress:
    """Where this rank sits on the job's network."""

    rendezvous: str
    """Rank 0's address, which every rank reached: the rendezvous store listens there."""
    address: str
    """This rank's own address towards the others (127.0.0.1 on one node)."""
    interface: str | None
    """The interface that holds `address` (None when it cannot be named, e.g. not Linux)."""


def interfaces() -> list[Interface]:
    """This host's network interfaces that hold an IPv4 address, in the kernel's order (Linux)."""
    found: list[Interface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found.append(Interface(name, socket.inet_ntoa(reply[20:24])))
    return found


def interface_of(address: str) -> str | None:
    """The name of the local network interface that holds ``address`` (IPv4 or IPv6), if any (Linux)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as table:  # address (hex), index, prefix, scope, flags, name
                for line in table:
                    fields = line.split()
                    if len(fields) >= 6 and int(fields[0], 16) == int(ip):
                        return fields[5]
        except OSError:
            return None
        return None
    return next((i.name for i in interfaces() if i.address == address), None)


def preflight_timeout(environ: Mapping[str, str]) -> float:
    """MP_PREFLIGHT_TIMEOUT in seconds (default 60)."""
    raw = environ.get("MP_PREFLIGHT_TIMEOUT", "")
    if not raw:
        return DEFAULT_PREFLIGHT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise NetworkError(
            f"MP_PREFLIGHT_TIMEOUT={raw!r}; expected a number of seconds > 0. Fix: unset it (60 s) or set "
            "e.g. MP_PREFLIGHT_TIMEOUT=120"
        )
    return value


def _resolve(name: str, variable: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise NetworkError(
            f"{variable}={name!r} does not resolve to an IPv4 address ({exc}); expected rank 0's host name "
            f"or address. Fix: set {variable} to an address of rank 0's host that the other hosts reach"
        ) from None


def rendezvous_candidates(environ: Mapping[str, str]) -> list[str]:
    """The addresses rank 0 offers its peers, best first."""
    if environ.get("MASTER_ADDR"):
        return [_resolve(environ["MASTER_ADDR"], "MASTER_ADDR")]
    found = interfaces()
    if environ.get("MP_IFNAME"):
        wanted = environ["MP_IFNAME"]
        named = [i.address for i in found if i.name == wanted]
        if not named:
            have = ", ".join(f"{i.name} ({i.address})" for i in found) or "none"
            raise NetworkError(
                f"MP_IFNAME={wanted!r} is not an interface with an IPv4 address on {socket.gethostname()}; "
                f"this host has: {have}. Fix: set MP_IFNAME to the interface on the network the hosts share"
            )
        return named
    usable = [i.address for i in found if not ipaddress.ip_address(i.address).is_loopback]
    try:
        named_host = socket.gethostbyname(socket.gethostname())
    except OSError:
        named_host = ""
    first = [named_host] if named_host in usable else []  # what the host's name says, when it is real
    ordered = first + [a for a in usable if a not in first]
    if not ordered:
        raise NetworkError(
            f"rank 0's host {socket.gethostname()} has no non-loopback IPv4 address, but the job spans "
            "several hosts. Fix: bring up the interface the hosts share, or set MASTER_ADDR"
        )
    return ordered


class _Listeners:
    """Listening sockets that accept and close every connection in a thread of their own until closed:
    a connection is the whole message, and an accepted one never fills the backlog of a large job."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.sockets: list[socket.socket] = []
        try:
            for address in addresses:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, 0))
                sock.listen(socket.SOMAXCONN)
        except OSError:
            self.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mp-preflight", daemon=True)
        self._thread.start()

    def endpoints(self) -> list[tuple[str, int]]:
        return [(str(s.getsockname()[0]), int(s.getsockname()[1])) for s in self.sockets]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select(self.sockets, [], [], 0.1)
            except (OSError, ValueError):  # closed under us
                return
            for sock in ready:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                conn.close()

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self._thread.join()
        for sock in self.sockets:
            sock.close()


def _reach(targets: Sequence[tuple[str, int]], deadline: float) -> dict[int, tuple[str | None, str]]:
    """Try each (address, port) until it answers or the deadline passes. Index -> (this end's address
    or None, the last error)."""
    outcome: dict[int, tuple[str | None, str]] = {i: (None, "not tried") for i in range(len(targets))}
    pending = list(range(len(targets)))
    while pending:
        for i in list(pending):
            wait = max(0.1, min(_ATTEMPT, deadline - time.monotonic()))
            try:
                with socket.create_connection(targets[i], timeout=wait) as conn:
                    outcome[i] = (str(conn.getsockname()[0]), "")
                pending.remove(i)
            except OSError as exc:
                outcome[i] = (None, exc.strerror or type(exc).__name__)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return outcome


def _agree(comm: Any, local: Any) -> list[Any]:
    """Every rank's `local`, on every rank."""
    return list(comm.allgather(local))


def choose_job_address(
    comm: Any, rank: int, node: int, num_nodes: int, *, environ: Mapping[str, str], timeout: float
) -> JobAddress:
    """Choose the job's addresses and check that the hosts reach each other. Collective over `comm`
    (the MPI communicator of the whole job); raises NetworkError on every rank when any rank fails."""
    if num_nodes == 1:
        return JobAddress("127.0.0.1", "127.0.0.1", "lo")

    # 1. Rank 0 offers its addresses; every rank tries them.
    offer: list[tuple[str, int]] | str
    listeners: _Listeners | None = None
    if rank == 0:
        try:
            listeners = _Listeners(rendezvous_candidates(environ))
            offer = listeners.endpoints()
        except (NetworkError, OSError) as exc:
            offer = str(exc)
        offer = comm.bcast(offer, root=0)
    else:
        offer = comm.bcast(None, root=0)
    if isinstance(offer, str):
        raise NetworkError(f"rank 0 could not offer an address for the rendezvous: {offer}")
    # Each phase's bound starts once the ranks have met, not when this rank arrived: ranks that start
    # minutes apart (torch imported on a loaded host) must not leave the late phase a single try.
    deadline = time.monotonic() + timeout
    try:
        reached: dict[int, tuple[str | None, str]]
        if rank == 0:
            reached = {i: (address, "") for i, (address, _) in enumerate(offer)}
        else:
            reached = _reach(offer, deadline)
        everyone = _agree(comm, (socket.gethostname(), reached))
    finally:
        if listeners is not None:
            listeners.close()
    choice = next(
        (i for i in range(len(offer)) if all(result[i][0] is not None for _, result in everyone)), None
    )
    if choice is None:
        raise NetworkError(_unreachable_report(offer, everyone, "rank 0", timeout))
    rendezvous = offer[choice][0]
    mine = everyone[rank][1][choice][0]
    assert mine is not None
    if rank == 0:
        mine = rendezvous

    # 2. Every host reaches every other host on the chosen addresses (gloo connects every pair).
    leader = _agree(comm, (node, mine))
    listener: _Listeners | None = None
    port: int | str | None = None
    if all(n != node for n, _ in leader[:rank]):  # this node's first rank listens for the others
        try:
            listener = _Listeners([mine])
            port = listener.endpoints()[0][1]
        except OSError as exc:
            port = f"rank {rank} on {socket.gethostname()} cannot listen on {mine}: {exc}"
    ports = _agree(comm, port)
    refused = [p for p in ports if isinstance(p, str)]
    if refused:
        if listener is not None:
            listener.close()
        raise NetworkError(f"the preflight could not start: {refused[0]}")
    hosts = {leader[r][0]: (leader[r][1], port, r) for r, port in enumerate(ports) if port is not None}
    others = [(addr, port) for n, (addr, port, _) in sorted(hosts.items()) if n != node]
    try:
        result = _reach(others, time.monotonic() + timeout)
        names = [f"node {n} (rank {r})" for n, (_, _, r) in sorted(hosts.items()) if n != node]
        failures = [(names[i], others[i], err) for i, (got, err) in result.items() if got is None]
        everyone_failures = _agree(comm, (socket.gethostname(), failures))
    finally:
        if listener is not None:
            listener.close()
    broken = [(r, host, f) for r, (host, f) in enumerate(everyone_failures) if f]
    if broken:
        lines = [
            f"rank {r} on {host} (from {leader[r][1]}) could not reach {name} at {addr}:{port}: {err}"
            for r, host, fs in broken[:8]
            for name, (addr, port), err in fs[:4]
        ]
        raise NetworkError(
            f"the job's hosts do not all reach each other within {timeout:g} s:\n  "
            + "\n  ".join(lines)
            + "\nFix: set MP_IFNAME to the interface on the network the hosts share (the same on every "
            "host), check the firewall between them, or raise MP_PREFLIGHT_TIMEOUT"
        )
    iface = interface_of(mine)
    log.debug("job network: rendezvous %s, this rank %s on %s", rendezvous, mine, iface)
    return JobAddress(rendezvous, mine, iface)


def address_towards(host: str, port: int, timeout: float) -> JobAddress:
    """This rank's address on the job's network, as the end of a connection to the rendezvous store
    at (host, port) that a launcher such as torchrun opened: the address the others reach this host by.
    Raises NetworkError naming the address when it does not answer within `timeout` seconds."""
    rendezvous = _resolve(host, "MASTER_ADDR")
    result = _reach([(rendezvous, port)], time.monotonic() + timeout)
    mine, error = result[0]
    if mine is None:
        raise NetworkError(
            f"{socket.gethostname()} could not reach the rendezvous store at {rendezvous}:{port} "
            f"(MASTER_ADDR, MASTER_PORT) within {timeout:g} s: {error}. Fix: start the job with a "
            "--rdzv-endpoint (or --master-addr) that every host reaches, check the firewall, or raise "
            "MP_PREFLIGHT_TIMEOUT"
        )
    return JobAddress(rendezvous, mine, interface_of(mine))


def _unreachable_report(
    offer: Sequence[tuple[str, int]],
    everyone: Sequence[tuple[str, dict[int, tuple[str | None, str]]]],
    whom: str,
    timeout: float,
) -> str:
    lines = []
    for r, (host, result) in enumerate(everyone):
        failed = [f"{offer[i][0]}:{offer[i][1]} ({err})" for i, (got, err) in result.items() if got is None]
        if failed:
            lines.append(f"rank {r} on {host} could not reach {whom} at " + ", ".join(failed))
    shown = lines[:8] + ([f"... and {len(lines) - 8} more ranks"] if len(lines) > 8 else [])
    return (
        f"no address of {whom}'s host {everyone[0][0]} is reachable from every rank within {timeout:g} s "
        f"(tried {', '.join(a for a, _ in offer)}):\n  "
        + "\n  ".join(shown)
        + "\nFix: set MP_IFNAME to the interface on the network the hosts share (or MASTER_ADDR to rank 0's "
        "address on it), check the firewall between the hosts, or raise MP_PREFLIGHT_TIMEOUT"
    )
