"""The messages module servers exchange (docs/pipeline.md).

Every message carries the :class:`StepId` it belongs to, so that a message left over from an aborted
step is recognized and dropped, and one that arrives early (from the next step) is kept for it.
Tensors travel detached inside the messages (the transport moves them as raw buffers); which of them
require grad is sent beside them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import torch

from mp_pipeline.context import ExecState
from mp_pipeline.schedule import Phase
from mp_pipeline.structure import pickled_by_position

__all__ = [
    "COMPACT",
    "ENTERED_TAG",
    "HANDOFF",
    "TAG",
    "Compact",
    "Entered",
    "Failure",
    "Handoff",
    "PostedAck",
    "PostedSync",
    "Ref",
    "Request",
    "Response",
    "StepAbort",
    "StepEnd",
    "StepId",
    "compact_response_of",
    "compact_response_tag",
    "handoff_of",
    "handoff_tag",
    "is_pipeline_tag",
    "static_tag",
]

TAG = "mp_pipeline"
"""Transport tag of every full pipeline message."""


ENTERED_TAG = (TAG, "entered")
"""Transport tag of :class:`Entered`: its own, so that a rank waiting for one takes nothing else."""


def is_pipeline_tag(tag: object) -> bool:
    """Whether a transport tag is one of the pipeline's (TAG, or a tuple that starts with it)."""
    return tag == TAG or (isinstance(tag, tuple) and tag[:1] == (TAG,))


HANDOFF: Final = "handoff"
"""The second field of the tag a handed-off tensor travels under (:func:`handoff_tag`)."""


def handoff_tag(handoff: Handoff) -> tuple[Any, ...]:
    """The tag a :class:`Handoff` travels under: its step and key, so that its tensor travels alone.

    A bare tensor is the transport's cheapest message (nothing to pickle around it: its body is always
    the same stub); the receiver rebuilds the Handoff from the tag (:func:`handoff_of`)."""
    step = handoff.step
    return (TAG, HANDOFF, step.model, step.step, step.fn, *handoff.key)


def handoff_of(tag: object, obj: Any) -> Handoff | None:
    """The Handoff a message received under ``tag`` stands for (None: not one sent by handoff_tag)."""
    if type(tag) is not tuple or len(tag) != 9 or tag[1] != HANDOFF:
        return None
    return Handoff(StepId(tag[2], tag[3], tag[4]), (tag[5], tag[6], tag[7], tag[8]), obj)


COMPACT: Final = "compact"
"""The second field of the tag a compact response travels under (:func:`compact_response_tag`)."""


def compact_response_tag(step: StepId, template_id: int, request_id: int) -> tuple[Any, ...]:
    """The tag a compact response (a :class:`Compact` standing for a Response) travels under: its step and
    ids, so that only its tensors travel (one tensor alone, else their list); see
    :func:`compact_response_of`."""
    return (TAG, COMPACT, step.model, step.step, step.fn, template_id, request_id)


def compact_response_of(tag: object, obj: Any) -> Compact | None:
    """The Compact a message received under ``tag`` stands for (None: not one sent by
    compact_response_tag)."""
    if type(tag) is not tuple or len(tag) != 7 or tag[1] != COMPACT:
        return None
    tensors = [obj] if isinstance(obj, torch.Tensor) else list(obj)
    return Compact(StepId(tag[2], tag[3], tag[4]), tag[5], tag[6], tensors)


def static_tag(template_id: int) -> tuple[str, int]:
    """The tag of compact messages of one template: a tag per template lets the transport's static
    metadata cache (keyed by destination and tag) skip the tensors' metadata."""
    return (TAG, template_id)


@pickled_by_position
@dataclass(frozen=True, order=True, slots=True)
class StepId:
    """Which step of which DistributedModel (a per-process counter, equal on all ranks), and the step
    function it runs (its qualified name: every rank of the pipeline must run the same one)."""

    model: int
    step: int
    fn: str = ""


class Ref(NamedTuple):
    """Fast mode: a forward input the requester does not send because its owner gets it otherwise."""

    slot: int
    """Index of the input among the request's tensors (its entry there is None)."""
    producer: int
    """Global rank that ran the forward which returned it."""
    forward_id: int
    """request_id of that forward (the requester's)."""
    kept_index: int
    """Its index among that forward's outputs that require grad (the producer's kept outputs)."""
    handoff: bool
    """The producer handed the output to this request's receiver itself (and the requester holds only a
    placeholder); the input's gradient then goes straight back to the producer. False: the requester has
    the data, the producer is the receiver, which uses its kept copy."""


@pickled_by_position
@dataclass(slots=True)
class Request:
    """Execute a module (forward) or run its backward, for the requesting rank."""

    step: StepId
    request_id: int
    """Unique per requester within a step; responses name it."""
    requester: int
    """Global rank of the requester (the pp_rank is its index in the pipeline group)."""
    phase: Phase
    module: str
    """Module path in the model ("" is the model itself)."""
    microbatch: int
    position: tuple[str, ...]
    """Where the call sits in the module graph: module paths from the step function to this module."""
    payload: Any
    """FWD: the skeleton of (args, kwargs) (see mp_pipeline.structure); BWD: None."""
    tensors: list[torch.Tensor | None]
    """FWD: the input tensors; BWD: the gradients of the forward's outputs that require grad (None
    where no gradient flowed)."""
    requires_grad: tuple[bool, ...]
    """FWD: which input tensors require grad on the requester."""
    state: ExecState
    """The requester's grad mode and autocast state."""
    checkpoint: bool = False
    """Whether activation checkpointing is enabled for this module (the owner then recomputes it)."""
    forward_id: int | None = None
    """BWD: the request_id of the forward call whose backward this is."""
    template_id: int | None = None
    """Static mode: the receiver keeps this request (less step, ids, tensors) as template ``template_id``
    of the sender, for later :class:`Compact` messages."""
    refs: tuple[Ref, ...] = ()
    """FWD, fast mode: the inputs that travel otherwise (the child-to-child shortcut)."""
    handoff: tuple[tuple[int, int], ...] = ()
    """FWD, fast mode: (k, rank): hand output k (among those that require grad) to global rank ``rank``,
    which consumes it next, instead of returning it (the response then carries a meta placeholder)."""
    handed: tuple[int, ...] = ()
    """BWD, fast mode: outputs whose gradient the consumer of a handed-off output sends to this request's
    receiver itself (their ``tensors`` entry is None)."""
    posted: bool = False
    """Fast mode, from pp_rank 0: a posted call (mp_pipeline.posted) whose response the receiver does not
    send when it carries no data; it reports the call in its :class:`PostedAck` instead."""


@pickled_by_position
@dataclass(slots=True)
class Failure:
    """An exception on some rank, as text (exception objects need not be picklable)."""

    rank: int
    module: str
    microbatch: int
    phase: str
    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(
        cls, exc: BaseException, *, rank: int, module: str, microbatch: int, phase: str
    ) -> Failure:
        remote_tb = getattr(exc, "remote_traceback", None)
        # an error forwarded from another rank keeps naming the original exception's class
        exc_type = (getattr(exc, "exc_type", None) if remote_tb else None) or type(exc).__name__
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if remote_tb:
            tb = f"{remote_tb}\n(then, on rank {rank}):\n{tb}"
        origin = getattr(exc, "rank", None)
        if isinstance(origin, int) and getattr(exc, "remote_traceback", None) is not None:
            # an error forwarded from a deeper rank: keep naming where it started
            return cls(
                origin,
                getattr(exc, "module", module),
                getattr(exc, "microbatch", microbatch),
                getattr(exc, "phase", phase),
                exc_type,
                str(exc),
                tb,
            )
        return cls(rank, module, microbatch, phase, exc_type, str(exc), tb)

    def describe(self) -> str:
        where = "the step function" if self.module == "<step>" else f"module {self.module or '<model>'!r}"
        return (
            f"{self.exc_type} on rank {self.rank} in {where} ({self.phase}, microbatch {self.microbatch}): "
            f"{self.message}"
        )


@pickled_by_position
@dataclass(slots=True)
class Response:
    """The answer to a Request: outputs (FWD) or input gradients (BWD), or the failure."""

    step: StepId
    request_id: int
    responder: int
    payload: Any = None
    """FWD: the skeleton of the module's output."""
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    """FWD: the output tensors; BWD: the gradients of the inputs that required grad (None if unused)."""
    requires_grad: tuple[bool, ...] = ()
    """FWD: which output tensors require grad on the owner (they get an autograd link)."""
    failure: Failure | None = None
    template_id: int | None = None
    """Static mode: as Request.template_id."""
    digest: int | None = None
    """Fast mode, to pp_rank 0: the digest of a response that carries no data (mp_pipeline.posted.digest),
    which the requester keeps to check the acknowledgement of the same call once it is posted."""


@pickled_by_position
@dataclass(slots=True)
class Compact:
    """Static mode: a Request or Response rebuilt by the receiver from an announced template; only what
    changes between steps travels."""

    step: StepId
    template_id: int
    request_id: int
    tensors: list[torch.Tensor | None]
    forward_id: int | None = None
    refs: tuple[Ref, ...] = ()
    posted: bool = False


@pickled_by_position
@dataclass(slots=True)
class PostedSync:
    """pp_rank 0 to an owner, once its step's tasks are done: it posted ``count`` calls there in this step;
    answer with a :class:`PostedAck` once they have all run."""

    step: StepId
    requester: int
    count: int


@pickled_by_position
@dataclass(slots=True)
class PostedAck:
    """An owner to pp_rank 0: the posted calls it ran since its last acknowledgement, each as (request_id,
    digest of its response, or None when the response carried data and was sent)."""

    step: StepId
    done: tuple[tuple[int, int | None], ...]


@pickled_by_position
@dataclass(slots=True)
class Handoff:
    """Fast mode: a tensor sent straight from one module's owner to the next one's (fast mode)."""

    step: StepId
    key: tuple[str, int, int, int]
    """("act" for an output, "grad" for its gradient, requester, forward_id, output index)."""
    tensor: torch.Tensor


@pickled_by_position
@dataclass(slots=True)
class StepEnd:
    """pp_rank 0 to the other ranks of its pipeline: the step is over; here are its outputs."""

    step: StepId
    results: Any = None
    program: Any = None
    """Per-rank replay (mp_pipeline.replay): the receiver's program, run from the next step on (None: keep
    the one it has)."""


@pickled_by_position
@dataclass(slots=True)
class StepAbort:
    """The step failed on the sender (or a rank it heard from): stop serving and raise."""

    step: StepId
    failure: Failure


@pickled_by_position
@dataclass(slots=True)
class Entered:
    """A rank, between steps, to the other ranks of its pipeline: it entered `what`, a collective over
    the pipeline (a gather of the model's state), its `count`-th (see PipelineRuntime.enter)."""

    what: str
    count: int
