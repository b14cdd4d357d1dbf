"""mp-comm: the process world, rank topology and process groups, transports and collectives of mp."""

from mp_comm import collectives
from mp_comm.collectives import CollectiveHandle
from mp_comm.errors import (
    CollectiveError,
    MessageDecodeError,
    MessageEncodeError,
    MPCommError,
    PeerLostError,
    PeerTimeoutError,
    TopologyError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
    WorldError,
)
from mp_comm.heartbeat import start as start_heartbeat
from mp_comm.heartbeat import stop as stop_heartbeat
from mp_comm.router import Route, Router, RouterConfig
from mp_comm.teardown import EXIT_TIMEOUT, Stage, at_exit
from mp_comm.topology import (
    PLACEMENT_ALIASES,
    GroupKind,
    RankCoords,
    Topology,
    build_topology,
    normalize_placement,
)
from mp_comm.transport import (
    ANY_SOURCE,
    ANY_TAG,
    LoopbackHub,
    LoopbackTransport,
    MPITransport,
    Received,
    SendHandle,
    Transport,
    TransportConfig,
    UCXConfig,
    ucx_available,
)
from mp_comm.waits import collective_wait
from mp_comm.world import Launcher, World, WorldInfo, detect_launcher, init_world, mpi_comm_of

__version__ = "0.1.0"

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "EXIT_TIMEOUT",
    "PLACEMENT_ALIASES",
    "CollectiveError",
    "CollectiveHandle",
    "GroupKind",
    "Launcher",
    "LoopbackHub",
    "LoopbackTransport",
    "MPCommError",
    "MPITransport",
    "MessageDecodeError",
    "MessageEncodeError",
    "PeerLostError",
    "PeerTimeoutError",
    "RankCoords",
    "Received",
    "Route",
    "Router",
    "RouterConfig",
    "SendHandle",
    "Stage",
    "Topology",
    "TopologyError",
    "Transport",
    "TransportClosedError",
    "TransportConfig",
    "TransportError",
    "TransportUnavailableError",
    "UCXConfig",
    "World",
    "WorldError",
    "WorldInfo",
    "at_exit",
    "build_topology",
    "collective_wait",
    "collectives",
    "detect_launcher",
    "init_world",
    "mpi_comm_of",
    "normalize_placement",
    "start_heartbeat",
    "stop_heartbeat",
    "ucx_available",
]
