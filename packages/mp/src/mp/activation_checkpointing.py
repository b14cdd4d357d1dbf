"""smp's activation checkpointing API on a partitioned model: ``set_activation_checkpointing``,
``checkpoint`` and ``checkpoint_sequential``. The mechanism is ``mp_memory.activation``
(``torch.utils.checkpoint``, non-reentrant); this module adds smp's rules and mp's partitions.

A checkpointed module is recomputed on the rank that owns it: its recomputation cannot issue remote
calls from inside backward. So a module must lie wholly in one partition; a split one is an error with
manual partitioning and is left unchecked, with a warning, with automatic partitioning (smp's rules).

- ``set_activation_checkpointing`` marks the module before the first step, so the pipeline's partitioning
  wraps the marked forward: it is checkpointed on its owner whether called there or remotely.
- ``checkpoint(module, *args)`` inside a forward: a module this rank owns is checkpointed here; a module
  another rank owns wholly is called remotely with the request's ``checkpoint`` flag, so its owner runs
  it under a checkpoint.
- For an ``nn.Sequential`` a strategy groups children into segments (``"each"``, ``"group_<k>"``,
  ``"contiguous"``); a segment never mixes owners, and checkpoints as one unit when this rank owns it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from mp.errors import CheckpointingConfigError, DistributedModelNotWrappedError, StepFunctionCalledError
from mp.state import state
from mp_memory import (
    CheckpointArgumentError,
    Mark,
    checkpoint_module,
    checkpoint_run,
    group_size,
    mark_module,
    mark_of,
    mark_sequential,
    run_children,
    segments,
)
from mp_memory import checkpoint_sequential as checkpoint_segments
from mp_partition import Placement, is_tracing

if TYPE_CHECKING:
    from mp.model import DistributedModel

__all__ = ["checkpoint", "checkpoint_attentions", "checkpoint_sequential", "set_activation_checkpointing"]

log = logging.getLogger(__name__)

AfterPartition = Callable[[Callable[[], None]], None]
"""``after_partition(fn)``: run ``fn`` once the model is partitioned (a post-partition hook)."""


def _strategy_error(exc: CheckpointArgumentError) -> CheckpointingConfigError:
    return CheckpointingConfigError(str(exc))


def _path(root: nn.Module, module: nn.Module) -> str | None:
    return next((p for p, m in root.named_modules() if m is module), None)


def _owners(placement: Placement, path: str, module: nn.Module) -> set[int]:
    """The pp_ranks holding ``module`` and its submodules."""
    prefix = f"{path}." if path else ""
    return {placement.module_owner(prefix + sub if sub else path) for sub, _ in module.named_modules()}


def _owns(placement: Placement, path: str, module: nn.Module) -> bool:
    """Whether this rank owns ``module`` and everything inside it."""
    return _owners(placement, path, module) == {placement.pp_rank}


def _split(path: str, owners: set[int]) -> bool:
    """A module split across partitions: an error with manual partitioning, else warn and skip."""
    where = f"module {path or '<root>'!r} is split across pp_ranks {sorted(owners)}"
    if not state.require()[0].auto_partition:
        raise CheckpointingConfigError(
            f"activation checkpointing: {where}; a checkpointed module must lie in one partition. "
            "Assign it and all its submodules to one partition, or checkpoint its children instead"
        )
    log.warning("activation checkpointing skipped: %s by the automatic partition", where)
    return False


def _check_partition(root: nn.Module, placement: Placement, marks: list[Mark]) -> None:
    """After partitioning: a checkpointed module must lie in one partition (smp's rule)."""
    for mark in marks:
        module = root.get_submodule(mark.path) if mark.path else root
        owners = _owners(placement, mark.path, module)
        if len(owners) <= 1 or (isinstance(module, nn.Sequential) and mark_of(module) is mark):
            continue  # a Sequential's segments never span partitions
        mark.enabled = _split(mark.path, owners)


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """Checkpoint ``module`` (for an ``nn.Sequential``: its children, grouped by ``strategy``).

    Call it after ``smp.DistributedModel`` and before the first step. ``preserve_rng_state`` replays
    the RNG state in the recomputation (dropout gives the same masks). ``pack_args_as_tuple`` is
    deprecated in smp and has no effect."""
    model = state.model
    if model is None:
        raise DistributedModelNotWrappedError(
            "smp.set_activation_checkpointing needs the model wrapped: call it after "
            "smp.DistributedModel(model)"
        )
    _mark(
        module,
        root=model.module,
        placement=lambda: model.placement,
        after_partition=model.after_partition,
        preserve_rng_state=preserve_rng_state,
        pack_args_as_tuple=pack_args_as_tuple,
        strategy=strategy,
    )


def _mark(
    module: nn.Module,
    *,
    root: nn.Module,
    placement: Callable[[], Placement],
    after_partition: AfterPartition,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """``set_activation_checkpointing`` for ``module`` inside ``root`` (a DistributedModel's module):
    ``placement()`` is the model's placement when asked (it changes once, at partitioning);
    ``after_partition`` runs the check that no marked module is split over stages."""
    if not isinstance(module, nn.Module):
        raise CheckpointingConfigError(
            f"set_activation_checkpointing needs a torch.nn.Module; got {type(module).__name__}"
        )
    sequential = module if isinstance(module, nn.Sequential) else None
    if strategy != "each" and sequential is None:
        raise CheckpointingConfigError(
            f"strategy={strategy!r} applies to nn.Sequential only; "
            f"{type(module).__name__} takes strategy='each'"
        )
    try:
        group_size(strategy)
    except CheckpointArgumentError as exc:
        raise _strategy_error(exc) from exc
    path = _path(root, module)
    if path is None:
        raise CheckpointingConfigError(
            f"the {type(module).__name__} passed to set_activation_checkpointing is not part of the "
            "DistributedModel's module; pass one of its submodules"
        )
    if placement().pipelined:
        raise StepFunctionCalledError(
            "set_activation_checkpointing must be called before the first @smp.step (which partitions "
            "the model); call it right after smp.DistributedModel"
        )
    if pack_args_as_tuple:
        log.info("set_activation_checkpointing: pack_args_as_tuple is deprecated and has no effect")
    if sequential is not None:
        prefix = f"{path}." if path else ""
        children = [(prefix + name, child) for name, child in sequential.named_children()]
        marks = mark_sequential(
            sequential,
            path,
            strategy,
            preserve_rng_state,
            skip=is_tracing,
            owner=lambda i: placement().module_owner(children[i][0]),
            local=lambda i: _owns(placement(), *children[i]),
        )
    else:
        marks = [mark_module(module, path, preserve_rng_state, skip=is_tracing)]
    if not placement().partitioned:
        after_partition(lambda: _check_partition(root, placement(), marks))


@contextlib.contextmanager
def _checkpointed_remotely(flagged: set[str], path: str) -> Iterator[None]:
    """Calls of module ``path`` made inside ask its owner to run it under a checkpoint (``flagged``:
    the pipeline runtime's set of such paths)."""
    added = path not in flagged
    flagged.add(path)
    try:
        yield
    finally:
        if added:
            flagged.discard(path)


@dataclass(frozen=True)
class _Pipelined:
    """A pipelined model as a checkpoint call inside its forward needs it."""

    root: nn.Module
    """The DistributedModel's module (module paths are relative to it)."""
    placement: Placement
    flagged: set[str]
    """The pipeline runtime's paths of modules whose remote calls run under a checkpoint."""


def _pipelined(model: DistributedModel | None) -> _Pipelined | None:
    """What ``checkpoint`` needs of ``model`` when it is pipelined now; None otherwise."""
    if model is None or not model.placement.pipelined:
        return None
    assert model.runtime is not None  # a pipelined model has one
    return _Pipelined(model.module, model.placement, model.runtime.remote.checkpointed)


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with its activations recomputed in backward (smp's
    ``smp.checkpoint``). Call it inside the model's forward, e.g. ``x = smp.checkpoint(self.block, x)``.
    The module is checkpointed on the rank that owns it (see the module docstring)."""
    if not isinstance(module, nn.Module):
        raise CheckpointingConfigError(
            f"smp.checkpoint checkpoints a module call; got {type(module).__name__}. Pass an nn.Module "
            "(wrap a function in a module, or use torch.utils.checkpoint for functions)"
        )
    if is_tracing():
        return module(*args, **kwargs)  # the partitioner measures the plain call
    return _checkpoint(module, _pipelined(state.model), args, kwargs, preserve_rng_state)


def _checkpoint(
    module: nn.Module,
    pipelined: _Pipelined | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
) -> Any:
    """``checkpoint`` of ``module`` in a model that is ``pipelined`` (``_pipelined``) or not (None)."""
    if pipelined is None:
        return checkpoint_module(module, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    placement = pipelined.placement
    path = _path(pipelined.root, module)
    if path is None:  # not part of the partitioned model: it runs here
        return checkpoint_module(module, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    owners = _owners(placement, path, module)
    if owners == {placement.pp_rank}:
        return checkpoint_module(module, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    if len(owners) == 1:
        with _checkpointed_remotely(pipelined.flagged, path):
            return module(*args, **kwargs)
    _split(path, owners)
    return module(*args, **kwargs)


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: Any,
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """Run ``sequential_module`` on ``input`` with its children checkpointed in segments (smp's
    ``smp.checkpoint_sequential``). ``strategy``: ``"each"``, ``"group_<k>"`` or ``"contiguous"``.
    ``pack_args_as_tuple``: a tuple passed between children goes to the next child as one argument
    (else it is spread over its arguments)."""
    if not isinstance(sequential_module, nn.Sequential):
        raise CheckpointingConfigError(
            f"smp.checkpoint_sequential needs an nn.Sequential; got {type(sequential_module).__name__}. "
            "Use smp.checkpoint(module, *args) for other modules"
        )
    try:
        group_size(strategy)
    except CheckpointArgumentError as exc:
        raise _strategy_error(exc) from exc
    pipelined = _pipelined(state.model)
    path = _path(pipelined.root, sequential_module) if pipelined is not None else None
    if is_tracing():
        return run_children(list(sequential_module), input, pack_args_as_tuple)
    if pipelined is None or path is None:
        return checkpoint_segments(sequential_module, input, strategy, preserve_rng_state, pack_args_as_tuple)
    placement = pipelined.placement
    prefix = f"{path}." if path else ""
    children = [(prefix + name, child) for name, child in sequential_module.named_children()]
    x = input
    for segment in segments(strategy, len(children), lambda i: placement.module_owner(children[i][0])):
        part = [children[i] for i in segment]
        if len(part) > 1 and all(_owns(placement, p, m) for p, m in part):
            x = checkpoint_run([m for _, m in part], x, preserve_rng_state, pack_args_as_tuple)
            continue
        for _, child in part:
            args = (x,) if pack_args_as_tuple or not isinstance(x, tuple) else x
            x = _checkpoint(child, pipelined, args, {}, preserve_rng_state)
    return x


def checkpoint_attentions(
    root: nn.Module, placement: Callable[[], Placement], after_partition: AfterPartition
) -> int:
    """smp's ``checkpoint_attentions`` config key: checkpoint the attention of every distributed
    transformer layer of ``root``, a DistributedModel's module (smp.nn.DistributedTransformerLayer,
    also those smp's tensor_parallelism() swapped in; ``placement`` and ``after_partition`` as for
    :func:`_mark`). Returns how many were marked."""
    from mp_tensor import DistributedTransformerLayer

    layers = [m for m in root.modules() if isinstance(m, DistributedTransformerLayer)]
    for layer in layers:
        _mark(layer.attention, root=root, placement=placement, after_partition=after_partition)
    if not layers:
        log.warning(
            "checkpoint_attentions: the model has no smp.nn.DistributedTransformerLayer; nothing to do"
        )
    return len(layers)
