"""smp's tensor-parallelism API, bridging mp_tensor to the config and groups built by ``smp.init``.

mp_tensor takes its process group explicitly (a ``TPContext``); this module builds that context from
``state`` and installs it as mp_tensor's fallback, so ``smp.nn.DistributedLinear(...)`` built after
``smp.init`` runs in the TP group. ``DistributedModel`` calls :func:`replace_tp_modules`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mp.delayed_init import delay_param_initialization, replacing
from mp.errors import DistributedModelWrappedError
from mp.state import state
from mp_comm import GroupKind
from mp_tensor import (
    DistributedModule,
    TPContext,
    default_dtype,
    default_registry,
    gather_state_dict,
    is_distributed_parameter,
    is_scaled_batch_parameter,
    load_original_state_dict,
    reduce_gradients,
    replace_modules,
    set_context_provider,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
    whole_stack_registry,
)
from mp_tensor import set_tensor_parallelism as _set_tensor_parallelism

__all__ = [
    "delay_param_initialization",
    "gather_state_dict",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "load_original_state_dict",
    "model_creation",
    "pin_tp_internals",
    "reduce_tp_gradients",
    "replace_tp_modules",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_context",
    "tp_register",
    "tp_register_with_module",
]


def tp_context() -> TPContext | None:
    """The TP context of the current ``smp.init`` (None before it)."""
    cfg = state.cfg
    if cfg is None or not state.initialized:
        return None
    group = state.process_groups.get(GroupKind.TP)
    return TPContext(
        group=group if cfg.tp > 1 else None,
        optimize=cfg.optimize,
        prescaled_batch=cfg.prescaled_batch,
        dtype=torch.float16 if cfg.fp16_params else None,
        seed=cfg.tensor_parallel_seed,
    )


set_context_provider(tp_context)

log = logging.getLogger(__name__)
_marking = tensor_parallelism  # model_creation's argument of that name hides the function inside it


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tensor_parallel_config: Any
) -> Iterator[None]:
    """Build the model inside (smp v1.10): with ``tensor_parallelism``, the modules created inside are
    marked for tensor parallelism (``tensor_parallel_config``: arguments for their distributed versions,
    as ``smp.tensor_parallelism(**kwargs)`` takes them); ``dtype`` is torch's default dtype while they
    are created (parameters and buffers made without an explicit dtype get it).

    With the config key ``delayed_parameter_initialization``, the parameters created inside are delayed
    as under ``smp.delay_param_initialization()`` (mp.delayed_init): no memory until partitioning.
    """
    mark = _marking(True, **tensor_parallel_config) if tensor_parallelism else contextlib.nullcontext()
    cfg = state.cfg
    delay = cfg is not None and cfg.delayed_parameter_initialization
    with mark, default_dtype(dtype), delay_param_initialization(enabled=delay):
        yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Enable (or disable) tensor parallelism for ``module``'s subtree; before ``DistributedModel``."""
    if state.model is not None:
        raise DistributedModelWrappedError(
            "smp.set_tensor_parallelism was called after smp.DistributedModel; "
            "call it before wrapping the model."
        )
    _set_tensor_parallelism(module, enabled, **kwargs)


def replace_tp_modules(model: nn.Module) -> nn.Module:
    """Replace the marked modules of ``model`` by their distributed versions (for ``DistributedModel``).

    At tp=1 only whole models are replaced (a Hugging Face GPT-2 becomes smp's
    DistributedTransformerLMHead, as in smp: mp_tensor.hf.stack); single layers stay as they are."""
    ctx = tp_context()
    if ctx is None:
        return model
    registry = None if ctx.distributed else whole_stack_registry(default_registry)
    with replacing(model):  # a delayed model: distributed modules on meta too (mp.delayed_init)
        return replace_modules(model, ctx, registry=registry)


def pin_tp_internals(model: nn.Module, owner: Callable[[str], int]) -> dict[str, int]:
    """Pipeline stages for the modules whose weights a distributed module uses directly (its
    ``LinearShard``s, layer norms, the LM head's embeddings): they never run as module calls, so they
    must live on the stage of the distributed module that uses them, whatever the partition said.
    Children holding distributed modules themselves (``seq_layers``) are called as modules and keep
    their own stages."""
    pins: dict[str, int] = {}
    for path, module in model.named_modules():
        if not isinstance(module, DistributedModule):
            continue
        for name, child in module.named_children():
            if any(isinstance(m, DistributedModule) for m in child.modules()):
                continue
            stage = owner(path)
            for sub, _ in child.named_modules(prefix=f"{path}.{name}" if path else name):
                pins[sub] = stage
    return pins


def reduce_tp_gradients(params: Any, average: bool = True) -> None:
    """Data-parallel gradient reduction of ``params`` with the TP rules (scaled-batch params over RDP)."""
    cfg = state.cfg
    assert cfg is not None
    reduce_gradients(
        params,
        dp_group=state.process_groups.get(GroupKind.DP),
        rdp_group=state.process_groups.get(GroupKind.RDP),
        tp_size=cfg.tp,
        prescaled_batch=cfg.prescaled_batch,
        average=average,
    )
