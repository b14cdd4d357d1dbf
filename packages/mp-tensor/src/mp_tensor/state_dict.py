"""State dicts of a tensor-parallel model in the layout of the original (non-distributed) model.

:func:`gather_state_dict` all-gathers the shards of every distributed module and translates each
replaced module's part back to the original module's keys (a Hugging Face block's, for example), so
the result loads into the unwrapped model with ``load_state_dict``. :func:`load_original_state_dict`
is the inverse: it loads such a state dict into the tensor-parallel model, each rank keeping its shards.
Both are collective over the TP group: every TP rank must call them at the same point.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from mp_tensor.nn.base import DistributedModule
from mp_tensor.replace import ORIGINAL_ATTR, Replacement

__all__ = ["distributed_roots", "gather_state_dict", "load_original_state_dict"]


def distributed_roots(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, DistributedModule]]:
    """The outermost distributed modules of ``model`` with their state-dict prefixes, in module order."""
    if isinstance(model, DistributedModule):
        yield prefix, model
        return
    for name, child in model.named_children():
        yield from distributed_roots(child, f"{prefix}{name}.")


def _translator(module: DistributedModule) -> Replacement | None:
    found = module.__dict__.get(ORIGINAL_ATTR)
    return found if isinstance(found, Replacement) else None


@torch.no_grad()
def gather_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the original model (collective over the TP group)."""
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for prefix, module in distributed_roots(model):
        for key in [k for k in out if k.startswith(prefix)]:
            del out[key]
        full = module.full_state_dict()
        replacement = _translator(module)
        if replacement is not None:
            full = replacement.to_original(full)
        out.update({f"{prefix}{k}": v for k, v in full.items()})
    return out


@torch.no_grad()
def load_original_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load an original-layout state dict into the tensor-parallel ``model``."""
    rest = dict(state_dict)
    for prefix, module in distributed_roots(model):
        part = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        for key in part:
            rest.pop(prefix + key, None)
        replacement = _translator(module)
        if replacement is not None:
            part = replacement.from_original(part)
        module.load_full_state_dict(part, strict=strict)
    distributed = {prefix for prefix, _ in distributed_roots(model)}
    result = model.load_state_dict(rest, strict=False)
    if strict:
        missing = [k for k in result.missing_keys if not any(k.startswith(p) for p in distributed)]
        if missing or result.unexpected_keys:
            raise KeyError(
                f"load_original_state_dict: missing keys {missing}, unexpected keys {result.unexpected_keys}"
            )
