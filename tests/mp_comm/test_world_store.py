"""The rendezvous store rank 0 opens listens on the job's address only, not on every interface."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest

from mp_comm.errors import WorldError
from mp_comm.world import _free_port_store


def _listening(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port`` (from /proc/net/tcp and tcp6; IPv6 ones
    as their hex form)."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        lines = path.read_text().splitlines()[1:] if path.exists() else []
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                v4 = table == "tcp"
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if v4 else address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_the_store_listens_on_the_jobs_address_only() -> None:
    store = _free_port_store("127.0.0.1", 1, datetime.timedelta(seconds=10))
    assert _listening(store.port) == {"127.0.0.1"}
    store.set("key", "value")
    assert store.get("key") == b"value"


def test_a_busy_port_is_a_clear_error() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(WorldError, match=f"port {port}"):
            _free_port_store("127.0.0.1", 1, datetime.timedelta(seconds=5), port)
    finally:
        taken.close()
