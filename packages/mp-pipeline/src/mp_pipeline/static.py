"""Static mode (docs/pipeline.md): record each rank's messages in the first steps, then replay them compactly.

With ``static_mode`` the user promises that every step executes the same flow. Each rank records, for
its first ``record_steps`` steps, every request and response it sends, keyed by where it sits in the
flow (:class:`Key`: destination, phase, module, position, microbatch and how many such messages came
before in the microbatch) with everything about it that does not change between steps (a
:data:`Template`: the Python structure of the arguments or outputs, which tensors require grad, the
grad mode and autocast state, and each tensor's shape and dtype). When all recorded steps sent exactly
the same keyed templates, the rank starts replaying: a message whose key and template match the
recording travels as a :class:`~mp_pipeline.messages.Compact` message (step, ids, tensors) under a tag
of its own, so that the transport's static metadata cache (``send(..., static=True)``) also skips the
tensors' metadata; the first one for each key carries the template once (``template_id``), and the
receiver keeps it (:class:`TemplateStore`) to rebuild the full message.

Every replayed message is checked: one that is not in the recording, or differs from it, is a
mismatch, and so is a step that leaves recorded messages unsent. Under static mode the rank then sends
full messages again from that one on (the receivers accept either kind at any time, so no agreement
is needed and no result is wrong); under fast mode (``strict``) it is an error
(:class:`~mp_pipeline.errors.FlowChangedError`).

The scheduler stays dynamic: the seed replays the task order of the fastest recorded step, but a fixed
order can only wait for the event it expects (``schedule.simulate``: slower than the interleaved
schedule), and the keys do not depend on the order, so any order replays.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from mp_pipeline.errors import FlowChangedError
from mp_pipeline.messages import Compact, Request, Response
from mp_pipeline.schedule import Phase

__all__ = [
    "DEFAULT_RECORD_STEPS",
    "FlowRecorder",
    "Key",
    "Plan",
    "Template",
    "TemplateStore",
    "default_record_steps",
    "expand",
    "request_template",
    "template_of",
    "tensor_metas",
]

log = logging.getLogger(__name__)

DEFAULT_RECORD_STEPS = 5
"""The steps recorded before replaying."""


class Template(NamedTuple):
    """What a message keeps from step to step."""

    flow: tuple[Any, ...]
    """Phase, module, position, which tensors require grad, grad mode and autocast, activation
    checkpointing, each tensor's shape and dtype: must be the same in every step (the flow)."""
    payload: Any
    """The Python structure around the tensors. Replayed from the template only where it compared equal
    in every recorded step (a structure holding, say, a cache object without ``__eq__`` travels in full
    every time, which also keeps the receiver from sharing one such object between steps)."""


class Plan(NamedTuple):
    """How to send a replayed message."""

    template_id: int
    """Its tag (static_tag) and the receiver's template."""
    compact: bool
    """Only step, ids and tensors travel (the payload equals the recorded one)."""
    announce: bool
    """Travels in full, carrying the template for the receiver to keep (first use of the id)."""


def default_record_steps() -> int:
    """Steps recorded before replay (MP_PIPELINE_STATIC_STEPS, default 5; at least 1)."""
    return max(1, int(os.environ.get("MP_PIPELINE_STATIC_STEPS", str(DEFAULT_RECORD_STEPS))))


class Key(NamedTuple):
    """Where a message sits in a step's flow, independent of timing and request ids."""

    dest: int
    response: bool
    phase: Phase
    module: str
    position: tuple[str, ...]
    microbatch: int
    occurrence: int
    """How many messages with the same fields this rank sent before in the step (module reuse)."""


Meta = tuple[tuple[int, ...], torch.dtype] | None


def tensor_metas(tensors: list[torch.Tensor | None]) -> tuple[Meta, ...]:
    return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors)


def _same(a: object, b: object) -> bool:
    # User values in a structure may not compare (numpy arrays, objects raising in __eq__): unequal.
    try:
        return bool(a == b)
    except Exception:
        return False


@dataclass
class FlowRecorder:
    """One rank's record of the messages it sends, and the replay decision (see the module docstring).

    Pure bookkeeping (no communication): the server asks :meth:`outgoing` for every message it sends
    and calls :meth:`begin_step` / :meth:`end_step` around each step.
    """

    rank: int
    record_steps: int = DEFAULT_RECORD_STEPS
    strict: bool = False
    """Fast mode: a mismatch raises FlowChangedError instead of falling back to full messages."""
    skip_steps: int = 0
    """Completed steps to let pass before recording (fast mode: the one its plan is learned from)."""
    quiet: bool = False
    """Log turning itself off at info level, not as a warning (mp's default, which did not ask for it)."""
    recorded: list[dict[Key, Template]] = field(default_factory=list)
    replaying: bool = False
    disabled: bool = False
    """The flow was not static (recorded steps differed, or a replayed step did not match)."""
    mismatch: str | None = None
    """What did not match in the current step (None while it matches)."""
    _ids: dict[Key, int] = field(default_factory=dict)
    _replayable: set[Key] = field(default_factory=set)
    """Keys whose payload was the same in every recorded step."""
    _announced: set[int] = field(default_factory=set)
    _step: dict[Key, Template] = field(default_factory=dict)
    _counts: Counter[Key] = field(default_factory=Counter)
    _used: int = 0
    _skipped: int = 0

    def begin_step(self) -> None:
        self._step = {}
        self._counts = Counter()
        self._used = 0
        self.mismatch = None

    def counted(self, key: Key) -> Key:
        """``key`` (its occurrence 0) with its occurrence set: how many like it were sent before in this
        step. Call it once per message sent."""
        counts = self._counts
        n = counts[key]
        counts[key] = n + 1
        return key if n == 0 else Key(key[0], key[1], key[2], key[3], key[4], key[5], n)

    def outgoing(self, key: Key, template: Template) -> Plan | None:
        """How to send a replayed message, or None to send it as in dynamic mode. Raises FlowChangedError
        on a mismatch when strict."""
        if self.disabled:
            return None
        if not self.replaying:
            self._step[key] = template
            return None
        if self.mismatch is not None:
            return None
        tid = self._ids.get(key)
        if tid is None:
            self._mismatched(f"a message not in the recording: {_describe(key)}")
            return None
        recorded = self.recorded[0][key]
        if not _same(recorded.flow, template.flow):
            self._mismatched(f"a message that differs from the recording: {_describe(key)}")
            return None
        self._used += 1
        compact = key in self._replayable and _same(recorded.payload, template.payload)
        announce = compact and tid not in self._announced
        if announce:
            self._announced.add(tid)
        return Plan(tid, compact and not announce, announce)

    def end_step(self, *, completed: bool) -> None:
        """Close the step: record it, decide to replay, or check that the replay sent everything."""
        if self.disabled or not completed:
            return  # an aborted step proves nothing either way
        if self._skipped < self.skip_steps:
            self._skipped += 1
            return
        if not self.replaying:
            self.recorded.append(self._step)
            if len(self.recorded) < self.record_steps:
                return
            first = self.recorded[0]
            differs = next(filter(None, (_difference(first, other) for other in self.recorded[1:])), None)
            if differs is None:
                self._ids = {k: i for i, k in enumerate(first)}
                self._replayable = {
                    k for k, t in first.items() if all(_same(t.payload, r[k].payload) for r in self.recorded)
                }
                self.recorded = [first]
                self.replaying = True
                log.debug(
                    "rank %d: static flow of %d messages recorded (%d replayable); replaying",
                    self.rank,
                    len(first),
                    len(self._replayable),
                )
            else:
                self._disable(f"the recorded steps sent different messages ({differs})")
            return
        if self.mismatch is None and self._used != len(self._ids):
            # Not raised here (the other ranks have ended the step): the runtime reports it and the
            # caller agrees over the pipeline before raising (fast mode).
            self.mismatch = f"the step sent {self._used} of the {len(self._ids)} recorded messages"
        if self.mismatch is not None:
            self._disable(self.mismatch)

    def _mismatched(self, what: str) -> None:
        self.mismatch = what
        self.disabled = self.strict  # after the error, later steps run dynamically
        if self.strict:
            raise FlowChangedError(
                f"rank {self.rank}: the step's execution flow changed after it was recorded ({what}); fast "
                "mode needs the same modules called with the same argument structure and shapes in "
                "every step. Set 'fast_mode' to False (static_mode then falls back to full messages), "
                "or keep the flow the same in every step."
            )

    def _disable(self, why: str) -> None:
        if not self.disabled:
            level = logging.INFO if self.quiet else logging.WARNING
            log.log(level, "rank %d: static mode off from now on: %s", self.rank, why)
        self.disabled = True
        self.replaying = False
        self.recorded = []
        self._ids = {}


def _difference(a: dict[Key, Template], b: dict[Key, Template]) -> str | None:
    """How the flows of two recorded steps differ (None if they are the same)."""
    for key in a.keys() ^ b.keys():
        return f"{_describe(key)} in one step only"
    for key, template in a.items():
        if not _same(template.flow, b[key].flow):
            return f"{_describe(key)} differs: {template.flow!r} vs {b[key].flow!r}"[:2000]
    return None


def _describe(key: Key) -> str:
    what = "response to" if key.response else "request for"
    return (
        f"{key.phase.value} {what} module {key.module or '<model>'!r} (microbatch {key.microbatch}, call "
        f"{key.occurrence + 1} at {' > '.join(key.position)}) to rank {key.dest}"
    )


class TemplateStore:
    """The receiver's half: templates announced by each sender, by id."""

    def __init__(self) -> None:
        self._by_source: dict[tuple[int, int], Any] = {}

    def put(self, source: int, template_id: int, message: Any) -> None:
        self._by_source[(source, template_id)] = message

    def get(self, source: int, template_id: int) -> Any:
        found = self._by_source.get((source, template_id))
        if found is None:
            raise FlowChangedError(
                f"rank {source} sent a static-mode message naming template {template_id}, which it never "
                "announced to this rank; the ranks' static-mode records disagree"
            )
        return found


def template_of(message: Request | Response) -> Template:
    """What static mode compares between steps: everything but the step, the ids and tensor values."""
    metas = tensor_metas(message.tensors)
    if isinstance(message, Request):
        return request_template(message, metas)
    return Template((message.requires_grad, metas), message.payload)


def request_template(request: Request, metas: tuple[Meta, ...]) -> Template:
    """:func:`template_of` a request whose tensors have ``metas`` (per-rank replay makes it once per
    programmed call, mp_pipeline.replay)."""
    flow = (
        request.phase,
        request.module,
        request.position,
        request.requires_grad,
        request.state,
        request.checkpoint,
        metas,
        tuple(ref.slot for ref in request.refs),
        request.handoff,
        request.handed,
    )
    return Template(flow, request.payload)


def expand(template: Request | Response, m: Compact) -> Request | Response:
    """A compact message's full form: the template's fields, with what travelled in the compact message
    (its own announce id dropped)."""
    if isinstance(template, Request):
        return dataclasses.replace(
            template,
            step=m.step,
            request_id=m.request_id,
            tensors=m.tensors,
            forward_id=m.forward_id,
            refs=m.refs,
            posted=m.posted,
            template_id=None,
        )
    return dataclasses.replace(
        template, step=m.step, request_id=m.request_id, tensors=m.tensors, template_id=None
    )
