"""The ATP mesh that `smp.init` builds when the config asks for one (`atp_mesh`, `atp_topology`).

Each tensor-parallel group becomes a `DeviceMesh(d1, d2)`, made current for `mp_tensor.atp` (so
`atp.nn.ATPLinear(...)` finds it). With `atp_mesh: "auto"` the mesh is the one with the least
predicted communication time on the interconnect: measured here, a preset, or a saved matrix.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mp.config import ModelParallelConfig
from mp.config_rules import parse_atp_mesh
from mp_comm import GroupKind, Topology, World
from mp_tensor import (
    CommMatrix,
    DeviceMesh,
    ModelShape,
    calibrate,
    choose_mesh,
    dual_nvlink_node,
    init_mesh,
    nvswitch_node,
    pcie_tree,
)

log = logging.getLogger(__name__)

# The choice of mesh does not depend on the model's size: every term of the paper's T_comm
# (equation 2) is proportional to L*b*s*h, so a unit shape ranks the meshes the same way.
_UNIT_SHAPE = ModelShape(layers=1, batch=1, seq=1, hidden=1)


def _topology_matrix(cfg: ModelParallelConfig, topology: Topology) -> CommMatrix:
    tp = cfg.tensor_parallel_degree
    source = cfg.atp_topology
    if source is None or source == "calibrate":
        return calibrate(groups=topology.groups(GroupKind.TP))
    presets = {
        "nvswitch": lambda: nvswitch_node(tp),
        "dual-nvlink": lambda: dual_nvlink_node(tp),
        "pcie": lambda: pcie_tree(gpus_per_switch=max(tp // 4, 1)),
    }
    if source in presets:
        return presets[source]()
    return CommMatrix.load(Path(source))


def setup_atp_mesh(cfg: ModelParallelConfig, world: World, topology: Topology) -> DeviceMesh | None:
    """Build and make current the mesh the config asks for; None when it asks for none. Collective."""
    if cfg.atp_mesh is None:
        return None
    if cfg.atp_mesh == "auto":
        result = choose_mesh(cfg.tensor_parallel_degree, _topology_matrix(cfg, topology), _UNIT_SHAPE)
        shape = (result.best.d1, result.best.d2)
        if world.rank == 0:
            log.info("ATP mesh search chose DeviceMesh%s:\n%s", shape, result.format_table())
    else:
        parsed = parse_atp_mesh(cfg.atp_mesh)
        assert parsed is not None  # validated with the config
        shape = parsed
    return init_mesh(shape, groups=topology.groups(GroupKind.TP))
