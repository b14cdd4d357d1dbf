"""Fast mode's posted calls: remote calls whose response the requester predicts instead of awaiting.

Under fast mode a parent that only passes a child's outputs on gets placeholders back (mp_pipeline.fast):
the response carries no data, just the outputs' structure, the same in every step of a static flow. The
parent still waited for it, so every call of a child on another rank cost it a round trip, and the
child's rank waited for the parent between its modules while the parent served other microbatches (in a
GPT whose forward loops over its blocks: a request, a wait and a response per block).

Once a call's response has carried no data in a step, later steps post the call (send it, do not wait)
and build the same response locally. The owner runs posted calls back to back as their inputs arrive;
the parent waits only where it reads a value. Backward calls whose input gradients all go straight to
their producers are posted the same way. Each response still comes back and is checked against the
prediction when it arrives: a failure there fails the step, a different structure is a flow change
(FlowChangedError), and the step ends only after every posted call is answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mp_pipeline.errors import FlowChangedError
from mp_pipeline.fast import CallKey
from mp_pipeline.messages import Response
from mp_pipeline.schedule import Phase

__all__ = ["Predictions", "Shape"]

TensorMeta = tuple[torch.Size, torch.dtype] | None
"""A response tensor's placeholder: its shape and dtype (None: no tensor, e.g. an unused gradient)."""


class Shape(NamedTuple):
    """What a data-free response holds."""

    payload: Any
    tensors: tuple[TensorMeta, ...]
    requires_grad: tuple[bool, ...]

    def placeholders(self) -> list[torch.Tensor | None]:
        return [None if m is None else torch.empty(m[0], dtype=m[1], device="meta") for m in self.tensors]


_Key = tuple[CallKey, Phase, bool]


def _shape(response: Response) -> Shape | None:
    """The response's shape if it carries no data (only placeholders or nothing), else None."""
    metas: list[TensorMeta] = []
    for t in response.tensors:
        if t is None:
            metas.append(None)
        elif t.is_meta:
            metas.append((t.shape, t.dtype))
        else:
            return None
    if not any(m is not None for m in metas):
        return None  # nothing flows back at all: rare, and cheap to await
    return Shape(response.payload, tuple(metas), tuple(response.requires_grad))


class Predictions:
    """One rank's predicted responses, by call, phase and grad mode (learned from the last response)."""

    def __init__(self) -> None:
        self._shapes: dict[_Key, Shape] = {}

    def learn(self, call: CallKey, phase: Phase, grad: bool, response: Response) -> None:
        key = (call, phase, grad)
        shape = _shape(response) if response.failure is None else None
        if shape is None:
            self._shapes.pop(key, None)
        else:
            self._shapes[key] = shape

    def predicted(self, call: CallKey, phase: Phase, grad: bool) -> Shape | None:
        return self._shapes.get((call, phase, grad))

    def checker(
        self, call: CallKey, phase: Phase, grad: bool, module: str, raise_failure: Callable[[Response], None]
    ) -> Callable[[Response], None]:
        """The check of a posted call's response: its failure raised, its shape as predicted."""
        expected = self._shapes[(call, phase, grad)]

        def check(response: Response) -> None:
            raise_failure(response)
            got = _shape(response)
            if got != expected:
                self._shapes.pop((call, phase, grad), None)
                raise FlowChangedError(
                    f"under fast mode, the {phase.value} of module {module!r} (microbatch {call[1]}) "
                    f"returned "
                    f"{got if got is not None else 'data'} where earlier steps returned {expected}: the flow "
                    "changed. Set 'fast_mode' to False, or keep the flow the same in every step."
                )

        return check
