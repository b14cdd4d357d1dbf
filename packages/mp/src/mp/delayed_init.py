"""smp's delayed parameter initialization (``smp.delay_param_initialization``, and ``smp.model_creation``
under the ``delayed_parameter_initialization`` key), wired from ``mp_memory.delayed_init``.

A model built inside has its parameters on the meta device: no memory. ``smp.DistributedModel`` then
partitions it without tracing (nothing can run yet; the partition comes from the module tree and
parameter sizes, as with ``skip_tracing``), and right after partitioning each rank materializes and
initializes only the parameters of its own partition (each module's ``reset_parameters``, then the HF
model's ``_init_weights``). The first step then broadcasts data-parallel rank 0's values to the other
replicas, as for any model.

With tensor parallelism the marked modules are replaced at wrap time as usual, but on the meta device too
(:func:`replacing`): the distributed modules are built with meta parameters and nothing is copied. After
partitioning each rank materializes its stage's parameters, and of the distributed ones only its own
shards: each shard is drawn again as its distributed module's constructor drew it (its full tensor,
sliced: mp_tensor's ``ParamInit``), one full tensor at a time. The values are those of the distributed
module's own init (``DistributedLinear``'s, ``DistributedTransformerLMHead``'s), not those of the
original module (a Hugging Face model's ``_init_weights``), which an eager build copies into the shards.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mp.optimizer_chain import ModelView, OptimizerPart
from mp_memory import DelayedInitError, has_meta_parameters, materialize, parameters_on_meta
from mp_partition import Placement
from mp_tensor import is_distributed_parameter, param_init

__all__ = [
    "DelayedLoads",
    "check",
    "defers_loads",
    "delay_param_initialization",
    "delayed",
    "prepare",
    "replacing",
]

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
    """Before wrapping: log what delayed initialization will do with this model."""
    if delayed(module):
        meta = sum(p.numel() for p in module.parameters() if p.is_meta)
        log.info("delayed initialization: %d parameter elements on meta until partitioning (tp=%d)", meta, tp)


def replacing(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Around the tensor-parallel replacement of ``module``: for a delayed model, the distributed modules
    are built with meta parameters (each created and dropped one at a time) and nothing is copied."""
    return parameters_on_meta() if delayed(module) else contextlib.nullcontext()


def _own_draws(root: torch.nn.Module) -> Callable[[torch.nn.Parameter], Callable[[], torch.Tensor] | None]:
    """For ``materialize``: a tensor-parallel shard's own initial value (its module's draw, sliced), else
    None (the module's init applies). A parameter that is a shard, or that belongs to one of mp_tensor's
    modules (ATP's layers), and does not say how it was drawn is refused: no other init knows its layout
    (a ``reset_parameters`` would initialize the slice as if it were the whole parameter)."""
    ours = {
        id(p)
        for m in root.modules()
        if type(m).__module__.startswith("mp_tensor.")
        for p in m.parameters(recurse=False)
    }

    def own(p: torch.nn.Parameter) -> Callable[[], torch.Tensor] | None:
        init = param_init(p)
        if init is not None:
            return init.draw
        if is_distributed_parameter(p) or id(p) in ours:
            raise DelayedInitError(
                f"delayed initialization cannot initialize a tensor-parallel parameter of shape "
                f"{tuple(p.shape)}: its distributed module does not record how it draws it (mp_tensor's "
                "ParamInit; ATP's layers do not). Fix: build this model without delayed initialization, "
                "or record the draw with mp_tensor.nn.base.set_param_init in the module's constructor"
            )
        return None

    return own


def own_draws(root: torch.nn.Module) -> Callable[[torch.nn.Parameter], Callable[[], torch.Tensor] | None]:
    """What draws each tensor-parallel shard of ``root`` (``materialize``'s ``own``; see ``_own_draws``):
    for sharded data parallelism, which materializes the model itself (mp.sharded)."""
    return _own_draws(root)


def prepare(
    module: torch.nn.Module,
    placement: Callable[[], Placement],
    after_partition: Callable[[Callable[[], None]], None],
) -> None:
    """For a ``DistributedModel``'s ``module`` with meta parameters: materialize this rank's parameters
    (by ``placement()``, the model's placement then) right after partitioning (``after_partition``)."""
    if not delayed(module):
        return
    real = [t for t in [*module.parameters(), *module.buffers()] if not t.is_meta]
    device = real[0].device if real else torch.device("cpu")

    def materialize_own() -> None:
        n = materialize(module, placement().is_local, device, own=_own_draws(module))
        log.info("delayed initialization: %d parameter elements materialized on %s", n, device)

    after_partition(materialize_own)


def defers_loads(module: torch.nn.Module, placement: Placement) -> bool:
    """Whether a state loaded into ``module`` now must wait until partitioning: a state loaded into meta
    parameters would be lost (copy_ into meta is a no-op) and then overwritten by the initialization, so
    the model's ``load_state_dict`` keeps it and loads it right after this rank's parameters are
    materialized (mp.model_state; the partition a partial state was saved with is pinned at once)."""
    return not placement.partitioned and delayed(module)


class DelayedLoads(OptimizerPart):
    """In the optimizer's chain: a ``load_state_dict`` before a delayed model is partitioned would move
    the loaded state onto the meta parameters' device (torch casts state to its parameter's device), so
    the parts below load it right after this rank's parameters are materialized instead."""

    name = "delayed loads"

    def __init__(self, model: ModelView) -> None:
        self.model = model

    def load_state_dict(self, inner: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]) -> None:
        model = self.model
        if model.placement.partitioned or not delayed(model.module):
            inner(state_dict)
            return
        model.after_partition(lambda: inner(state_dict))
