"""The built-in entries of the registry: ``nn.Linear``, ``nn.Embedding`` and the Hugging Face blocks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from mp_tensor.context import TPContext
from mp_tensor.hf import bert, gpt2, gptj, gptneo, llama, neox, t5, vit
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.embedding import DistributedEmbedding
from mp_tensor.nn.linear import DistributedLinear
from mp_tensor.registry import Registration, Registry, default_registry

__all__ = ["register_builtins"]


def _linear_check(module: nn.Module, tp_size: int) -> str | None:
    assert isinstance(module, nn.Linear)
    if module.in_features % tp_size:
        return f"in_features={module.in_features} is not divisible by the tensor-parallel degree {tp_size}"
    return None


def _linear_build(module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    assert isinstance(module, nn.Linear)
    new = DistributedLinear(module.in_features, module.out_features, module.bias is not None, tp=ctx)
    new.load_full_state_dict(module.state_dict())
    return new


def _embedding_check(module: nn.Module, tp_size: int) -> str | None:
    assert isinstance(module, nn.Embedding)
    if module.embedding_dim % tp_size:
        return (
            f"embedding_dim={module.embedding_dim} is not divisible by the tensor-parallel degree {tp_size}"
        )
    if module.max_norm is not None:
        return f"max_norm={module.max_norm} is not supported by DistributedEmbedding"
    return None


def _embedding_build(module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    assert isinstance(module, nn.Embedding)
    extra = {
        k: v
        for k, v in overrides.items()
        if k in ("initializer_range", "_skip_allgather", "_skip_scatter_and_merge", "vocab_parallel")
    }
    new = DistributedEmbedding(
        module.num_embeddings,
        module.embedding_dim,
        padding_idx=module.padding_idx,
        norm_type=module.norm_type,
        scale_grad_by_freq=module.scale_grad_by_freq,
        sparse=module.sparse,
        tp=ctx,
        **extra,
    )
    new.load_full_state_dict(module.state_dict())
    return new


def register_builtins(registry: Registry) -> None:
    """Add the built-in entries to ``registry``."""
    registry.add(Registration(nn.Linear, DistributedLinear, builder=_linear_build, check=_linear_check))
    registry.add(
        Registration(nn.Embedding, DistributedEmbedding, builder=_embedding_build, check=_embedding_check)
    )
    families = (gpt2, bert, llama, neox, gptneo, gptj, t5, vit)
    for reg in [r for family in families for r in family.registrations()]:
        registry.add(reg)


register_builtins(default_registry)
