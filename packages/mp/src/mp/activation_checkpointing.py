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
from collections.abc import Iterator
from typing import Any

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
from mp_partition import is_tracing

__all__ = ["checkpoint", "checkpoint_attentions", "checkpoint_sequential", "set_activation_checkpointing"]

log = logging.getLogger(__name__)


def _strategy_error(exc: CheckpointArgumentError) -> CheckpointingConfigError:
    return CheckpointingConfigError(str(exc))


def _path(model: Any, module: nn.Module) -> str | None:
    return next((p for p, m in model.module.named_modules() if m is module), None)


def _owners(model: Any, path: str, module: nn.Module) -> set[int]:
    """The pp_ranks holding ``module`` and its submodules."""
    prefix = f"{path}." if path else ""
    return {model.placement.module_owner(prefix + sub if sub else path) for sub, _ in module.named_modules()}


def _owns(model: Any, path: str, module: nn.Module) -> bool:
    """Whether this rank owns ``module`` and everything inside it."""
    return _owners(model, path, module) == {int(model.placement.pp_rank)}


def _pipelined(model: Any) -> bool:
    return model is not None and bool(model.placement.pipelined)


def _split(model: Any, path: str, owners: set[int]) -> bool:
    """A module split across partitions: an error with manual partitioning, else warn and skip."""
    where = f"module {path or '<root>'!r} is split across pp_ranks {sorted(owners)}"
    if not state.require()[0].auto_partition:
        raise CheckpointingConfigError(
            f"activation checkpointing: {where}; a checkpointed module must lie in one partition. "
            "Assign it and all its submodules to one partition, or checkpoint its children instead"
        )
    log.warning("activation checkpointing skipped: %s by the automatic partition", where)
    return False


def _check_partition(model: Any, marks: list[Mark]) -> None:
    """After partitioning: a checkpointed module must lie in one partition (smp's rule)."""
    root = model.module
    for mark in marks:
        module = root.get_submodule(mark.path) if mark.path else root
        owners = _owners(model, mark.path, module)
        if len(owners) <= 1 or (isinstance(module, nn.Sequential) and mark_of(module) is mark):
            continue  # a Sequential's segments never span partitions
        mark.enabled = _split(model, mark.path, owners)


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
    path = _path(model, module)
    if path is None:
        raise CheckpointingConfigError(
            f"the {type(module).__name__} passed to set_activation_checkpointing is not part of the "
            "DistributedModel's module; pass one of its submodules"
        )
    if model.placement.pipelined:
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
            owner=lambda i: model.placement.module_owner(children[i][0]),
            local=lambda i: _owns(model, *children[i]),
        )
    else:
        marks = [mark_module(module, path, preserve_rng_state, skip=is_tracing)]
    if not model.partitioned:
        model.register_post_partition_hook(lambda m, _opt: _check_partition(m, marks))


@contextlib.contextmanager
def _checkpointed_remotely(model: Any, path: str) -> Iterator[None]:
    """Calls of module ``path`` made inside ask its owner to run it under a checkpoint."""
    flagged = model.runtime.remote.checkpointed
    added = path not in flagged
    flagged.add(path)
    try:
        yield
    finally:
        if added:
            flagged.discard(path)


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with its activations recomputed in backward (smp's
    ``smp.checkpoint``). Call it inside the model's forward, e.g. ``x = smp.checkpoint(self.block, x)``.
    The module is checkpointed on the rank that owns it (see the module docstring)."""
    if not isinstance(module, nn.Module):
        raise CheckpointingConfigError(
            f"smp.checkpoint checkpoints a module call; got {type(module).__name__}. Pass an nn.Module "
            "(wrap a function in a module, or use torch.utils.checkpoint for functions)"
        )
    model = state.model
    if is_tracing():
        return module(*args, **kwargs)  # the partitioner measures the plain call
    if not _pipelined(model):
        return checkpoint_module(module, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    path = _path(model, module)
    if path is None:  # not part of the partitioned model: it runs here
        return checkpoint_module(module, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    assert model is not None  # _pipelined(model)
    owners = _owners(model, path, module)
    if owners == {int(model.placement.pp_rank)}:
        return checkpoint_module(module, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    if len(owners) == 1:
        with _checkpointed_remotely(model, path):
            return module(*args, **kwargs)
    _split(model, path, owners)
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
    model = state.model
    path = _path(model, sequential_module) if _pipelined(model) else None
    if is_tracing():
        return run_children(list(sequential_module), input, pack_args_as_tuple)
    if path is None:
        return checkpoint_segments(sequential_module, input, strategy, preserve_rng_state, pack_args_as_tuple)
    assert model is not None  # a path is found in a pipelined model only
    prefix = f"{path}." if path else ""
    children = [(prefix + name, child) for name, child in sequential_module.named_children()]
    x = input
    for segment in segments(strategy, len(children), lambda i: model.placement.module_owner(children[i][0])):
        part = [children[i] for i in segment]
        if len(part) > 1 and all(_owns(model, p, m) for p, m in part):
            x = checkpoint_run([m for _, m in part], x, preserve_rng_state, pack_args_as_tuple)
            continue
        for _, child in part:
            args = (x,) if pack_args_as_tuple or not isinstance(x, tuple) else x
            x = checkpoint(child, *args, preserve_rng_state=preserve_rng_state)
    return x


def checkpoint_attentions(model: Any) -> int:
    """smp's ``checkpoint_attentions`` config key: checkpoint the attention of every distributed
    transformer layer of ``model`` (smp.nn.DistributedTransformerLayer, also those smp's
    tensor_parallelism() swapped in). Returns how many were marked."""
    from mp_tensor import DistributedTransformerLayer

    layers = [m for m in model.module.modules() if isinstance(m, DistributedTransformerLayer)]
    for layer in layers:
        set_activation_checkpointing(layer.attention)
    if not layers:
        log.warning(
            "checkpoint_attentions: the model has no smp.nn.DistributedTransformerLayer; nothing to do"
        )
    return len(layers)
