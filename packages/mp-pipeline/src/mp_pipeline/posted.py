"""Fast mode's posted calls: remote calls whose response the requester predicts instead of awaiting.

Under fast mode a parent that only passes a child's outputs on gets placeholders back (mp_pipeline.fast):
the response carries no data, just the outputs' structure, the same in every step of a static flow. The
parent still waited for it, so every call of a child on another rank cost it a round trip, and the
child's rank waited for the parent between its modules while the parent served other microbatches (in a
GPT whose forward loops over its blocks: a request, a wait and a response per block).

Once a call's response has carried no data in a step, later steps post the call (send it, do not wait)
and build the same response locally. The owner runs posted calls back to back as their inputs arrive;
the parent waits only where it reads a value. Backward calls whose input gradients all go straight to
their producers are posted the same way.

Checking. A posted call of pp_rank 0 (the step's driver, which makes nearly all of them) gets no
response: its owner computes the :func:`digest` of the data-free response it would have sent and keeps
it. Once pp_rank 0's tasks are done it tells each owner how many calls it posted there
(:class:`~mp_pipeline.messages.PostedSync`); the owner answers, once they have all run, with one
:class:`~mp_pipeline.messages.PostedAck` listing each call's digest, which pp_rank 0 compares with the
digest the owner sent with the same call's last awaited response (:attr:`Response.digest`). A posted call
that fails still answers at once with its failure (the step fails), and one whose response carries data
after all sends it (a flow change); a different digest is a flow change too (FlowChangedError, which mp's
default answers by running the step again on the full path). Posted calls of other ranks (nested calls)
get their responses, checked as they arrive. Either way the step ends only after every posted call ran.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mp_pipeline.errors import FlowChangedError
from mp_pipeline.fast import CallKey
from mp_pipeline.messages import Response
from mp_pipeline.schedule import Phase
from mp_pipeline.structure import Slot

__all__ = ["PostedCheck", "Prediction", "Predictions", "Shape", "digest", "meta_base", "shape_of"]

TensorMeta = tuple[torch.Size, torch.dtype] | None
"""A response tensor's placeholder: its shape and dtype (None: no tensor, e.g. an unused gradient)."""


class Shape(NamedTuple):
    """What a data-free response holds."""

    payload: Any
    tensors: tuple[TensorMeta, ...]
    requires_grad: tuple[bool, ...]

    def placeholders(self) -> list[torch.Tensor | None]:
        return [None if m is None else torch.empty(m[0], dtype=m[1], device="meta") for m in self.tensors]

    def response(self, step: Any, request_id: int, responder: int) -> Response:
        """The response this shape predicts for a call whose owner sends none (posted or replayed)."""
        return Response(step, request_id, responder, self.payload, self.placeholders(), self.requires_grad)


_Key = tuple[CallKey, Phase, bool]


def shape_of(response: Response) -> Shape | None:
    """The response's shape if it carries no data (only placeholders, or nothing), else None."""
    metas: list[TensorMeta] = []
    placeholders = False
    for t in response.tensors:  # (an owner asks once per call it answers: a loop, no generator)
        if t is None:
            metas.append(None)
        elif t.is_meta:
            metas.append((t.shape, t.dtype))
            placeholders = True
        else:
            return None
    if not placeholders and response.payload is not None:
        return None  # a value (an int, a string) with no tensor: data
    # Placeholders only, or nothing at all: the backward of a call whose inputs need no gradient (an
    # encoder fed token ids). Awaiting that one would hold the requester's backward until the owner's
    # whole backward ran, though nothing comes back.
    return Shape(response.payload, tuple(metas), tuple(response.requires_grad))


def digest(shape: Shape) -> int:
    """A data-free response's fingerprint, computed on its owner: the same on every step of a static flow
    (the same structure built by the same code pickles to the same bytes).

    An owner computes one per call it runs for pp_rank 0, the same ones in every step: a shape whose
    equality implies equal pickled bytes (:func:`_memo_key`) takes its digest from :data:`_DIGESTS`
    (about 1 µs instead of 13)."""
    key = _memo_key(shape)
    if key is not None:
        found = _DIGESTS.get(key)
        if found is not None:
            return found
    data = pickle.dumps(shape, protocol=pickle.HIGHEST_PROTOCOL)
    value = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    if key is not None:
        if len(_DIGESTS) >= _MEMO_SIZE:
            _DIGESTS.clear()
        _DIGESTS[key] = value
    return value


_DIGESTS: dict[Shape, int] = {}
"""Digests of the shapes seen, by shape (only those :func:`_memo_key` admits)."""
_MEMO_SIZE = 4096
"""Shapes kept in :data:`_DIGESTS` before it starts over (a bound for flows that never repeat)."""


def _plain(payload: Any) -> bool:
    """Whether ``payload`` holds only slots, None and exact tuples of them: values whose equality means
    the same type and the same pickle (unlike 1 == 1.0 == True)."""
    if payload is None or type(payload) is Slot:
        return True
    return type(payload) is tuple and all(_plain(x) for x in payload)


def _memo_key(shape: Shape) -> Shape | None:
    """``shape`` as a key of :data:`_DIGESTS`, or None when two equal shapes might pickle differently.
    Its tensors' entries are (torch.Size, dtype) or None and its flags bools, whatever the module."""
    return shape if _plain(shape.payload) else None


class Prediction(NamedTuple):
    """A call's predicted response (what :meth:`Predictions.predicted` gives)."""

    shape: Shape
    digest: int | None
    """The owner's digest of the response (None: its owner sends responses to posted calls)."""
    bases: tuple[torch.Tensor | None, ...]
    """Per tensor of :attr:`shape`: the kept ``meta`` tensor of its shape and dtype (:func:`meta_base`);
    each placeholder is a ``detach()`` of it."""

    def placeholders(self) -> list[torch.Tensor | None]:
        """The shape's placeholders (as :meth:`Shape.placeholders`)."""
        return [None if b is None else b.detach() for b in self.bases]

    def response(self, step: Any, request_id: int, responder: int) -> Response:
        """The response a call predicted so gets (as :meth:`Shape.response`)."""
        shape = self.shape
        return Response(step, request_id, responder, shape.payload, self.placeholders(), shape.requires_grad)


_META: dict[tuple[torch.Size, torch.dtype], torch.Tensor] = {}
"""Contiguous ``meta`` tensors by shape and dtype (:func:`meta_base`)."""
_META_SIZE = 4096
"""Entries kept in :data:`_META` before it starts over (a bound for shapes that never repeat)."""


def meta_base(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The kept contiguous ``meta`` tensor of ``shape`` and ``dtype``, whose ``detach()`` is a placeholder:
    a new tensor in a fraction of ``torch.empty``'s time. A meta tensor has no data to share; the version
    counter the placeholders share is never bumped (nothing changes a placeholder in place)."""
    key = (shape, dtype)
    base = _META.get(key)
    if base is None:
        if len(_META) >= _META_SIZE:
            _META.clear()
        base = _META[key] = torch.empty(shape, dtype=dtype, device="meta")
    return base


def _bases(shape: Shape) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if m is None else meta_base(*m) for m in shape.tensors)


class PostedCheck:
    """The check of one posted call: on its response (:meth:`__call__`: a failure raised, the shape as
    predicted) or on its acknowledgement (:meth:`acked`: the owner's digest as predicted)."""

    __slots__ = ("_forget", "digest", "expected", "microbatch", "module", "phase", "raise_failure")

    def __init__(  # noqa: PLR0917 - internal, built in one place
        self,
        expected: Prediction,
        phase: Phase,
        module: str,
        microbatch: int,
        forget: Callable[[], object],
        raise_failure: Callable[[Response], None],
    ) -> None:
        self.expected = expected.shape
        self.digest = expected.digest
        """The digest the acknowledgement must carry (None: the response comes back instead)."""
        self.phase = phase
        self.module = module
        self.microbatch = microbatch
        self._forget = forget
        self.raise_failure = raise_failure

    def __call__(self, response: Response) -> None:
        self.raise_failure(response)
        got = shape_of(response)
        if got != self.expected:
            raise self._changed(
                f"{got if got is not None else 'data'} where earlier steps returned {self.expected}"
            )

    def acked(self, got: int | None) -> None:
        if got != self.digest:
            raise self._changed(
                "data" if got is None else f"another structure than in earlier steps ({self.expected})"
            )

    def _changed(self, what: str) -> FlowChangedError:
        self._forget()
        return FlowChangedError(
            f"under fast mode, the {self.phase.value} of module {self.module!r} (microbatch "
            f"{self.microbatch}) returned {what}: the flow changed. Set 'fast_mode' to False, or keep the "
            "flow the same in every step."
        )


class Predictions:
    """One rank's predicted responses, by call, phase and grad mode (learned from the last response)."""

    def __init__(self) -> None:
        self._shapes: dict[_Key, Prediction] = {}
        self._checks: dict[_Key, PostedCheck] = {}
        """The check of each prediction, made at its first use (it holds nothing of a step)."""

    def learn(self, call: CallKey, phase: Phase, grad: bool, response: Response) -> None:
        key = (call, phase, grad)
        self._checks.pop(key, None)
        shape = shape_of(response) if response.failure is None else None
        if shape is None:
            self._shapes.pop(key, None)
        else:
            self._shapes[key] = Prediction(shape, response.digest, _bases(shape))

    def predicted(self, call: CallKey, phase: Phase, grad: bool) -> Prediction | None:
        return self._shapes.get((call, phase, grad))

    def checker(
        self, call: CallKey, phase: Phase, grad: bool, module: str, raise_failure: Callable[[Response], None]
    ) -> PostedCheck:
        """The check of a posted call's response or acknowledgement."""
        key = (call, phase, grad)
        check = self._checks.get(key)
        if check is None or check.module != module or check.raise_failure is not raise_failure:
            check = self._checks[key] = PostedCheck(
                self._shapes[key], phase, module, call[1], lambda: self._forget(key), raise_failure
            )
        return check

    def _forget(self, key: _Key) -> None:
        self._shapes.pop(key, None)
        self._checks.pop(key, None)
