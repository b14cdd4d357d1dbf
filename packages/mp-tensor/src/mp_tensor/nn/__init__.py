"""Distributed (tensor-parallel) modules: smp.nn."""

from mp_tensor.nn import utils
from mp_tensor.nn.attention import DistributedAttentionLayer
from mp_tensor.nn.base import (
    DistributedModule,
    ParamSpec,
    is_distributed_parameter,
    is_scaled_batch_parameter,
    param_spec,
)
from mp_tensor.nn.embedding import DistributedEmbedding
from mp_tensor.nn.flash_attention import FlashAttentionLayer
from mp_tensor.nn.layernorm import DistributedLayerNorm
from mp_tensor.nn.linear import DistributedLinear
from mp_tensor.nn.lm_head import DistributedTransformerLMHead
from mp_tensor.nn.output import DistributedTransformerOutputLayer
from mp_tensor.nn.transformer import DistributedTransformer, DistributedTransformerLayer

__all__ = [
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
    "ParamSpec",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "param_spec",
    "utils",
]
