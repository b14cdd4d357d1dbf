"""`smp.set_activation_checkpointing`: recompute a module's activations in backward instead of keeping them.

The mark replaces the module instance's ``forward`` with one that runs the original under
``torch.utils.checkpoint`` (non-reentrant). It is set after wrapping and before the first step, so the
pipeline's partitioning wraps *this* forward: the module is checkpointed on the rank that owns it,
whether it is called there or through a remote request. A checkpointed module must lie wholly in one
partition (its recomputation cannot issue remote calls from inside backward): after partitioning, a
split module is an error with manual partitioning and is left unchecked, with a warning, with automatic
partitioning (smp's rules).

For an ``nn.Sequential``, ``strategy`` picks the unit: ``"each"`` child, ``"group_<k>"`` runs of k
children, or ``"contiguous"`` runs of children on the same partition. A run checkpoints as one segment
on the rank running the Sequential when that rank owns all of it; children owned elsewhere are each
checkpointed on their owner instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from mp.errors import CheckpointingConfigError, DistributedModelNotWrappedError, StepFunctionCalledError
from mp.state import state
from mp_partition import is_tracing

__all__ = ["set_activation_checkpointing"]

log = logging.getLogger(__name__)

_MARK = "_mp_activation_checkpoint"


@dataclass
class _Mark:
    path: str
    preserve_rng_state: bool
    enabled: bool = True


class _Segment(threading.local):
    active = False
    """True while a Sequential segment runs under one checkpoint: its children then do not nest one."""


_SEGMENT = _Segment()


def _checkpointed(fn: Callable[..., Any], preserve_rng_state: bool, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
    )


def _active(mark: _Mark) -> bool:
    return mark.enabled and torch.is_grad_enabled() and not is_tracing() and not _SEGMENT.active


def _mark_module(module: nn.Module, path: str, preserve_rng_state: bool) -> _Mark:
    """Checkpoint ``module``'s forward (marking again only updates the options)."""
    mark: _Mark | None = module.__dict__.get(_MARK)
    if mark is not None:
        mark.preserve_rng_state = preserve_rng_state
        return mark
    mark = _Mark(path, preserve_rng_state)
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not _active(mark):
            return original(*args, **kwargs)
        return _checkpointed(original, mark.preserve_rng_state, *args, **kwargs)

    module.__dict__[_MARK] = mark
    module.forward = forward
    return mark


def _segments(
    strategy: str, children: list[tuple[str, nn.Module]], owner: Callable[[str], int]
) -> list[list[int]]:
    """Child indices grouped by the strategy, never mixing children of different owners."""
    size = len(children) if strategy == "contiguous" else int(strategy.removeprefix("group_"))
    out: list[list[int]] = []
    for i, (path, _) in enumerate(children):
        if out and len(out[-1]) < size and owner(children[out[-1][0]][0]) == owner(path):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _mark_sequential(
    seq: nn.Sequential, path: str, strategy: str, preserve_rng_state: bool, model: Any
) -> list[_Mark]:
    prefix = f"{path}." if path else ""
    children = [(prefix + name, child) for name, child in seq.named_children()]
    marks = [_mark_module(child, p, preserve_rng_state) for p, child in children]
    if strategy == "each":
        return marks
    group = _Mark(path, preserve_rng_state)

    def forward(x: Any) -> Any:
        owner = model._module_owner
        for segment in _segments(strategy, children, owner):
            modules = [children[i][1] for i in segment]
            local = all(_owns(model, children[i][0], children[i][1]) for i in segment)
            if len(segment) > 1 and local and _active(group):
                x = _checkpointed(_run_segment(modules), group.preserve_rng_state, x)
            else:
                for m in modules:
                    x = m(x)
        return x

    seq.__dict__[_MARK] = group
    seq.forward = forward  # type: ignore[method-assign]
    return [*marks, group]


def _run_segment(modules: list[nn.Module]) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        _SEGMENT.active = True
        try:
            for m in modules:
                x = m(x)
        finally:
            _SEGMENT.active = False
        return x

    return run


def _owns(model: Any, path: str, module: nn.Module) -> bool:
    """Whether this rank owns ``module`` and everything inside it."""
    me = int(model._pp_rank)
    prefix = f"{path}." if path else ""
    return all(model._module_owner(prefix + sub if sub else path) == me for sub, _ in module.named_modules())


def _check_partition(model: Any, marks: list[_Mark]) -> None:
    """After partitioning: a checkpointed module must lie in one partition (smp's rule)."""
    cfg = state.require()[0]
    root = model.module
    for mark in marks:
        module = root.get_submodule(mark.path) if mark.path else root
        prefix = f"{mark.path}." if mark.path else ""
        owners = {
            model._module_owner(prefix + sub if sub else mark.path) for sub, _ in module.named_modules()
        }
        if len(owners) <= 1 or (isinstance(module, nn.Sequential) and module.__dict__.get(_MARK) is mark):
            continue  # a Sequential's segments never span partitions
        where = f"module {mark.path or '<root>'!r} is split across pp_ranks {sorted(owners)}"
        if not cfg.auto_partition:
            raise CheckpointingConfigError(
                f"activation checkpointing: {where}; a checkpointed module must lie in one partition. "
                "Assign it and all its submodules to one partition, or checkpoint its children instead"
            )
        log.warning("activation checkpointing skipped: %s by the automatic partition", where)
        mark.enabled = False


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
    k = strategy.removeprefix("group_")
    if strategy not in ("each", "contiguous") and not (
        strategy.startswith("group_") and k.isdigit() and int(k) > 0
    ):
        raise CheckpointingConfigError(
            f"strategy={strategy!r}; expected 'each', 'contiguous' or 'group_<k>' with k >= 1"
        )
    path = next((p for p, m in model.module.named_modules() if m is module), None)
    if path is None:
        raise CheckpointingConfigError(
            f"the {type(module).__name__} passed to set_activation_checkpointing is not part of the "
            "DistributedModel's module; pass one of its submodules"
        )
    if model.partitioned and model._pp > 1:
        raise StepFunctionCalledError(
            "set_activation_checkpointing must be called before the first @smp.step (which partitions "
            "the model); call it right after smp.DistributedModel"
        )
    if pack_args_as_tuple:
        log.info("set_activation_checkpointing: pack_args_as_tuple is deprecated and has no effect")
    if sequential is not None:
        marks = _mark_sequential(sequential, path, strategy, preserve_rng_state, model)
    else:
        marks = [_mark_module(module, path, preserve_rng_state)]
    if not model.partitioned:
        model.register_post_partition_hook(lambda m, _opt: _check_partition(m, marks))
