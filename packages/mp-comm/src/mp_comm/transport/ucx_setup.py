"""Setting up the UCX transport: importing ucxx lazily, the library clash with MPI, the configuration.

Kept apart from :mod:`mp_comm.transport.ucx` so that MPI's setup can preload UCX's libraries, and
configurations can be built, without the transport itself.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Literal

from mp_comm.errors import TransportUnavailableError
from mp_comm.network import interface_of

__all__ = [
    "UCXConfig",
    "foreign_ucx",
    "import_ucxx",
    "interface_of",
    "job_net_devices",
    "preload_before_mpi",
    "ucx_available",
]

log = logging.getLogger(__name__)


def preload_before_mpi() -> bool:
    """Load the UCX libraries of the ucxx wheels before MPI loads its own; whether they were loaded.

    The `mpich` wheel bundles an older UCX under the same library names (libucs.so.0, ...). Whichever
    is loaded first serves the whole process, and ucxx cannot run on MPICH's older copy, while MPICH
    runs on the newer one. Call this before the first `from mpi4py import MPI` (the MPI transport's
    `import_mpi` does, and so should whatever initializes MPI earlier). Does nothing when ucxx is not
    installed or MPI is already loaded.
    """
    if "mpi4py.MPI" in sys.modules or importlib.util.find_spec("libucx") is None:
        return False
    try:
        importlib.import_module("libucx").load_library()
    except Exception as exc:  # a broken install: the UCX transport will say so when it is used
        log.debug("preloading UCX failed: %s", exc)
        return False
    return True


def foreign_ucx() -> str | None:
    """The path of a UCX library loaded in this process from outside the ucxx wheels, if any (Linux)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or spec.origin is None:
        return None
    ours = os.path.dirname(spec.origin)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libucs.so") and not path.startswith(ours):
                    return path
    except OSError:
        return None
    return None


def import_ucxx() -> tuple[Any, Any]:
    """(libucxx, Array) from ucxx, or TransportUnavailableError naming the extra to install."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array
    except Exception as exc:  # ImportError, or a shared library that fails to load
        other = foreign_ucx() if isinstance(exc, OSError) else None
        if other is not None:
            raise TransportUnavailableError(
                f"ucxx cannot load ({exc}): this process already runs another UCX, {other}, loaded by MPI "
                "(the mpich wheel bundles one). Load ucxx's first: call "
                "mp_comm.transport.ucx.preload_before_mpi() before MPI is initialized."
            ) from exc
        raise TransportUnavailableError(
            f"the UCX transport needs ucxx, which cannot be imported here ({type(exc).__name__}: {exc}); "
            "install it with `pip install 'mp-comm[ucx]'` (the ucxx-cu12 wheels), or use the MPI transport."
        ) from exc
    return libucxx, Array


def ucx_available() -> bool:
    """Whether ucxx imports here (it may still fail to start; UCXTransport raises then)."""
    try:
        import_ucxx()
    except TransportUnavailableError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class UCXConfig:
    """Settings of the UCX transport (the shared ones are in TransportConfig)."""

    host: str | None = None
    """This rank's address on the job's network; UCX's network traffic uses the interface that holds it.
    None: 127.0.0.1 (the loopback interface) when all ranks share one node, else the address this
    host's name resolves to."""
    net_devices: str | None = None
    """UCX_NET_DEVICES for the transport's UCX context: the network devices UCX may use (its tcp
    transport listens on each one's address). None: the environment's UCX_NET_DEVICES when set, else
    the job's own: ``lo`` on one node; across nodes the interface of `host` and every RDMA device
    (/sys/class/infiniband). "all" is UCX's default: every interface."""
    buffered_devices: tuple[str, ...] = ("cuda",)
    """Device types whose payloads take the D2D path with persistent buffers and the handshake. Adding
    "cpu" runs that path on host memory (the tests do, on machines without GPUs)."""
    buffered_peers: Literal["cross-node", "all"] = "cross-node"
    """Which peers' buffered payloads take the handshake and the persistent buffers. Within a node UCX
    reads a CUDA tensor where it is over CUDA IPC and caches the memory handles itself, so there the
    handshake only adds a round trip and a copy: on an H100 with two ranks, sending straight was
    1.2-1.35x faster from 1 MB to 64 MB (docs/gpu.md). Across nodes RDMA needs registered memory,
    which the persistent buffers provide once. "all" runs the handshake within a node too."""
    recv_buffer_bytes: int = 256 << 20
    """Size of the persistent receive buffer per device type (allocated on first use; 0: no buffer)."""
    send_buffer_bytes: int = 256 << 20
    """Size of the persistent send buffer per device type (allocated on first use; 0: no buffer)."""
    stage_sends: Literal["cross-node", "always", "never"] = "cross-node"
    """When a buffered payload is first copied into the persistent send buffer (RDMA needs registered
    source memory; within a node CUDA IPC reads the tensor where it is)."""
    buffer_alignment: int = 256
    error_handling: bool = True
    """Ask UCX to detect failed peers (endpoint error handling); a failed peer raises PeerLostError."""

    def __post_init__(self) -> None:
        if self.net_devices is not None and not self.net_devices.strip():
            raise ValueError(
                f"net_devices={self.net_devices!r}; expected UCX device names such as 'eth0,mlx5_0:1', "
                "'all', or None for the job's own"
            )
        if self.recv_buffer_bytes < 0 or self.send_buffer_bytes < 0:
            raise ValueError(
                f"recv_buffer_bytes={self.recv_buffer_bytes}, send_buffer_bytes={self.send_buffer_bytes}; "
                "expected sizes >= 0 (0 disables a buffer)"
            )
        if self.buffered_peers not in ("cross-node", "all"):
            raise ValueError(f"buffered_peers={self.buffered_peers!r}; expected 'cross-node' or 'all'")
        if self.stage_sends not in ("cross-node", "always", "never"):
            raise ValueError(f"stage_sends={self.stage_sends!r}; expected 'cross-node', 'always' or 'never'")


def _rdma_devices() -> list[str]:
    # InfiniBand and RoCE ports ("mlx5_0:1"): RDMA opens no listening socket.
    ports = glob.glob("/sys/class/infiniband/*/ports/*")
    return sorted(f"{p.split('/')[-3]}:{p.split('/')[-1]}" for p in ports)


def job_net_devices(config: UCXConfig, single_node: bool) -> str | None:
    """UCX_NET_DEVICES for this rank's UCX context (see `UCXConfig.net_devices`); None leaves the
    environment's. Raises TransportUnavailableError when the job's interface cannot be found."""
    if config.net_devices is not None:
        return config.net_devices
    if os.environ.get("UCX_NET_DEVICES"):
        return None
    if single_node and config.host is None:
        return "lo"
    host = config.host or socket.gethostbyname(socket.gethostname())
    try:
        ipaddress.ip_address(host)
    except ValueError:  # a name
        host = socket.gethostbyname(host)
    if config.host is None and ipaddress.ip_address(host).is_loopback:
        raise TransportUnavailableError(
            f"this host's name ({socket.gethostname()}) resolves to {host}, a loopback address, but the job "
            "spans several nodes: set UCXConfig.host to this host's address on the job's network, or "
            "UCX_NET_DEVICES to its interface (e.g. UCX_NET_DEVICES=eth0,mlx5_0:1)"
        )
    name = interface_of(host)
    if name is None:
        raise TransportUnavailableError(
            f"no network interface of this host holds {host} (the UCX transport's address for this rank): "
            "set UCXConfig.host to an address of this host on the job's network, or UCX_NET_DEVICES to "
            "the interfaces UCX may use"
        )
    return ",".join([name, *_rdma_devices()])
