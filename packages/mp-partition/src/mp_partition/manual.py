"""Manual partitioning: ``partition(i)`` at module creation, ``set_partition`` afterwards.

While a ``partition(i)`` context is active in a thread, every ``nn.Module`` constructed in that thread is
marked with ``i``; nested contexts stack and the innermost wins. Creation is observed by wrapping
``nn.Module.__init__`` for as long as at least one context is active in any thread (the wrapper looks at
the calling thread's own stack, so other threads are unaffected); the original is put back when the last
context exits, on exceptions too. ``set_partition(module, i)`` marks existing modules. Marks live in a
weak dictionary: they never keep a module alive.

:func:`resolve_manual` turns the marks into one partition per ModuleNode: a module takes its own mark,
or the default partition when it has none (smp: "modules outside any context go to default_partition").
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ._walk import walk_modules
from .errors import InvalidPartitionIDError, SharedParameterPartitionError
from .nodes import ModuleNode

__all__ = [
    "clear_partition",
    "get_partition",
    "partition",
    "partition_marks",
    "resolve_manual",
    "set_partition",
]

_MARKS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_MARKS_LOCK = threading.Lock()
_LOCAL = threading.local()
_WRAPPER_FLAG = "_mp_partition_marking_init"


class _PatchState:
    """How many contexts are active (all threads) and the ``__init__`` to restore when none is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.original: Callable[..., None] | None = None


_PATCH = _PatchState()


def _stack() -> list[int]:
    stack: list[int] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = []
        _LOCAL.stack = stack
    return stack


def _check_index(index: object, num_partitions: int | None = None, where: str = "") -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidPartitionIDError(index, num_partitions, where)
    if num_partitions is not None and index >= num_partitions:
        raise InvalidPartitionIDError(index, num_partitions, where)
    return index


def _make_wrapper(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def marking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        stack = getattr(_LOCAL, "stack", None)
        if stack:
            with _MARKS_LOCK:
                _MARKS[self] = stack[-1]

    setattr(marking_init, _WRAPPER_FLAG, True)
    return marking_init


def _install() -> None:
    with _PATCH.lock:
        if _PATCH.active == 0:
            current = nn.Module.__init__
            if not getattr(current, _WRAPPER_FLAG, False):
                _PATCH.original = current
                nn.Module.__init__ = _make_wrapper(current)  # type: ignore[method-assign]
            else:
                _PATCH.original = None  # a wrapper of ours is already in place (left by an outer patcher)
        _PATCH.active += 1


def _uninstall() -> None:
    with _PATCH.lock:
        _PATCH.active -= 1
        if _PATCH.active == 0 and _PATCH.original is not None:
            # Put the original back only if nobody wrapped ours meanwhile; otherwise our wrapper stays
            # in their chain, inert (it only acts while this thread's stack is non-empty).
            if getattr(nn.Module.__init__, _WRAPPER_FLAG, False):
                nn.Module.__init__ = _PATCH.original  # type: ignore[method-assign]
            _PATCH.original = None


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to partition ``index``; the innermost context wins.

    The index is checked against the number of partitions when the plan is made
    (:func:`mp_partition.manual_partition`); here it must be a non-negative int.
    """
    checked = _check_index(index)
    _install()
    stack = _stack()
    stack.append(checked)
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


def set_partition(module: nn.Module, index: int, recurse: bool = True) -> None:
    """Puts an existing ``module`` (and with ``recurse`` all its submodules) on partition ``index``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_partition got {type(module).__name__}: expected a torch.nn.Module")
    checked = _check_index(index, where=type(module).__name__)
    targets = [e.module for e in walk_modules(module)] if recurse else [module]
    with _MARKS_LOCK:
        for m in targets:
            _MARKS[m] = checked


def clear_partition(module: nn.Module, recurse: bool = True) -> None:
    """Removes the marks of ``module`` (and with ``recurse`` of its submodules)."""
    targets = [e.module for e in walk_modules(module)] if recurse else [module]
    with _MARKS_LOCK:
        for m in targets:
            _MARKS.pop(m, None)


def get_partition(module: nn.Module) -> int | None:
    """The partition ``module`` was marked with, or None."""
    with _MARKS_LOCK:
        return _MARKS.get(module)


def partition_marks(model: nn.Module) -> dict[str, int]:
    """Canonical path -> mark, for the marked modules of ``model``."""
    out: dict[str, int] = {}
    with _MARKS_LOCK:
        for entry in walk_modules(model):
            mark = _MARKS.get(entry.module)
            if mark is not None:
                out[entry.path] = mark
    return out


def resolve_manual(root: ModuleNode, num_partitions: int, default_partition: int = 0) -> dict[int, int]:
    """The partition of every node (by ``ModuleNode.index``) from the marks.

    Raises :class:`InvalidPartitionIDError` for a mark (or default) outside ``[0, num_partitions)`` and
    :class:`SharedParameterPartitionError` when the modules of one node (modules sharing parameters) got
    different partitions.
    """
    default = _check_index(default_partition, num_partitions, where="default_partition")
    result: dict[int, int] = {}
    with _MARKS_LOCK:
        marks = {id(m): _MARKS.get(m) for node in root.walk() for m in node.modules}
    for node in root.walk():
        chosen: tuple[str, int] | None = None
        for path, module in zip(node.paths, node.modules, strict=True):
            mark = marks[id(module)]
            shown = path or "<root>"
            index = default if mark is None else _check_index(mark, num_partitions, where=f"module {shown!r}")
            if chosen is None:
                chosen = (shown, index)
            elif chosen[1] != index:
                raise SharedParameterPartitionError(chosen[0], chosen[1], shown, index)
        assert chosen is not None
        result[node.index] = chosen[1]
    return result
