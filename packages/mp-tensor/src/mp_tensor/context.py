"""The tensor-parallel context a distributed module runs in: its group and the TP settings.

mp_tensor never reads the umbrella's global state. A :class:`TPContext` carries what a distributed module
needs (the TP process group, ``optimize``, ``prescaled_batch``, the parameter dtype and the TP seed)
and reaches a module in one of three ways, first match wins:

1. the ``tp=`` keyword of the module's constructor;
2. the innermost :func:`use_context` block around its construction;
3. the provider installed with :func:`set_context_provider` (the umbrella installs one that builds the
   context from ``smp.init``'s config and groups).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from mp_tensor.errors import NoTPContextError

__all__ = [
    "Optimize",
    "TPContext",
    "current_context",
    "set_context_provider",
    "use_context",
]

Optimize = Literal["speed", "memory"]


@dataclass(frozen=True, kw_only=True)
class TPContext:
    """Where and how distributed modules run."""

    group: dist.ProcessGroup | None = None
    """The tensor-parallel process group; None runs everything on one rank (tp size 1, no communication)."""
    optimize: Optimize = "memory"
    """Transformer distribution: "speed" (Megatron-style, replicated activations) or "memory" (sharded)."""
    prescaled_batch: bool = False
    """True when every rank of the TP group feeds the same batch (only slicing, no batch exchange)."""
    dtype: torch.dtype | None = None
    """dtype of the distributed modules' parameters (fp16_params); None keeps the default dtype."""
    seed: int = 0
    """Seed of the dropout generators of distributed modules (smp's tensor_parallel_seed)."""
    _size: int = field(default=0, repr=False, compare=False)
    _rank: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.optimize not in ("speed", "memory"):
            raise ValueError(
                f"TPContext got optimize={self.optimize!r}; expected 'speed' or 'memory'. Pass one of them."
            )
        size = 1 if self.group is None else dist.get_world_size(self.group)
        rank = 0 if self.group is None else dist.get_rank(self.group)
        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "_rank", rank)

    @property
    def size(self) -> int:
        """The tensor-parallel degree (ranks in the group)."""
        return self._size

    @property
    def rank(self) -> int:
        """This process's tp_rank."""
        return self._rank

    @property
    def distributed(self) -> bool:
        """True when there is more than one TP rank, i.e. collectives actually run."""
        return self._size > 1

    def with_(self, **changes: Any) -> TPContext:
        """A copy with some fields changed."""
        return replace(self, **changes)

    # A process group can be neither copied nor pickled; a context is immutable, so share it.
    def __deepcopy__(self, memo: dict[int, object]) -> TPContext:
        return self

    def __copy__(self) -> TPContext:
        return self


_active: contextvars.ContextVar[TPContext | None] = contextvars.ContextVar(
    "mp_tensor_tp_context", default=None
)
_provider: list[Callable[[], TPContext | None]] = []


@contextlib.contextmanager
def use_context(ctx: TPContext) -> Iterator[TPContext]:
    """Distributed modules constructed inside the block (without ``tp=``) run in ``ctx``."""
    token = _active.set(ctx)
    try:
        yield ctx
    finally:
        _active.reset(token)


def set_context_provider(provider: Callable[[], TPContext | None] | None) -> None:
    """Install the fallback that builds a context when none is active (None removes it)."""
    _provider.clear()
    if provider is not None:
        _provider.append(provider)


def current_context(explicit: TPContext | None = None, *, who: str = "a distributed module") -> TPContext:
    """``explicit`` if given, else the active :func:`use_context`, else the provider's context."""
    if explicit is not None:
        return explicit
    active = _active.get()
    if active is not None:
        return active
    if _provider:
        provided = _provider[0]()
        if provided is not None:
            return provided
    raise NoTPContextError(
        f"{who} was built with no tensor-parallel context: no tp= argument, no active "
        "mp_tensor.use_context(...) block and no provider. Call smp.init(...) first, or build it inside "
        "`with mp_tensor.use_context(TPContext(group=...)):`."
    )
