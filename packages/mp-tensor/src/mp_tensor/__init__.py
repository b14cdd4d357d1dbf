"""mp-tensor: tensor parallelism for mp.

- `mp_tensor.atp`: adaptive tensor parallelism on 2-D device meshes (ATPLinear, the ATP transformer
  layer, the hierarchical communication matrix and the mesh search).
"""

from mp_tensor import atp
from mp_tensor.atp import (
    ATPLinear,
    ATPTransformerLayer,
    CommMatrix,
    DeviceMesh,
    ModelShape,
    SearchResult,
    choose_mesh,
    init_mesh,
)

__version__ = "0.1.0"

__all__ = [
    "ATPLinear",
    "ATPTransformerLayer",
    "CommMatrix",
    "DeviceMesh",
    "ModelShape",
    "SearchResult",
    "atp",
    "choose_mesh",
    "init_mesh",
]
