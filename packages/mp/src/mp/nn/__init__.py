"""``smp.nn``: the distributed (tensor-parallel) modules. ``smp.nn.utils`` holds the primitives for
writing one (docs/tensor.md)."""

import torch

import mp.tensor_api  # noqa: F401  (installs the TP context provider)
from mp.nn import huggingface, utils
from mp_tensor import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
    FlashAttentionLayer,
)


class FusedLayerNorm(torch.nn.LayerNorm):
    """smp's ``smp.nn.FusedLayerNorm`` (apex's, which smp wrapped): ``nn.LayerNorm`` with apex's arguments
    ``(normalized_shape, eps=1e-5, elementwise_affine=True)`` and parameter names. mp has no fused
    kernel: the math is torch's layer norm, and scripts written against apex's class run unchanged."""


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
    "FusedLayerNorm",
    "huggingface",
    "utils",
]
