"""Per-rank replay (docs/pipeline.md): once a step's flow is learned, owners run their own program and
pp_rank 0 sends no requests.

Under fast mode (mp_pipeline.fast, mp_pipeline.posted) pp_rank 0 still sends a request for every call of a
module another rank owns, forward and backward, even where its response carries no data. Once two
consecutive steps made the same calls (:class:`Replay`, learned on pp_rank 0 from the requests it sent),
pp_rank 0 sends each owner its :class:`Program` with the end of the step: per microbatch, the calls that
owner runs for pp_rank 0, in the order they were sent, each as the request it stands for (module,
position, argument structure, grad mode, the outputs it hands on, the inputs it takes from other ranks)
and the input slots whose tensors pp_rank 0 sends. From the next step on, each owner runs its program as
its inputs arrive (one worker per microbatch): only the tensors travel, as
:class:`~mp_pipeline.messages.Handoff` messages keyed ("fed", requester, call id, slot), and a call's id
is the same on both sides (:data:`REPLAY_BASE` plus its index in the learned flow), so the shortcut's and
handoffs' keys agree without any request.

pp_rank 0 still runs the parent's Python (its own stage, and the guard): each remote call it makes is
matched against the program (:meth:`Replay.match`: module, microbatch, occurrence, the order of calls per
owner and microbatch, argument structure, tensor shapes and dtypes, which require grad, grad mode, the
shortcut's references, whether the response is posted); a call that differs, or a step that leaves a
programmed call unmade, raises :class:`~mp_pipeline.errors.FlowChangedError`, which mp's default answers
by running the step again on the full path and learning again (``fast_mode: true``: it becomes
NotSupportedByFastModeError). Responses that carry data still come back, unprompted; posted calls are
checked at the step's end by the owners' acknowledgements, as before (mp_pipeline.posted).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from typing import Any, NamedTuple

from mp_pipeline.errors import FlowChangedError
from mp_pipeline.messages import Request, StepId
from mp_pipeline.static import Key, Meta, Template, request_template, tensor_metas

__all__ = ["REPLAY_BASE", "Program", "ProgramCall", "Replay", "fill"]

log = logging.getLogger(__name__)

REPLAY_BASE = 1 << 40
"""Request ids of replayed calls start here (the dynamic ids of a step count from 0)."""

FlowKey = tuple[int, str, str, tuple[str, ...], int, int]
"""A call of pp_rank 0 in a step: (owner, phase, module, position, microbatch, occurrence)."""

_NO_STEP = StepId(-1, -1)


class ProgramCall(NamedTuple):
    """One call an owner runs for pp_rank 0 in a replayed step."""

    request: Request
    """The request it stands for (its step and tensors filled in when it runs)."""
    slots: int
    """How many tensors the request holds."""
    fed: tuple[int, ...]
    """The slots whose tensor pp_rank 0 sends (the others come by the shortcut, or are None)."""


Program = dict[int, list[ProgramCall]]
"""An owner's program for a step: per microbatch, its calls for pp_rank 0 in order."""


class _Call(NamedTuple):
    request: Request
    """As sent (ids of the learned flow once translated), without tensors."""
    metas: tuple[Meta, ...]
    posted: bool
    seq: int
    """Its index among the calls to the same owner in the same microbatch."""


class _Expected(NamedTuple):
    """A programmed call as :meth:`Replay.match` compares it (made once, when the flow is learned)."""

    call: _Call
    fields: tuple[Any, ...]
    """The request's :data:`_COMPARED` fields, then its tensors' metas and whether it is posted."""
    static: tuple[Key, Template]
    """Static mode's key (occurrence 0) and template of the request it stands for (Wire.account)."""


_COMPARED = ("requires_grad", "state", "checkpoint", "forward_id", "refs", "handoff", "handed")
_COMPARED_VALUES = operator.attrgetter(*_COMPARED)


def _expected(dest: int, call: _Call) -> _Expected:
    request = call.request
    fields = (*_COMPARED_VALUES(request), call.metas, call.posted)
    key = Key(dest, False, request.phase, request.module, request.position, request.microbatch, 0)
    # the template of every request that matches the call (Replay.match compares all it holds)
    return _Expected(call, fields, (key, request_template(request, call.metas)))


def _key_of(dest: int, request: Request, counts: Counter[FlowKey]) -> FlowKey:
    base = (dest, request.phase.value, request.module, request.position, request.microbatch, 0)
    n = counts[base]
    counts[base] = n + 1
    return (*base[:5], n)


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # user values that do not compare: unequal
        return False


def _difference(expected: _Call, request: Request, metas: tuple[Meta, ...], posted: bool) -> str | None:
    """What differs between a programmed call and the one made (None: they match)."""
    for name in _COMPARED:
        a, b = getattr(expected.request, name), getattr(request, name)
        if a != b:
            return f"its {name} ({b!r}, the program has {a!r})"
    if expected.metas != metas:
        return f"its tensors' shapes and dtypes ({metas!r}, the program has {expected.metas!r})"
    if not _same(expected.request.payload, request.payload):
        return "the structure or the non-tensor values of its arguments"
    if expected.posted != posted:
        return "whether its response carries data"
    return None


def _describe(key: FlowKey) -> str:
    dest, phase, module, position, microbatch, n = key
    return (
        f"the {phase} of module {module or '<model>'!r} (microbatch {microbatch}, call {n + 1} at "
        f"{' > '.join(position)}) on rank {dest}"
    )


class Replay:
    """pp_rank 0's side: learns the flow from the requests it sends, then matches each call against it.

    Pure bookkeeping (no communication): the server reports what it sends (:meth:`record`) and asks for
    each call's id (:meth:`match`); the runtime brackets each step (:meth:`begin_step`) and ends a recorded
    one with :meth:`learned`.
    """

    GIVE_UP_AFTER = 4
    """Recorded steps that disagree with the one before before learning stops (a flow that changes in
    every step, say a Python value in a module's arguments: it keeps today's posted path)."""

    def __init__(self) -> None:
        self.active: dict[FlowKey, _Call] | None = None
        """The program being replayed (None: not replaying)."""
        self._expected: dict[FlowKey, _Expected] = {}
        """:attr:`active`'s calls as :meth:`match` compares them."""
        self.static: dict[int, tuple[Key, Template]] = {}
        """By the id of each call of :attr:`active`: static mode's key and template of its request
        (Server.replayed accounts for it without building them per call, Wire.account)."""
        self.recording = False
        self.leading: frozenset[int] = frozenset()
        """While replaying: the microbatches whose step function made its first call to another rank
        before any module of pp_rank 0 returned, in both recorded steps (:meth:`opened`): their forward
        feeds another rank first, and pp_rank 0 starts it before a ready backward
        (Scheduler.feed_first)."""
        self._opened: dict[int, bool] = {}
        self._previous_opened: dict[int, bool] = {}
        self._previous: dict[FlowKey, _Call] | None = None
        self._sent: list[tuple[FlowKey, int, Request, tuple[Meta, ...], bool]] = []
        self._counts: Counter[FlowKey] = Counter()
        self._seq: Counter[tuple[int, int]] = Counter()
        self._made: set[FlowKey] = set()
        self._disagreed = 0

    @property
    def learning(self) -> bool:
        """Whether recording is worth it (not replaying, not given up)."""
        return self.active is None and self._disagreed < self.GIVE_UP_AFTER

    def begin_step(self, *, record: bool) -> None:
        self.recording = record and self.learning
        self._sent = []
        self._counts = Counter()
        self._seq = Counter()
        self._made = set()
        self._opened = {}

    # -- learning ------------------------------------------------------------------------------------------
    def record(self, dest: int, request: Request, posted: bool) -> None:
        """A request pp_rank 0 sent (posted: its response is only acknowledged)."""
        key = _key_of(dest, request, self._counts)
        bare = dataclasses.replace(request, tensors=[], step=_NO_STEP, template_id=None)
        self._sent.append((key, request.request_id, bare, tensor_metas(request.tensors), posted))

    def opened(self, microbatch: int, remote_first: bool) -> None:
        """The step function's first call to another rank in ``microbatch`` (remote_first: no module of
        pp_rank 0 returned before it)."""
        self._opened[microbatch] = remote_first

    def learned(self) -> dict[int, Program] | None:
        """End of a recorded step (complete, every posted call acknowledged): the owners' programs when it
        made the same calls as the recorded step before (replayed from the next step), else None."""
        self.recording = False
        flow = self._translated()
        previous, self._previous = self._previous, flow
        opened, self._previous_opened = self._previous_opened, self._opened
        if flow is None or previous is None:
            return None
        why = _flows_differ(previous, flow)
        if why is not None:
            self._disagreed += 1
            log.debug("replay: two recorded steps differ (%s)", why)
            return None
        self.active = flow
        self.leading = frozenset(mb for mb, first in self._opened.items() if first and opened.get(mb))
        self._expected = {key: _expected(key[0], call) for key, call in flow.items()}
        self.static = {e.call.request.request_id: e.static for e in self._expected.values()}
        self._previous = None
        programs: dict[int, Program] = {}
        for key, call in sorted(flow.items(), key=lambda kv: kv[1].seq):
            program = programs.setdefault(key[0], {})
            fed = tuple(j for j, m in enumerate(call.metas) if m is not None)
            request = dataclasses.replace(call.request, posted=call.posted)
            program.setdefault(key[4], []).append(ProgramCall(request, len(call.metas), fed))
        log.debug("replay: learned %d calls for ranks %s", len(flow), sorted(programs))
        return programs

    def _translated(self) -> dict[FlowKey, _Call] | None:
        """The recorded step with the learned flow's ids (by the sorted keys), or None if a call refers to
        a request the step did not record."""
        order = sorted(key for key, *_ in self._sent)
        ids = {key: REPLAY_BASE + i for i, key in enumerate(order)}
        new_id = {dynamic: ids[key] for key, dynamic, *_ in self._sent}
        flow: dict[FlowKey, _Call] = {}
        seq: Counter[tuple[int, int]] = Counter()
        for key, _, request, metas, posted in self._sent:
            if request.forward_id is not None and request.forward_id not in new_id:
                return None
            if any(ref.forward_id not in new_id for ref in request.refs):
                return None
            translated = dataclasses.replace(
                request,
                request_id=ids[key],
                forward_id=None if request.forward_id is None else new_id[request.forward_id],
                refs=tuple(ref._replace(forward_id=new_id[ref.forward_id]) for ref in request.refs),
                posted=False,
            )
            where = (key[0], key[4])
            flow[key] = _Call(translated, metas, posted, seq[where])
            seq[where] += 1
        return flow

    # -- replaying -----------------------------------------------------------------------------------------
    def match(self, dest: int, request: Request, posted: bool) -> int:
        """The id of the programmed call that ``request`` (to ``dest``, its id not set yet) is; raises
        FlowChangedError when the program has no such call or it differs."""
        assert self.active is not None
        key = _key_of(dest, request, self._counts)
        found = self._expected.get(key)
        if found is None:
            raise FlowChangedError(
                f"{_describe(key)} is not among the calls learned from earlier steps: the flow changed "
                "(set 'fast_mode' to False, or keep the flow the same in every step)"
            )
        expected = found.call
        where = (dest, request.microbatch)
        metas = tensor_metas(request.tensors)
        # one comparison of everything but the payload; _difference names what differs
        same = found.fields == (*_COMPARED_VALUES(request), metas, posted)
        why = None
        if not (same and _same(expected.request.payload, request.payload)):
            why = _difference(expected, request, metas, posted) or "the fields of its request"
        if why is None and expected.seq != self._seq[where]:
            made = self._seq[where] + 1
            why = f"its order (call {made} to that rank in the microbatch, learned as {expected.seq + 1})"
        if why is not None:
            raise FlowChangedError(
                f"{_describe(key)} differs from the calls learned from earlier steps in {why}: the flow "
                "changed (set 'fast_mode' to False, or keep the flow the same in every step)"
            )
        self._seq[where] += 1
        self._made.add(key)
        return expected.request.request_id

    def check_complete(self) -> None:
        """At the end of a replayed step: every programmed call was made (its owner waits for it)."""
        if self.active is not None and len(self._made) != len(self.active):
            missing = next(key for key in sorted(self.active) if key not in self._made)
            raise FlowChangedError(
                f"the step made {len(self._made)} of the {len(self.active)} remote calls learned from "
                f"earlier steps (first missing: {_describe(missing)}): the flow changed (set 'fast_mode' to "
                "False, or keep the flow the same in every step)"
            )


def _flows_differ(a: dict[FlowKey, _Call], b: dict[FlowKey, _Call]) -> str | None:
    for key in a.keys() ^ b.keys():
        return f"{_describe(key)} in one step only"
    for key, call in a.items():
        other = b[key]
        why = _difference(call, other.request, other.metas, other.posted)
        if why is None and call.seq != other.seq:
            why = "its order"
        if why is None and call.request.request_id != other.request.request_id:
            why = "its id"
        if why is not None:
            return f"{_describe(key)}: {why}"
    return None


_FIELDS = tuple(f.name for f in dataclasses.fields(Request))
_VALUES = operator.attrgetter(*_FIELDS)
_STEP, _TENSORS = _FIELDS.index("step"), _FIELDS.index("tensors")


def fill(call: ProgramCall, step: StepId, tensors: list[Any]) -> Request:
    """The request a programmed call stands for in ``step``, with its tensors: built from the program's
    field values (2.7 µs here against copy.copy's 6.6 and dataclasses.replace's more, once per call an
    owner runs)."""
    values = list(_VALUES(call.request))
    values[_STEP] = step
    values[_TENSORS] = tensors
    return Request(*values)
