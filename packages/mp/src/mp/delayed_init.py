"""smp's delayed parameter initialization (``smp.delay_param_initialization``, and ``smp.model_creation``
under the ``delayed_parameter_initialization`` key), wired from ``mp_memory.delayed_init``.

A model built inside has its parameters on the meta device: no memory. ``smp.DistributedModel`` then
partitions it without tracing (nothing can run yet; the partition comes from the module tree and
parameter sizes, as with ``skip_tracing``), and right after partitioning each rank materializes and
initializes only the parameters of its own partition (each module's ``reset_parameters``, then the HF
model's ``_init_weights``). The first step then broadcasts data-parallel rank 0's values to the other
replicas, as for any model. Not with tensor parallelism yet (its modules copy the original weights into
their shards at wrap time).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from mp.errors import DelayedParamDeviceError
from mp_memory.delayed_init import has_meta_parameters, materialize, parameters_on_meta

__all__ = ["check", "defer_optimizer_loads", "delay_param_initialization", "delayed", "prepare"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Build the model inside: its parameters take no memory until partitioning (module docstring)."""
    with parameters_on_meta() if enabled else contextlib.nullcontext():
        yield


def delayed(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built under delayed initialization (it has meta parameters)."""
    return has_meta_parameters(module)


def check(module: torch.nn.Module, tp: int) -> None:
    """Before wrapping: a delayed model cannot be tensor-parallel yet."""
    if tp > 1 and delayed(module):
        raise DelayedParamDeviceError(
            "delayed parameter initialization with tensor_parallel_degree > 1 is not built in mp yet (the "
            "distributed modules copy the original weights into their shards when the model is wrapped). "
            "Fix: build the model without delayed initialization, or set tensor_parallel_degree to 1"
        )


def prepare(model: Any) -> None:
    """For a ``DistributedModel`` whose module has meta parameters: materialize this rank's parameters
    right after partitioning."""
    if not delayed(model.module):
        return
    real = [t for t in [*model.module.parameters(), *model.module.buffers()] if not t.is_meta]
    device = real[0].device if real else torch.device("cpu")

    def hook(m: Any, _optimizer: Any) -> None:
        n = materialize(m.module, lambda p: not m._is_remote(p), device)
        log.info("delayed initialization: %d parameter elements materialized on %s", n, device)

    model.register_post_partition_hook(hook)
    _defer_loads(model)


def _defer_loads(model: Any) -> None:
    """A state loaded before partitioning would be copied into meta parameters (nothing: copy_ into
    meta is a no-op) and then overwritten by the initialization. Until the model is partitioned, loads
    are kept and replayed right after this rank's parameters are materialized (the partition a partial
    state was saved with is still pinned at once, so that it is the one used)."""
    original = model.load_state_dict

    def load_state_dict(state_dict: Any, strict: bool = True, *args: Any, **kwargs: Any) -> Any:
        if model.partitioned or not delayed(model.module):
            return original(state_dict, strict, *args, **kwargs)
        saved_partition = state_dict.get("_smp_partition") if isinstance(state_dict, dict) else None
        same_partition = kwargs.get("same_partition_load", args[1] if len(args) > 1 else True)
        if saved_partition is not None and same_partition and model._pp > 1:
            model._pin_partition(saved_partition)
        model.register_post_partition_hook(lambda m, _opt: original(state_dict, strict, *args, **kwargs))
        log.info("delayed initialization: the loaded state is applied after partitioning")
        return None

    model.load_state_dict = load_state_dict


def defer_optimizer_loads(optimizer: Any) -> None:
    """The optimizer's ``load_state_dict`` before a delayed model is partitioned would move the loaded
    state onto the meta parameters' device (torch casts state to its parameter's device): replay it right
    after this rank's parameters are materialized instead."""
    from mp.state import state

    original = optimizer.load_state_dict

    def load_state_dict(state_dict: Any) -> Any:
        model = state.model
        if model is None or model.partitioned or not delayed(model.module):
            return original(state_dict)
        model.register_post_partition_hook(lambda _m, _opt: original(state_dict))
        return None

    optimizer.load_state_dict = load_state_dict
