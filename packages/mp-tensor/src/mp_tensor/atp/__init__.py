"""ATP: adaptive tensor parallelism on 2-D device meshes (Cheng et al., "ATP: Adaptive Tensor Parallelism
for Foundation Models").

The paper's API (its Figure 9) works as written::

    import mp_tensor.atp as atp

    atp.distributed.init_mesh((2, 2))
    shard_strategy = [atp.spm.Shard(1), atp.spm.Shard(0)]
    atp_linear = atp.nn.ATPLinear(256, 1024, shard_strategy)
    output_ = atp_linear(torch.randn(4, 512, 128))

Modules: :mod:`.mesh` (device meshes), :mod:`.spec` (sharding specs), :mod:`.linear` (row- and
column-first ``ATPLinear``), :mod:`.layer` (the transformer layer), :mod:`.overlap` (chunk-based
overlap), :mod:`.comm_matrix` (the hierarchical communication matrix), :mod:`.search` (equations 2-4 and
the mesh search), :mod:`.calibrate` (measured bandwidths), :mod:`.cli` (``python -m mp_tensor.atp``).
"""

from __future__ import annotations

from mp_tensor.atp import distributed, nn, spm
from mp_tensor.atp.calibrate import calibrate, measure_mesh
from mp_tensor.atp.comm_matrix import (
    CommLayer,
    CommMatrix,
    cluster,
    dual_nvlink_node,
    ethernet_cluster,
    fully_connected,
    infiniband_cluster,
    nvswitch_node,
    pcie_tree,
    torus_2d,
)
from mp_tensor.atp.distributed import destroy_mesh, get_mesh, init_mesh, set_mesh
from mp_tensor.atp.errors import ATPError, CommMatrixError, MeshError, SearchError, ShardingError
from mp_tensor.atp.layer import ATPLayerNorm, ATPTransformerLayer, TransformerLayer
from mp_tensor.atp.linear import COLUMN_FIRST, ROW_FIRST, ATPLinear
from mp_tensor.atp.mesh import DeviceMesh, create_mesh
from mp_tensor.atp.search import MeshEstimate, ModelShape, SearchResult, choose_mesh, mesh_shapes, t_comm
from mp_tensor.atp.spec import Partial, Placement, Replicate, Shard, distribute, to_global

__all__ = [
    "COLUMN_FIRST",
    "ROW_FIRST",
    "ATPError",
    "ATPLayerNorm",
    "ATPLinear",
    "ATPTransformerLayer",
    "CommLayer",
    "CommMatrix",
    "CommMatrixError",
    "DeviceMesh",
    "MeshError",
    "MeshEstimate",
    "ModelShape",
    "Partial",
    "Placement",
    "Replicate",
    "SearchError",
    "SearchResult",
    "Shard",
    "ShardingError",
    "TransformerLayer",
    "calibrate",
    "choose_mesh",
    "cluster",
    "create_mesh",
    "destroy_mesh",
    "distribute",
    "distributed",
    "dual_nvlink_node",
    "ethernet_cluster",
    "fully_connected",
    "get_mesh",
    "infiniband_cluster",
    "init_mesh",
    "measure_mesh",
    "mesh_shapes",
    "nn",
    "nvswitch_node",
    "pcie_tree",
    "set_mesh",
    "spm",
    "t_comm",
    "to_global",
    "torus_2d",
]
