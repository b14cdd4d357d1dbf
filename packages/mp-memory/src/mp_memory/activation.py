"""Activation checkpointing: recompute a module's activations in backward instead of keeping them.

Built on ``torch.utils.checkpoint`` (non-reentrant), free of mp's other packages. Two forms:

- functional: :func:`checkpoint_module` runs one module call under a checkpoint, :func:`checkpoint_sequential`
  runs an ``nn.Sequential`` with its children grouped into checkpointed segments by a strategy;
- marks: :func:`mark_module` and :func:`mark_sequential` replace a module instance's ``forward`` so that
  every later call is checkpointed (smp's ``set_activation_checkpointing``).

Strategies (for an ``nn.Sequential``): ``"each"`` child alone, ``"group_<k>"`` runs of k children, or
``"contiguous"`` runs of children with the same owner key (with no owner key, the whole Sequential). An
``owner`` callable (child index -> key) keeps segments from mixing children that live in different places
(the umbrella passes each child's pipeline rank).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from mp_memory.errors import CheckpointArgumentError
from mp_memory.offload import offloading

__all__ = [
    "Mark",
    "checkpoint_module",
    "checkpoint_run",
    "checkpoint_sequential",
    "group_size",
    "mark_module",
    "mark_of",
    "mark_sequential",
    "run_children",
    "segments",
]

_MARK = "_mp_activation_checkpoint"


def checkpoint_module(
    function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in backward (non-reentrant
    ``torch.utils.checkpoint``). ``preserve_rng_state`` replays the RNG state, so dropout draws the
    same masks. Without grad mode it is a plain call."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    with offloading():  # with offload_activations: the inputs the checkpoint keeps go to host memory
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
        )


def group_size(strategy: str) -> int | None:
    """The segment size a strategy names: 1 for ``"each"``, k for ``"group_<k>"``, None for
    ``"contiguous"``; raises :class:`CheckpointArgumentError` for anything else."""
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return None
    k = strategy.removeprefix("group_") if isinstance(strategy, str) else ""
    if isinstance(strategy, str) and strategy.startswith("group_") and k.isdigit() and int(k) > 0:
        return int(k)
    raise CheckpointArgumentError(
        f"strategy={strategy!r}; expected 'each', 'contiguous' or 'group_<k>' with k >= 1 (e.g. 'group_2')"
    )


def segments(strategy: str, n: int, owner: Callable[[int], object] | None = None) -> list[list[int]]:
    """Indices 0..n-1 grouped by ``strategy``, never mixing two owner keys in one segment."""
    size = group_size(strategy)
    out: list[list[int]] = []
    for i in range(n):
        last = out[-1] if out else None
        fits = last is not None and (size is None or len(last) < size)
        if fits and (owner is None or owner(last[0]) == owner(i)):  # type: ignore[index]
            last.append(i)  # type: ignore[union-attr]
        else:
            out.append([i])
    return out


def run_children(modules: Sequence[nn.Module], x: Any, pack_args_as_tuple: bool = False) -> Any:
    """Run modules one after another. A tuple flowing between them is spread over the next module's
    arguments, unless ``pack_args_as_tuple`` (then each module takes it as one argument)."""
    for m in modules:
        x = m(x) if pack_args_as_tuple or not isinstance(x, tuple) else m(*x)
    return x


def checkpoint_sequential(
    sequential: nn.Sequential,
    input: Any,
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """Run ``sequential`` on ``input`` with each segment of children (grouped by ``strategy``)
    checkpointed as one unit."""
    if not isinstance(sequential, nn.Sequential):
        raise CheckpointArgumentError(
            f"checkpoint_sequential needs an nn.Sequential; got {type(sequential).__name__}. "
            "Use checkpoint_module(module, *args) for other modules"
        )
    children = list(sequential.children())
    x = input
    for segment in segments(strategy, len(children)):
        x = checkpoint_run([children[i] for i in segment], x, preserve_rng_state, pack_args_as_tuple)
    return x


def checkpoint_run(
    modules: Sequence[nn.Module], x: Any, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False
) -> Any:
    """:func:`run_children` of ``modules`` on ``x`` as one checkpointed unit."""
    args = (x,) if pack_args_as_tuple or not isinstance(x, tuple) else x
    return checkpoint_module(
        _runner(modules, pack_args_as_tuple), *args, preserve_rng_state=preserve_rng_state
    )


def _runner(modules: Sequence[nn.Module], pack: bool) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        return run_children(modules, args[0] if pack or len(args) == 1 else args, pack)

    return run


# ------------------------------------------------------------------------------------------- marks
@dataclass
class Mark:
    """A module instance whose forward is checkpointed (see :func:`mark_module`)."""

    path: str
    preserve_rng_state: bool
    enabled: bool = True


class _Segment(threading.local):
    active = False
    """True while a Sequential segment runs under one checkpoint: its children then do not nest one."""


_SEGMENT = _Segment()


def mark_of(module: nn.Module) -> Mark | None:
    """The module's mark, if :func:`mark_module` or :func:`mark_sequential` marked it."""
    mark: Mark | None = module.__dict__.get(_MARK)
    return mark


def _active(mark: Mark, skip: Callable[[], bool]) -> bool:
    return mark.enabled and torch.is_grad_enabled() and not _SEGMENT.active and not skip()


def mark_module(
    module: nn.Module, path: str, preserve_rng_state: bool, skip: Callable[[], bool] = lambda: False
) -> Mark:
    """Checkpoint every later call of ``module`` (while ``skip()`` is false, e.g. not while tracing).
    Marking again only updates the options."""
    mark = mark_of(module)
    if mark is not None:
        mark.preserve_rng_state = preserve_rng_state
        return mark
    mark = Mark(path, preserve_rng_state)
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not _active(mark, skip):
            return original(*args, **kwargs)
        return checkpoint_module(original, *args, preserve_rng_state=mark.preserve_rng_state, **kwargs)

    module.__dict__[_MARK] = mark
    module.forward = forward
    return mark


def mark_sequential(
    seq: nn.Sequential,
    path: str,
    strategy: str,
    preserve_rng_state: bool,
    *,
    skip: Callable[[], bool] = lambda: False,
    owner: Callable[[int], object] | None = None,
    local: Callable[[int], bool] = lambda _i: True,
) -> list[Mark]:
    """Checkpoint ``seq``'s children: each child is marked (:func:`mark_module`); with a grouping
    strategy, a segment of several children that are all ``local(i)`` runs under one checkpoint (its
    children then do not nest their own), otherwise child by child. ``owner`` is read at call time (the
    partition may be decided after marking). Returns the marks (the children's, then ``seq``'s)."""
    group_size(strategy)
    prefix = f"{path}." if path else ""
    children = [(prefix + name, child) for name, child in seq.named_children()]
    marks = [mark_module(child, p, preserve_rng_state, skip) for p, child in children]
    if strategy == "each":
        return marks
    group = Mark(path, preserve_rng_state)

    def forward(x: Any) -> Any:
        for segment in segments(strategy, len(children), owner):
            modules = [children[i][1] for i in segment]
            if len(segment) > 1 and all(local(i) for i in segment) and _active(group, skip):
                x = checkpoint_module(_in_segment(modules), x, preserve_rng_state=group.preserve_rng_state)
            else:
                for m in modules:
                    x = m(x)
        return x

    seq.__dict__[_MARK] = group
    seq.forward = forward  # type: ignore[method-assign]
    return [*marks, group]


def _in_segment(modules: list[nn.Module]) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        _SEGMENT.active = True
        try:
            for m in modules:
                x = m(x)
        finally:
            _SEGMENT.active = False
        return x

    return run
