"""Only the job's ranks are heard (transport/auth.py), and no rank listens beyond the job's interface.

No rank opens a listener: endpoints are made from the worker addresses the bootstrap exchanged, and
UCX's own network transports are limited to the job's interface (loopback on one node), which
/proc/net/tcp{,6} shows. A foreign process handed a rank's worker address introduces itself as rank 1
and sends a header and a control message made of a pickle that would create a folder when unpickled,
and an oversized control message. The rank drops them unread, counts them, and the job's own ranks
keep talking.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_comm.errors import TransportUnavailableError
from mp_comm.transport import ThreadBootstrap, auth
from mp_comm.transport.ucx import UCXConfig, UCXTransport
from mp_comm.transport.ucx_setup import job_net_devices
from tests.mp_comm._foreign_ucx import Payload
from tests.mp_comm._ucx_cases import (  # noqa: F401 (the skip reads ucx_problem)
    FAST,
    close_all,
    in_threads,
    needs_ucx,
    ucx_pair,
    ucx_problem,
)

FOREIGN = Path(__file__).with_name("_foreign_ucx.py")


def test_sealed_messages_open_only_with_the_secret_and_their_tag() -> None:
    secret, other = auth.new_secret(), auth.new_secret()
    sealed = auth.seal(secret, 7, b"header")
    assert auth.unseal(secret, 7, sealed) == b"header"
    assert auth.unseal(other, 7, sealed) is None  # another job's secret
    assert auth.unseal(secret, 8, sealed) is None  # replayed under another tag (sender, message)
    assert auth.unseal(secret, 7, sealed[:-1] + bytes([sealed[-1] ^ 1])) is None
    assert auth.unseal(secret, 7, b"short") is None
    assert auth.open_hello(secret, auth.hello(secret, 3)) == 3
    assert auth.open_hello(secret, bytes(auth.HELLO_BYTES)) is None


@needs_ucx
def test_a_foreign_process_with_a_crafted_pickle_runs_nothing(tmp_path: Path) -> None:
    # The payload is live: unpickled, it creates its folder (what an unchecked header would do).
    control = tmp_path / "control"
    os.environ["MP_FOREIGN_MARKER"] = str(control)
    try:
        pickle.loads(pickle.dumps(Payload()))
    finally:
        del os.environ["MP_FOREIGN_MARKER"]
    assert control.is_dir()

    a, b = ucx_pair()
    marker = tmp_path / "pwned"
    try:
        proc = subprocess.run(
            [sys.executable, str(FOREIGN), a._peers[0].hex()],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MP_FOREIGN_MARKER": str(marker)},
        )
        assert "sent True" in proc.stdout, proc.stdout + proc.stderr
        deadline = time.monotonic() + 20
        while a.rejected < 4 and time.monotonic() < deadline:  # the hello, header, control, oversized one
            time.sleep(0.05)
        assert a.rejected == 4, a.rejected
        assert not a._eps, "a refused hello opened an endpoint back"
        assert not marker.exists(), "the foreign pickle was unpickled"
        # the job carries on: rank 1's real messages still arrive
        b.send({"step": 1}, 0, tag="after")
        assert a.recv(1, "after", timeout=20).obj == {"step": 1}
    finally:
        close_all([a, b])


# -- what listens ---------------------------------------------------------------------------------------


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        found = re.fullmatch(r"socket:\[(\d+)\]", target)
        if found:
            inodes.add(found.group(1))
    return inodes


def _listening(inodes: set[str]) -> set[str]:
    """The local addresses of the TCP sockets among ``inodes`` that listen (/proc/net/tcp{,6})."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in (Path("/proc/net") / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])  # 32-bit words in host (little-endian) order
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(packed)))
    return found


def _listeners_of_a_talking_pair(ucx: UCXConfig, node_keys: tuple[str, str] = ("n", "n")) -> set[str]:
    """What the sockets a pair of ranks opened listen on, once both have sent and received."""
    before = _socket_inodes()
    boot = ThreadBootstrap.group(2)
    a, b = in_threads(lambda r: UCXTransport(boot[r], config=FAST, ucx=ucx, node_key=node_keys[r]), 2)
    try:
        a.send("ping", 1, tag="p")
        assert b.recv(0, "p").obj == "ping"
        b.send("pong", 0, tag="p")
        assert a.recv(1, "p").obj == "pong"
        return _listening(_socket_inodes() - before)
    finally:
        close_all([a, b])


def _outside_interface() -> tuple[str, str] | None:
    """(name, IPv4 address) of an interface of this host that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                return name, address
    return None


needs_proc_net = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")


@needs_ucx
@needs_proc_net
def test_no_rank_listens_beyond_loopback_on_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    listening = _listeners_of_a_talking_pair(UCXConfig())
    assert listening <= {"127.0.0.1", "::1"}, listening  # UCX's tcp transport, on loopback only
    outside = _outside_interface()
    if outside is not None:
        # The probe sees what UCX opens when let loose (its default): every interface, this one too.
        assert outside[1] in _listeners_of_a_talking_pair(UCXConfig(net_devices="all"))


@needs_ucx
@needs_proc_net
def test_across_nodes_ranks_listen_on_the_jobs_interface_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    outside = _outside_interface()
    if outside is None:
        pytest.skip("this host has no interface besides loopback")
    name, address = outside
    assert job_net_devices(UCXConfig(host=address), single_node=False).split(",")[0] == name
    listening = _listeners_of_a_talking_pair(UCXConfig(host=address), node_keys=("n0", "n1"))
    assert listening == {address}, listening


def test_the_network_devices_ucx_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert job_net_devices(UCXConfig(), single_node=True) == "lo"
    assert job_net_devices(UCXConfig(host="127.0.0.1"), single_node=False).split(",")[0] == "lo"
    assert job_net_devices(UCXConfig(net_devices="eth7,mlx5_0:1"), single_node=True) == "eth7,mlx5_0:1"
    with pytest.raises(TransportUnavailableError, match=r"192\.0\.2\.123.*UCXConfig\.host"):
        job_net_devices(UCXConfig(host="192.0.2.123"), single_node=False)  # not an address of this host
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.raises(TransportUnavailableError, match=r"127\.0\.1\.1, a loopback address.*several nodes"):
        job_net_devices(UCXConfig(), single_node=False)
    monkeypatch.setenv("UCX_NET_DEVICES", "ib0")
    assert job_net_devices(UCXConfig(), single_node=False) is None  # the user's own setting stands
    with pytest.raises(ValueError, match=r"net_devices=' '.*'all', or None"):
        UCXConfig(net_devices=" ")


@needs_ucx
def test_a_rank_that_cannot_find_its_interface_fails_every_rank() -> None:
    boot = ThreadBootstrap.group(2)
    configs = [UCXConfig(host="127.0.0.1"), UCXConfig(host="192.0.2.123")]  # rank 1's: not this host's

    def start(r: int) -> str:
        with pytest.raises(TransportUnavailableError) as info:
            UCXTransport(boot[r], config=FAST, ucx=configs[r], node_key=f"n{r}")
        return str(info.value)

    errors = in_threads(start, 2)
    assert "192.0.2.123" in errors[1] and "could not start on ranks [1]" in errors[0], errors
