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

__all__ = ["check", "delay_param_initialization", "delayed", "prepare"]

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
