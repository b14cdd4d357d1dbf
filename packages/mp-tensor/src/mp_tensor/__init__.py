"""mp-tensor: tensor parallelism for mp.

- smp's tensor parallelism: the distributed modules (`mp_tensor.nn`, exposed as `smp.nn`), their
  non-distributed references (`mp_tensor.reference`), the replacement registry and the context
  managers that mark modules for replacement, and tensor parallelism across data-parallel ranks.
- `mp_tensor.atp`: adaptive tensor parallelism on 2-D device meshes (ATPLinear, the ATP transformer
  layer, the hierarchical communication matrix and the mesh search).

Every function here takes its process group explicitly, through a `TPContext`.
"""

from mp_tensor import atp, nn, reference
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
from mp_tensor.context import TPContext, current_context, set_context_provider, use_context
from mp_tensor.enable import set_tensor_parallelism, tensor_parallelism
from mp_tensor.grads import reduce_gradients
from mp_tensor.nn import is_distributed_parameter, is_scaled_batch_parameter
from mp_tensor.registry import tp_register, tp_register_with_module
from mp_tensor.replace import replace_modules
from mp_tensor.state_dict import gather_state_dict, load_original_state_dict

__version__ = "0.1.0"

__all__ = [
    "ATPLinear",
    "ATPTransformerLayer",
    "CommMatrix",
    "DeviceMesh",
    "ModelShape",
    "SearchResult",
    "TPContext",
    "atp",
    "choose_mesh",
    "current_context",
    "gather_state_dict",
    "init_mesh",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "load_original_state_dict",
    "nn",
    "reduce_gradients",
    "reference",
    "replace_modules",
    "set_context_provider",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    "use_context",
]
