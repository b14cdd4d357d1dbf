"""The point-to-point transport the pipeline runs on.

Creating an MPI transport is collective (it duplicates the communicator), so mp-pipeline creates one
per process, the first time a pipelined model needs it (every rank constructs its DistributedModel
at the same point of the script), and keeps it until the process exits (mp_comm closes it then).
Messages carry their model and step, so one transport serves any number of models in turn.
"""

from __future__ import annotations

import threading
from typing import Any

from mp_comm.transport.base import Transport, TransportConfig
from mp_comm.transport.loopback import LoopbackTransport
from mp_comm.transport.mpi import MPITransport

__all__ = ["process_transport"]

_LOCK = threading.Lock()
_CACHE: dict[str, Transport] = {}


def process_transport(world: Any) -> Transport:
    """This process's pipeline transport over ``world`` (an mp_comm World); collective the first time."""
    with _LOCK:
        transport = _CACHE.get("transport")
        if transport is None or transport.closed:
            config = TransportConfig(timeout=3600.0)
            if world.size == 1:
                transport = LoopbackTransport.single(config=config)
            else:
                transport = MPITransport.from_world(world, config=config)
            _CACHE["transport"] = transport
        return transport
