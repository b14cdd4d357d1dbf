"""``atp.nn``: the paper's module namespace (its Figure 9), ``ATPLinear`` and the transformer layer."""

from __future__ import annotations

from mp_tensor.atp.layer import ATPLayerNorm, ATPTransformerLayer, TransformerLayer
from mp_tensor.atp.linear import COLUMN_FIRST, ROW_FIRST, ATPLinear

__all__ = [
    "COLUMN_FIRST",
    "ROW_FIRST",
    "ATPLayerNorm",
    "ATPLinear",
    "ATPTransformerLayer",
    "TransformerLayer",
]
