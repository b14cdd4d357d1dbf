"""``smp.nn``: the distributed (tensor-parallel) modules. ``smp.nn.utils`` holds the primitives for
writing one (seed 001 Appendix I.6)."""

import mp.tensor_api  # noqa: F401  (installs the TP context provider)
from mp.nn import utils
from mp_tensor.nn import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)

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
    "utils",
]
