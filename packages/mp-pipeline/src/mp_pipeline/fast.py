"""Fast mode's plan (docs/pipeline.md): which outputs go straight from their owner to the next module.

Without it, every output of a remote module comes back to the rank that called it (the parent), which
sends it on to the next module: two transfers per activation, and two per gradient. Fast mode learns
in the first step, on every rank that calls remote modules, the producer-consumer relationships of
those calls: an output that the parent only passes on, unchanged, to exactly one other remote module.
From the second step on, the parent asks the producer to hand such an output to the consumer's owner
itself (:attr:`~mp_pipeline.messages.Request.handoff`) and gets a placeholder on the ``meta`` device
in its place; the consumer's gradient goes straight back to the producer. One transfer each.

"Only passes on" is observed, not assumed: while the first step runs, a torch function mode on the
parent's threads (:class:`_Watch`) marks every output that any torch function touches, beyond reading
its shape, dtype or grad state, and outputs that the parent returns (to its own caller, or from the
step function) count as used. A placeholder carries no data: a later step that reads one after all
(a flow change, which fast mode excludes) computes on ``meta`` tensors and fails loudly rather than
computing with wrong values, and passing one anywhere other than where the plan sends it raises
FlowChangedError.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CallKey", "FastPlan"]

CallKey = tuple[tuple[str, ...], int, int]
"""A remote call's place in a step, the same in every step of a static flow: (position in the module
graph, microbatch, how many calls with the same position and microbatch this rank made before)."""

Output = tuple[CallKey, int]
"""An output of a remote call: the call and the output's index among those that require grad."""

# What a parent may read of an output that it only passes on: metadata the placeholder has too.
# (``device`` is not among them: a placeholder's device is ``meta``.)
_METADATA = frozenset(
    {
        "shape",
        "size",
        "dim",
        "ndim",
        "ndimension",
        "dtype",
        "requires_grad",
        "grad_fn",
        "is_leaf",
        "_version",
        "numel",
        "nelement",
        "__len__",
        "layout",
        "is_floating_point",
        "is_complex",
        "stride",
        "is_contiguous",
        "element_size",
        "__hash__",
        "output_nr",
    }
)


def _name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    if name in {"__get__", "__set__"}:  # a property: name it by its descriptor
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return str(name)


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


class _Watch(TorchFunctionMode):
    """Marks the watched outputs that a torch function reads (thread-local, like every torch mode)."""

    def __init__(self, plan: FastPlan) -> None:
        super().__init__()
        self.plan = plan

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if _name(func) not in _METADATA:
            self.plan.touched((args, kwargs))
        return func(*args, **(kwargs or {}))


class FastPlan:
    """One rank's fast-mode plan as a requester: learned in the first step, followed in later ones.

    Pure bookkeeping: :class:`~mp_pipeline.remote.Remote` reports calls, outputs and consumptions; the
    runtime brackets each step with :meth:`begin_step` and :meth:`end_step`.
    """

    def __init__(self) -> None:
        self.learning = False
        """The current step is the one the plan is learned from."""
        self.learned = False
        self._handoff: dict[CallKey, tuple[tuple[int, int], ...]] = {}
        self._watched: dict[int, tuple[weakref.ReferenceType[torch.Tensor], Output]] = {}
        self._consumers: dict[Output, list[int]] = {}
        self._used: set[Output] = set()

    def begin_step(self) -> None:
        self.learning = not self.learned

    def end_step(self, *, completed: bool) -> None:
        """After the first completed step: hand off each output consumed by exactly one remote call and
        not used otherwise."""
        if self.learning and completed:
            plan: dict[CallKey, list[tuple[int, int]]] = {}
            for (call, k), dests in self._consumers.items():
                if len(dests) == 1 and (call, k) not in self._used:
                    plan.setdefault(call, []).append((k, dests[0]))
            self._handoff = {call: tuple(sorted(pairs)) for call, pairs in plan.items()}
            self.learned = True
        self.learning = False
        self._watched.clear()
        self._consumers.clear()
        self._used.clear()

    @property
    def planned(self) -> int:
        """How many outputs per step are handed off."""
        return sum(len(pairs) for pairs in self._handoff.values())

    def handoff(self, call: CallKey) -> tuple[tuple[int, int], ...]:
        """The outputs of ``call`` to hand off, as (index among outputs that require grad, global rank)."""
        return self._handoff.get(call, ())

    # -- learning ----------------------------------------------------------------------------------------
    def watching(self) -> AbstractContextManager[Any]:
        """Run the parent's code under the watch (a no-op outside the learning step)."""
        return _Watch(self) if self.learning else nullcontext()

    def produced(self, call: CallKey, outputs: tuple[torch.Tensor, ...]) -> None:
        for k, t in enumerate(outputs):
            self._watched[id(t)] = (weakref.ref(t), (call, k))

    def consumed(self, tensors: list[torch.Tensor], requires: tuple[bool, ...], dest: int) -> None:
        """A remote call to ``dest`` takes ``tensors``: watched ones it takes unchanged count as consumed;
        one that does not require grad there cannot be handed off (its owner keeps no gradient path)."""
        for t, r in zip(tensors, requires, strict=True):
            found = self._found(t)
            if found is not None:
                if r:
                    self._consumers.setdefault(found, []).append(dest)
                else:
                    self._used.add(found)

    def touched(self, obj: Any) -> None:
        """``obj`` (a structure of tensors) was read by the parent, or left its hands."""
        for t in _tensors(obj):
            found = self._found(t)
            if found is not None:
                self._used.add(found)

    def _found(self, t: torch.Tensor) -> Output | None:
        entry = self._watched.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None
