"""Setting up the UCX transport: importing ucxx lazily, the library clash with MPI, the configuration.

Kept apart from :mod:`mp_comm.transport.ucx` so that MPI's setup can preload UCX's libraries, and
configurations can be built, without the transport itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

from mp_comm.errors import TransportUnavailableError

__all__ = ["UCXConfig", "foreign_ucx", "import_ucxx", "preload_before_mpi", "ucx_available"]

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
    """Address at which the other ranks reach this rank's listener. None: 127.0.0.1 when all ranks share
    one node, else the address this host's name resolves to."""
    port: int = 0
    """Listener port; 0 picks a free one."""
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
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port}; expected 0 (any free port) or a TCP port number")
        if self.recv_buffer_bytes < 0 or self.send_buffer_bytes < 0:
            raise ValueError(
                f"recv_buffer_bytes={self.recv_buffer_bytes}, send_buffer_bytes={self.send_buffer_bytes}; "
                "expected sizes >= 0 (0 disables a buffer)"
            )
        if self.buffered_peers not in ("cross-node", "all"):
            raise ValueError(f"buffered_peers={self.buffered_peers!r}; expected 'cross-node' or 'all'")
        if self.stage_sends not in ("cross-node", "always", "never"):
            raise ValueError(f"stage_sends={self.stage_sends!r}; expected 'cross-node', 'always' or 'never'")
