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
    calibrate,
    choose_mesh,
    destroy_mesh,
    dual_nvlink_node,
    init_mesh,
    nvswitch_node,
    pcie_tree,
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
from mp_tensor.hf.stack_gpt import gptj_lm_head_kwargs, gptneo_lm_head_kwargs, gptneox_lm_head_kwargs
from mp_tensor.hf.translate import bert_from_smp, bert_to_smp, gpt2_from_smp, gpt2_lm_head_kwargs, gpt2_to_smp
from mp_tensor.hf.translate_gpt import (
    gptj_from_smp,
    gptj_to_smp,
    gptneo_from_smp,
    gptneo_to_smp,
    gptneox_from_smp,
    gptneox_to_smp,
)
from mp_tensor.nn import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
    FlashAttentionLayer,
    is_distributed_parameter,
    is_scaled_batch_parameter,
)
from mp_tensor.nn.base import DistributedModule, param_init, param_spec
from mp_tensor.nn.utils import (
    bwd_allreduce_for_tp,
    fused_allgather_for_tp,
    fwd_allreduce_for_tp,
    initialize_with_input_partition,
    initialize_with_output_partition,
    parameter_creation_scope,
    reduce_scatter_for_tp,
    scatter_and_merge_for_tp,
)
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
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedLinear",
    "DistributedModule",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FlashAttentionLayer",
    "ModelShape",
    "Replacement",
    "SearchResult",
    "TPContext",
    "TPModuleRegisterError",
    "UnsupportedTPModuleError",
    "algorithm_bandwidth",
    "atp",
    "bert_from_smp",
    "bert_to_smp",
    "bwd_allreduce_for_tp",
    "calibrate",
    "choose_mesh",
    "current_context",
    "default_dtype",
    "default_registry",
    "destroy_mesh",
    "distributed_roots",
    "dual_nvlink_node",
    "fused_allgather_for_tp",
    "fwd_allreduce_for_tp",
    "gather_state_dict",
    "gpt2_from_smp",
    "gpt2_lm_head_kwargs",
    "gpt2_to_smp",
    "gptj_from_smp",
    "gptj_lm_head_kwargs",
    "gptj_to_smp",
    "gptneo_from_smp",
    "gptneo_lm_head_kwargs",
    "gptneo_to_smp",
    "gptneox_from_smp",
    "gptneox_lm_head_kwargs",
    "gptneox_to_smp",
    "init_mesh",
    "initialize_with_input_partition",
    "initialize_with_output_partition",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "load_original_state_dict",
    "nn",
    "nvswitch_node",
    "param_init",
    "param_spec",
    "parameter_creation_scope",
    "pcie_tree",
    "reduce_gradients",
    "reduce_scatter_for_tp",
    "reference",
    "replace_modules",
    "scatter_and_merge_for_tp",
    "set_context_provider",
    "set_tensor_parallelism",
    "t_comm",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    "use_context",
    "whole_stack_registry",
]
