"""Marking modules for tensor parallelism: ``tensor_parallelism`` and ``set_tensor_parallelism``.

A mark is ``(enabled, kwargs)`` on a module instance. :func:`tensor_parallelism` marks every module
*created* inside the block (the innermost block wins); :func:`set_tensor_parallelism` marks a whole
existing subtree. Marks only record the request: :func:`mp_tensor.replace.replace_modules` (called by
``DistributedModel``) does the replacement, of the outermost marked modules that can be distributed.

While a block is active, ``nn.Module.__init__`` is wrapped so that each new module is marked as soon
as it exists (before its own children are created), which is how modules built deep inside a model's
constructor (``GPT2LMHeadModel(config)``) are reached.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["MARK_ATTR", "TPMark", "mark_of", "set_tensor_parallelism", "tensor_parallelism"]

MARK_ATTR = "_mp_tp_mark"


@dataclass(frozen=True)
class TPMark:
    """Whether a module was asked to be distributed, and the constructor overrides for its replacement."""

    enabled: bool
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def mark_of(module: nn.Module) -> TPMark | None:
    """The mark of ``module``, or None when it was never marked."""
    mark = module.__dict__.get(MARK_ATTR)
    return mark if isinstance(mark, TPMark) else None


def _set_mark(module: nn.Module, mark: TPMark) -> None:
    module.__dict__[MARK_ATTR] = mark


_stack: contextvars.ContextVar[tuple[TPMark, ...]] = contextvars.ContextVar("mp_tensor_tp_marks", default=())
_patch_lock = threading.Lock()
_patch_depth = [0]  # active tensor_parallelism blocks, over all threads
_original_init = nn.Module.__init__


def _marking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    stack = _stack.get()
    if stack and MARK_ATTR not in self.__dict__:
        _set_mark(self, stack[-1])


def _patch(on: bool) -> None:
    with _patch_lock:
        _patch_depth[0] += 1 if on else -1
        if on and _patch_depth[0] == 1:
            nn.Module.__init__ = _marking_init  # type: ignore[method-assign]
        elif not on and _patch_depth[0] == 0:
            nn.Module.__init__ = _original_init  # type: ignore[method-assign]


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Mark the modules created inside for tensor parallelism (``enabled``) or against it.

    Nested blocks: the innermost wins. ``kwargs`` override the distributed module's constructor
    arguments (those it accepts) when a module created inside is replaced; an inner block's kwargs
    extend the outer block's.
    """
    outer = _stack.get()
    merged = {**(outer[-1].kwargs if outer else {}), **kwargs}
    token = _stack.set((*outer, TPMark(bool(enabled), merged)))
    _patch(True)
    try:
        yield
    finally:
        _patch(False)
        _stack.reset(token)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark ``module`` and its whole subtree (enabled or disabled), overriding earlier marks."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_tensor_parallelism got {module!r}; expected an nn.Module.")
    mark = TPMark(bool(enabled), dict(kwargs))
    for sub in module.modules():
        _set_mark(sub, mark)
