"""mp-comm: the process world, rank topology and process groups, transports and collectives of mp."""

from mp_comm import collectives
from mp_comm.collectives import CollectiveHandle
from mp_comm.errors import CollectiveError, MPCommError, TopologyError, WorldError
from mp_comm.topology import (
    PLACEMENT_ALIASES,
    GroupKind,
    RankCoords,
    Topology,
    build_topology,
    normalize_placement,
)
from mp_comm.world import Launcher, World, WorldInfo, detect_launcher, init_world

__version__ = "0.1.0"

__all__ = [
    "PLACEMENT_ALIASES",
    "CollectiveError",
    "CollectiveHandle",
    "GroupKind",
    "Launcher",
    "MPCommError",
    "RankCoords",
    "Topology",
    "TopologyError",
    "World",
    "WorldError",
    "WorldInfo",
    "build_topology",
    "collectives",
    "detect_launcher",
    "init_world",
    "normalize_placement",
]
