"""Non-distributed reference implementations of smp.nn's transformer modules, as smp documented them.

``DistributedLinear``, ``DistributedEmbedding`` and ``DistributedLayerNorm`` have ``nn.Linear``,
``nn.Embedding`` and ``nn.LayerNorm`` as their references.
"""

from mp_tensor.reference.transformer import (
    AttentionLayer,
    Transformer,
    TransformerLayer,
    TransformerLMHead,
    TransformerOutputLayer,
)

__all__ = ["AttentionLayer", "Transformer", "TransformerLMHead", "TransformerLayer", "TransformerOutputLayer"]
