"""Helpers shared by the Hugging Face mappings: masks and the call hooks of a mapped block."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["ACTIVATION_MAP", "GELU_APPROXIMATION", "additive", "first", "sizes_reason"]

#: Hugging Face activation names -> the transformer layer's ``activation``.
ACTIVATION_MAP = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu"}
GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "relu": "relu"}
"""A Hugging Face ``activation_function`` -> the ``approximate`` of torch's GeLU ("relu": ReLU)."""


def additive(mask: Tensor | None, hidden: Tensor, keys: int | None = None) -> Tensor:
    """A Hugging Face attention mask (None, bool with True = attend, or additive) as an additive
    ``[N, 1, S_q, S_k]`` tensor.

    Hugging Face passes None when a batch has no padding (with SDPA) and a tensor otherwise, so ranks
    holding different samples would disagree; the mask is gathered over the TP group, so every rank
    must hand over a tensor of the same shape.
    """
    n, sq = hidden.shape[0], hidden.shape[1]
    sk = sq if keys is None else keys
    dtype = hidden.dtype
    if mask is None:
        return torch.zeros(n, 1, sq, sk, dtype=dtype, device=hidden.device)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask.to(dtype).expand(n, 1, sq, sk).contiguous()


def first(out: Any) -> Any:
    """The return hook of a mapped block: the hidden states out of ``(hidden, mask, ...)``."""
    return out[0]


def sizes_reason(tp_size: int, **sizes: int) -> str | None:
    """Why these sizes cannot be split over ``tp_size`` ranks, or None."""
    for name, value in sizes.items():
        if value % tp_size:
            return f"{name}={value} is not divisible by the tensor-parallel degree {tp_size}"
    return None
