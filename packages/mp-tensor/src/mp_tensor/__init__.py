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
from mp_tensor.atp.search import algorithm_bandwidth, t_comm
from mp_tensor.context import TPContext, current_context, set_context_provider, use_context
from mp_tensor.enable import set_tensor_parallelism, tensor_parallelism
from mp_tensor.errors import (
    DistEmbeddingConfigError,
    DistTransformerConfigError,
    TPModuleRegisterError,
    UnsupportedTPModuleError,
)
from mp_tensor.grads import reduce_gradients
from mp_tensor.hf.stack import whole_stack_registry
from mp_tensor.nn import (
    DistributedEmbedding,
    DistributedTransformerLayer,
    is_distributed_parameter,
    is_scaled_batch_parameter,
)
from mp_tensor.nn.base import DistributedModule, param_init, param_spec
from mp_tensor.registry import default_registry, tp_register, tp_register_with_module
from mp_tensor.replace import ORIGINAL_ATTR, Replacement, default_dtype, replace_modules
from mp_tensor.state_dict import distributed_roots, gather_state_dict, load_original_state_dict

__version__ = "0.1.0"

__all__ = [
    "ORIGINAL_ATTR",
    "ATPLinear",
    "ATPTransformerLayer",
    "CommMatrix",
    "DeviceMesh",
    "DistEmbeddingConfigError",
    "DistTransformerConfigError",
    "DistributedEmbedding",
    "DistributedModule",
    "DistributedTransformerLayer",
    "ModelShape",
    "Replacement",
    "SearchResult",
    "TPContext",
    "TPModuleRegisterError",
    "UnsupportedTPModuleError",
    "algorithm_bandwidth",
    "atp",
    "choose_mesh",
    "current_context",
    "default_dtype",
    "default_registry",
    "distributed_roots",
    "gather_state_dict",
    "init_mesh",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "load_original_state_dict",
    "nn",
    "param_init",
    "param_spec",
    "reduce_gradients",
    "reference",
    "replace_modules",
    "set_context_provider",
    "set_tensor_parallelism",
    "t_comm",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    "use_context",
    "whole_stack_registry",
]
