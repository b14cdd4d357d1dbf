"""Point-to-point transports: the interface, MPI, UCX and in-process loopback.

Transports are passed explicitly (there is no registry). The MPI transport needs mpi4py with
MPI_THREAD_MULTIPLE; the UCX transport needs the optional extra ``mp-comm[ucx]`` and is imported
lazily, so this package imports without ucxx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mp_comm.transport.base import (
    ANY_SOURCE,
    ANY_TAG,
    Mailbox,
    MessageTransport,
    OrderCounter,
    Received,
    SendHandle,
    Transport,
    TransportConfig,
)
from mp_comm.transport.bootstrap import (
    Bootstrap,
    MPIBootstrap,
    ThreadBootstrap,
    TorchBootstrap,
    bootstrap_for_world,
)
from mp_comm.transport.loopback import LoopbackHub, LoopbackTransport
from mp_comm.transport.mpi import MPITransport
from mp_comm.transport.ucx_setup import UCXConfig, preload_before_mpi, ucx_available

if TYPE_CHECKING:
    from mp_comm.transport.ucx import UCXTransport

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "Bootstrap",
    "LoopbackHub",
    "LoopbackTransport",
    "MPIBootstrap",
    "MPITransport",
    "Mailbox",
    "MessageTransport",
    "OrderCounter",
    "Received",
    "SendHandle",
    "ThreadBootstrap",
    "TorchBootstrap",
    "Transport",
    "TransportConfig",
    "UCXConfig",
    "UCXTransport",
    "bootstrap_for_world",
    "preload_before_mpi",
    "ucx_available",
]

_LAZY = {"UCXTransport"}


def __getattr__(name: str) -> Any:
    # ucx.py imports ucxx only when a UCXTransport is created; importing the module lazily as well
    # keeps `import mp_comm.transport` light.
    if name in _LAZY:
        from mp_comm.transport import ucx

        return getattr(ucx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
