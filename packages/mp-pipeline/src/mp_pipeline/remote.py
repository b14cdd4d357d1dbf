"""Remote module execution with autograd across ranks.

Requester side: every module of a partitioned model gets a forward that runs the module where it is
(its owner is this rank) or sends a forward request to its owner and waits (:meth:`Remote.call`). The
outputs that require grad on the owner are wired into the requester's autograd graph through
:class:`~mp_pipeline.link.RemoteFunction` and :class:`~mp_pipeline.link.Unpack` (mp_pipeline.link). A
zero-size "anchor" tensor that requires grad is passed to the function so that it joins the graph even
when no input requires grad (the gradient then flows only into the owner's parameters).

Owner side (:meth:`Remote.handle`): a forward request runs the module's own forward on the received
inputs (those that required grad joined to the graph through :class:`~mp_pipeline.link.Received`), under
the requester's grad mode and autocast, and keeps, until the backward request, each output's gradient
edge and each input's gradient slot, not the tensors: what the module's graph saved is all that stays in
memory, so activation checkpointing and offloading free what they promise. The backward request runs
``torch.autograd.backward`` on the kept edges; parameter gradients accumulate on the owner and the inputs'
gradients go back. An output is also held as a tensor while a shortcut may still refer to it (below).
Hooks registered on a module run once, on the rank that calls it. Under per-rank replay a call may
instead take the output that the call before it on this rank handed to it as it is, graph and all: a run
of such calls is one graph with one backward (:mod:`mp_pipeline.fused` says where).

The child-to-child shortcut (fast mode, docs/pipeline.md) comes in two forms, both named in the request
(:attr:`Request.refs`). (1) A tensor that came back from a module's owner and goes, unchanged, into
another module on that same owner is not sent back: the owner uses the output it kept for the
backward. "Unchanged" is checked, not assumed: the same tensor object, its version counter not bumped
since it arrived (no in-place change), and the forward that produced it not yet backwarded; otherwise
the data travels as usual. (2) From the second step on, an output that the parent only passes on to
one other module (learned in the first step, :mod:`mp_pipeline.fast`) does not come back at all: its
owner hands it to the next module's owner (:attr:`Request.handoff`), the parent holds a ``meta``
placeholder, and the gradient goes straight back from consumer to producer (:attr:`Request.handed`).
Consecutive children then cost one transfer per activation and per gradient instead of two.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from mp_pipeline.context import TaskContext, applied, capture, current, task_context
from mp_pipeline.errors import FlowChangedError, NotInStepError, PipelineError
from mp_pipeline.fast import CallKey, FastPlan
from mp_pipeline.fused import Fusion, meta_like, note_gradient
from mp_pipeline.link import Chained, Link, Received, RemoteFunction, Run, Unpack, raise_failure, remote_error
from mp_pipeline.messages import Ref, Request, Response, StepId
from mp_pipeline.posted import Predictions
from mp_pipeline.schedule import Phase
from mp_pipeline.split_backward import WeightQueue, backward_input
from mp_pipeline.structure import Slot, flatten, unflatten
from mp_pipeline.timeline import RECORDER, EventKind

__all__ = ["Remote", "remote_error"]

log = logging.getLogger(__name__)

_ORIGINAL = "_mp_pipeline_original_forward"
_NO_REFS: dict[int, Ref] = {}
"""A request's inputs by slot when none travels otherwise (never written)."""
_SLOT0 = Slot(0)
"""The skeleton of an output that is one tensor (what flatten gives)."""


def _checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


@dataclass
class _Saved:
    grads: list[torch.Tensor | None]
    """Per input that requires grad: its gradient, filled by the backward (link.Received)."""
    edges: list[GradientEdge | None]
    """Per output that requires grad: where the backward starts (None while :attr:`outputs` holds it:
    taken from it when it is let go, or at the backward; mp_pipeline.fused joins need none)."""
    outputs: list[torch.Tensor | None]
    """Per output that requires grad: the tensor, while a shortcut may still refer to it, else None."""
    routes: list[Ref | None]
    """Per input: the handed-off output it was (its gradient goes back to the producer), or None."""
    inputs: list[GradientEdge] = field(default_factory=list)
    """Split backward (``weights``): per input that requires grad, its gradient edge."""
    params: list[nn.Parameter] | None = None
    """Split backward: the module's parameters; None when the call's backward runs whole (no split, or
    a checkpointed call, whose recomputation serves one backward pass)."""
    nested: list[torch.Tensor] = field(default_factory=list)
    """Split backward: the anchors of the calls this call made to other ranks (backward_input's
    ``must_run``)."""
    joins: bool = False
    """The next call on this rank may take its output as it is, graph and all (mp_pipeline.fused)."""
    joined: bool = False
    """The next call took it so: that call's run's backward fills :attr:`grads`; its own only answers."""
    hooks: list[RemovableHandle] = field(default_factory=list)
    """The hooks that note the gradients of the inputs it took from the call before it (grads)."""

    def let_go(self, k: int, *, joined: bool) -> None:
        """Output ``k`` is no longer held (handed on): its gradient edge is kept instead, unless the call
        that took it joined its graph (the run's backward then starts there)."""
        output = self.outputs[k]
        if output is not None and self.edges[k] is None and not joined:
            self.edges[k] = get_gradient_edge(output)
        self.outputs[k] = None

    def edge(self, k: int) -> GradientEdge:
        found = self.edges[k]
        if found is None:
            output = self.outputs[k]
            assert output is not None, "an output let go without its gradient edge"
            found = self.edges[k] = get_gradient_edge(output)
        return found


_Tail = tuple["weakref.ReferenceType[torch.Tensor]", "weakref.ReferenceType[Run]", int, StepId]
"""Remote._tail's entry: a replayed call's output that the next call may take into its run."""
_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
"""The sequence number the next autograd node made on this thread gets."""


class _Produced(NamedTuple):
    """A tensor a remote forward returned (the shortcut's bookkeeping on the requester)."""

    tensor: weakref.ReferenceType[torch.Tensor]
    link: weakref.ReferenceType[Link]
    kept_index: int
    """Its index among the forward's outputs that require grad (the owner's kept outputs)."""
    version: int
    """Its version counter when it arrived."""
    handed_to: int | None
    """Fast mode: the global rank its owner handed it to (it is a placeholder here), or None."""


class Remote:
    """Remote calls of one partitioned model on one rank (see the module docstring).

    ``server`` is the current step's server (set by the runtime while a step runs); ``peers`` the
    global ranks of this rank's pipeline group in pp_rank order.
    """

    def __init__(self, rank: int, peers: tuple[int, ...]) -> None:
        self.rank = rank
        self.peers = peers
        self.pp_rank = peers.index(rank)
        self.server: Any = None
        self.modules: dict[str, nn.Module] = {}
        self.owners: dict[str, int] = {}
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.checkpointed: set[str] = set()
        """Module paths whose forward runs under activation checkpointing on their owner."""
        self.checkpoint_call: Callable[..., Any] = _checkpoint
        self.weights: WeightQueue | None = None
        """``"pipeline": "zero_bubble"``: a call's backward sends its input gradients first and defers its
        weight half here (mp_pipeline.split_backward); None: whole backwards."""
        self._nested = threading.local()
        self._tail = threading.local()
        """Per thread (``last``): the last replayed call's only output that requires grad, a placeholder
        handed on, and its run (both weakly), the autograd sequence number of its node and its step
        (_run_of)."""
        """Per thread: the anchors of the calls to other ranks made inside the forward it runs (split
        backward: their backward requests must go out in the input half)."""
        """How an owner runs such a module: ``checkpoint_call(forward, *args, **kwargs)`` (the umbrella
        sets mp_memory's, which also offloads the inputs with ``offload_activations``)."""
        self._installed: list[nn.Module] = []
        self.shortcut = False
        """Fast mode: send references instead of tensors their owner already holds (module docstring)."""
        self._produced: dict[int, _Produced] = {}
        self._produced_step: StepId | None = None
        self.plan = FastPlan()
        """Fast mode: which outputs of this rank's remote calls go straight to the next module."""
        self.predictions = Predictions()
        """Fast mode: the responses this rank's calls may post instead of awaiting (mp_pipeline.posted)."""
        self._forwarded: set[tuple[int, int]] = set()
        """(requester, request_id) of the forwards run here this step (a posted consumer may come first)."""
        self._calls: dict[tuple[tuple[str, ...], int], int] = {}
        """Remote calls made in this step by position and microbatch (for their CallKey)."""
        self._taken: dict[int, weakref.ReferenceType[torch.Tensor]] = {}
        """Placeholders of handed-off outputs already passed on in this step (by id, with a reference
        that tells a placeholder still alive from a later tensor that reuses its freed id)."""
        self.backward_requests = 0
        """Backward requests this rank has executed (for the data-parallel reduction decision)."""
        self.fusion = Fusion(self.owners, self.pp_rank, peers[0])
        """Owner, per-rank replay: which programmed calls join the graph of the call before them (a run
        served as one graph with one backward, mp_pipeline.fused)."""

    # -- installation ----------------------------------------------------------------------------------
    def install(self, root: nn.Module, assignment: Mapping[str, int]) -> None:
        """Intercept the forward of every module named in ``assignment`` (path -> pp_rank)."""
        me = weakref.ref(self)
        for path, module in root.named_modules():
            owner = assignment.get(path)
            if owner is None:
                continue
            self.modules[path] = module
            self.owners[path] = owner
            original = module.__dict__.get(_ORIGINAL)
            if original is None:
                original = module.forward
                module.__dict__[_ORIGINAL] = original
            module.forward = _make_forward(me, path, owner, original)
            self._installed.append(module)

    def uninstall(self) -> None:
        for module in self._installed:
            module.__dict__.pop("forward", None)
            module.__dict__.pop(_ORIGINAL, None)
        self._installed.clear()

    # -- requester side --------------------------------------------------------------------------------
    def call(self, path: str, owner: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        server = self.server
        if server is None:
            raise NotInStepError(
                f"module {path!r} lives on pp_rank {owner} and can only run inside an @smp.step function "
                f"(this is pp_rank {self.pp_rank}); call the model from the step function"
            )
        task = current()
        microbatch = task.microbatch if task is not None else -1
        position = (task.position if task is not None else ()) + (path,)
        if (
            task is not None
            and task.opened is None
            and task.on_backward is not None
            and not task.backward_calls
        ):
            # the step function's first call to another rank: did pp_rank 0 compute before it?
            task.opened = not task.computed
            if server.replay is not None and server.replay.recording:
                server.replay.opened(microbatch, task.opened)
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # one tensor: as flatten gives
            skeleton: Any = ((_SLOT0,), {})
            tensors = [args[0]]
        else:
            skeleton, tensors = flatten((args, kwargs))
        state = capture()
        grad_on = state.grad_enabled
        requires = tuple([grad_on and t.requires_grad for t in tensors])
        dest = self.peers[owner]
        call: CallKey | None = None
        if self.shortcut:
            key = (position, microbatch)
            n = self._calls.get(key, 0)
            self._calls[key] = n + 1
            call = (position, microbatch, n)
            if self.plan.learning:
                self.plan.consumed(tensors, requires, dest)
        # while fast mode learns, our own tensor operations below are not the parent's use of its outputs
        learning = call is not None and self.plan.learning
        unwatched = torch._C.DisableTorchFunction() if learning else contextlib.nullcontext()
        with unwatched:
            request_id = server.next_request_id()
            sent: list[torch.Tensor | None] = [t.detach() for t in tensors]
            refs: tuple[Ref, ...] = ()
            handoff: tuple[tuple[int, int], ...] = ()
            if call is not None:
                refs = self._references(path, tensors, requires, dest, server.step)
                for ref in refs:
                    sent[ref.slot] = None
                server.stats["shortcuts"] += len(refs)
                handoff = self.plan.handoff(call)
            request = Request(
                step=server.step,
                request_id=request_id,
                requester=self.rank,
                phase=Phase.FORWARD,
                module=path,
                microbatch=microbatch,
                position=position,
                payload=skeleton,
                tensors=sent,
                requires_grad=requires,
                state=state,
                checkpoint=path in self.checkpointed,
                refs=refs,
                handoff=handoff,
            )
            grad = state.grad_enabled
            predicted = self.predictions.predicted(call, Phase.FORWARD, grad) if call is not None else None
            replay = server.replay
            replaying = call is not None and replay is not None and replay.active is not None
            if replaying:
                assert call is not None and replay is not None
                # per-rank replay (mp_pipeline.replay): the owner runs it from its program
                check = None
                if predicted is not None:
                    check = self.predictions.checker(call, Phase.FORWARD, grad, path, raise_failure)
                posted = check is not None and check.digest is not None
                request_id = request.request_id = replay.match(dest, request, posted)
                replied = server.replayed(dest, request, check if posted else None)
                if replied is None:
                    assert predicted is not None
                    response = predicted.response(server.step, request_id, dest)
                else:
                    response = replied
                    if response.failure is not None:
                        raise remote_error(response.failure)
                    self.predictions.learn(call, Phase.FORWARD, grad, response)
            elif predicted is not None and call is not None and not learning:
                check = self.predictions.checker(call, Phase.FORWARD, grad, path, raise_failure)
                server.post(dest, request, check)
                response = predicted.response(server.step, request_id, dest)
            else:
                response = server.call(dest, request)
                if response.failure is not None:
                    raise remote_error(response.failure)
                if call is not None:
                    self.predictions.learn(call, Phase.FORWARD, grad, response)
            outputs: list[Any] = list(response.tensors)
            wire = [i for i, r in enumerate(response.requires_grad) if r]
            if wire and state.grad_enabled:
                grad_inputs = [t for t, r in zip(tensors, requires, strict=True) if r]
                link = Link(
                    self,
                    dest,
                    server.step,
                    request_id,
                    path,
                    microbatch,
                    position,
                    len(grad_inputs),
                    len(wire),
                    call,
                )
                received = [outputs[i] for i in wire]
                if (
                    replaying
                    and not learning
                    and grad_inputs
                    and getattr(self._nested, "anchors", None) is None
                    and all(t.device.type in ("cpu", "meta") for t in received)
                ):
                    # per-rank replay: a node (link.Chained) per run of calls; its inputs join it to the graph
                    run, inputs = self._run_of(link, grad_inputs, server)
                    wired = Chained.apply(run, len(run.links), received, *inputs)  # type: ignore[no-untyped-call]
                    for i, t in zip(wire, wired, strict=True):
                        outputs[i] = t
                    if call is not None:
                        self._remember(link, wired, dict(handoff))
                    self._tail.last = (
                        (weakref.ref(wired[0]), weakref.ref(run), _sequence_nr() - 1, server.step)
                        if len(wired) == 1 and wired[0].is_meta and 0 in dict(handoff)
                        else None
                    )
                    return unflatten(response.payload, outputs)
                anchor = torch.empty(0, requires_grad=True)
                collect = getattr(self._nested, "anchors", None)
                if collect is not None:  # a call inside a forward this rank runs for another
                    collect.append(anchor)
                token = RemoteFunction.apply(link, anchor, *grad_inputs)  # type: ignore[no-untyped-call]
                wired = Unpack.apply(link, received, token)  # type: ignore[no-untyped-call]
                for i, t in zip(wire, wired, strict=True):
                    outputs[i] = t
                if call is not None:
                    self._remember(link, wired, dict(handoff))
                    if learning:
                        self.plan.produced(call, wired)
            return unflatten(response.payload, outputs)

    def _run_of(
        self, link: Link, grad_inputs: list[torch.Tensor], server: Any
    ) -> tuple[Run, Sequence[torch.Tensor]]:
        """The run (link.Run) whose node a replayed call's outputs get, and that node's inputs: the run of
        the call before it on this thread, which it joins (see link.Run for when), or a new one."""
        tail: _Tail | None = getattr(self._tail, "last", None)
        if tail is not None and len(grad_inputs) == 1:
            output, ran, seq, step = tail
            taken, run = grad_inputs[0], ran()
            if (
                run is not None
                and run.inputs is not None
                and taken is output()
                and step == server.step
                and seq + 1 == _sequence_nr()  # no autograd node made since (no other use of it in between)
                and not taken.retains_grad
            ):
                run.join(link, taken)
                server.stats["chained"] = server.stats.get("chained", 0) + 1
                return run, run.inputs
        return Run(link, grad_inputs), grad_inputs

    def begin_step(self, step: StepId) -> None:
        # ids of the last step's tensors mean nothing now
        self._produced.clear()
        self._calls.clear()
        self._taken.clear()
        self._forwarded.clear()
        self.fusion.begin_step()
        self._produced_step = step
        if self.shortcut:
            self.plan.begin_step()

    def end_step(self, *, completed: bool) -> None:
        self._produced.clear()
        self._produced_step = None
        if self.shortcut:
            self.plan.end_step(completed=completed)

    def _remember(self, link: Link, outputs: tuple[torch.Tensor, ...], handoff: dict[int, int]) -> None:
        ref = weakref.ref(link)
        for k, t in enumerate(outputs):
            handed_to = handoff.get(k) if t.is_meta else None
            self._produced[id(t)] = _Produced(weakref.ref(t), ref, k, t._version, handed_to)

    def _references(
        self, path: str, tensors: list[torch.Tensor], requires: tuple[bool, ...], dest: int, step: StepId
    ) -> tuple[Ref, ...]:
        """The inputs that ``dest`` holds already: outputs it kept from an earlier forward of this step,
        unchanged, or outputs handed to it. A placeholder that cannot go as planned is a flow change."""
        if self._produced_step != step:
            return ()
        refs = []
        for j, (t, r) in enumerate(zip(tensors, requires, strict=True)):
            made = self._produced.get(id(t))
            if made is None or made.tensor() is not t:
                continue
            link = made.link()
            usable = r and link is not None and not link.backward_sent and t._version == made.version
            if made.handed_to is not None:
                taken = self._taken.get(id(t))
                if not usable or made.handed_to != dest or (taken is not None and taken() is t):
                    producer = repr(link.module) if link is not None else "a module"
                    raise FlowChangedError(
                        f"rank {self.rank}: under fast mode, output {made.kept_index} of {producer} was to "
                        f"go straight to rank {made.handed_to}, its only consumer in the first step; now "
                        f"module {path!r} on rank {dest} takes it (or takes it a second time), or it was "
                        "changed in place. The flow changed: set 'fast_mode' to False, or keep the flow the "
                        "same in every step."
                    )
                assert link is not None
                self._taken[id(t)] = weakref.ref(t)  # handed over once: a second consumer would wait forever
                refs.append(Ref(j, link.dest, link.request_id, made.kept_index, True))
            elif usable and link is not None and link.dest == dest:
                refs.append(Ref(j, dest, link.request_id, made.kept_index, False))
        return tuple(refs)

    # -- owner side ------------------------------------------------------------------------------------
    def handle(self, request: Request) -> Response:
        if request.phase is Phase.FORWARD:
            return self._forward(request)
        return self._backward(request)

    def _forward(self, request: Request) -> Response:
        module = self.modules.get(request.module)
        if module is None:
            raise PipelineError(f"rank {self.rank} has no module {request.module!r} to execute")
        original: Callable[..., Any] = module.__dict__[_ORIGINAL]
        tensors: list[Any] = []
        grads: list[torch.Tensor | None] = []
        routes: list[Ref | None] = []
        inputs: list[GradientEdge] = []
        anchor: torch.Tensor | None = None
        if self.weights is not None:
            self.weights.make_room(request.microbatch)
        by_slot = {ref.slot: ref for ref in request.refs} if request.refs else _NO_REFS
        joinable = self.fusion.joinable(request, module, self.weights is not None)
        joined: set[int] = set()  # inputs taken as they are, graph and all, from the call before here
        held: dict[int, tuple[torch.Tensor, int]] = {}
        for mine in request.refs:
            if mine.producer != self.rank:
                continue
            output, producer = self._kept_output(request, mine.forward_id, mine.kept_index)
            join = (
                joinable
                and mine.handoff
                and producer.joins
                and not producer.joined
                and request.requires_grad[mine.slot]
            )
            if mine.handoff:  # one consumer (the requester checks): no longer held there
                producer.let_go(mine.kept_index, joined=join)
            if join:
                producer.joined = True
                joined.add(mine.slot)
                taken = output
            else:
                taken = output.detach()
            held[mine.slot] = (taken, taken._version)
        hooks: list[RemovableHandle] = []
        for j, (received, r) in enumerate(zip(request.tensors, request.requires_grad, strict=True)):
            # a shortcut input becomes a fresh leaf (on the kept output's memory, or a handed-off one)
            ref = by_slot.get(j)
            t: torch.Tensor
            if ref is None:
                assert received is not None
                t = received
            elif j in held:
                t = held[j][0]
            else:
                t = self.server.take(("act", request.requester, ref.forward_id, ref.kept_index))
            if r and j in joined:  # its gradient comes from its run's one backward, noted here
                hooks.append(t.register_hook(note_gradient(grads, len(grads))))  # type: ignore[no-untyped-call]
                grads.append(None)
                routes.append(None)
            elif r:
                if anchor is None:
                    anchor = torch.empty(0, requires_grad=True)
                with torch.enable_grad():  # r says the requester's mode records it (this thread may not)
                    t = Received.apply(grads, len(grads), anchor, t)  # type: ignore[no-untyped-call]
                    if self.weights is not None:  # split backward's input edges
                        inputs.append(get_gradient_edge(t))
                grads.append(None)
                routes.append(ref if ref is not None and ref.handoff else None)
            tensors.append(t)
        if joined:
            self.server.stats["fused"] = self.server.stats.get("fused", 0) + 1
        args, kwargs = unflatten(request.payload, tensors)
        task = TaskContext(request.microbatch, request.position)
        outer, self._nested.anchors = getattr(self._nested, "anchors", None), []
        learning = self.plan.learning
        try:
            if RECORDER.enabled or learning:
                with (
                    self._recorded(EventKind.FWD, request),
                    task_context(task),
                    applied(request.state),
                    self.plan.watching(),
                ):
                    out = self._run(request, original, args, kwargs)
            else:  # the same without the two that would do nothing (a timeline span, fast mode's watch)
                with task_context(task), applied(request.state):
                    out = self._run(request, original, args, kwargs)
        finally:
            nested: list[torch.Tensor] = self._nested.anchors
            self._nested.anchors = outer
        if held:
            self._check_untouched(request, held)
        skeleton, outs = (_SLOT0, [out]) if type(out) is torch.Tensor else flatten(out)
        if learning:
            self.plan.touched(outs)  # what this module returns leaves its hands: used
        grad_on = request.state.grad_enabled
        out_requires = tuple([grad_on and t.requires_grad for t in outs])
        sent: list[torch.Tensor | None] = list(outs)  # detached below, unless a placeholder goes instead
        here: set[int] = set()  # outputs whose placeholder goes instead
        if any(out_requires):
            wired = [i for i, r in enumerate(out_requires) if r]
            kept = [outs[i] for i in wired]
            # Without shortcuts no later request refers to an output: the edges are all the backward needs.
            # With them an output is held (its edge taken when it is let go, see _Saved.let_go).
            holding: list[torch.Tensor | None]
            edges: list[GradientEdge | None]
            if self.shortcut:
                holding, edges = list(kept), [None] * len(kept)
            else:
                holding, edges = [None] * len(kept), [get_gradient_edge(t) for t in kept]
            # whole backward for a checkpointed call (its recomputation serves one pass)
            split = self.weights is not None and not (request.checkpoint and request.state.grad_enabled)
            self.saved[(request.requester, request.request_id)] = _Saved(
                grads,
                edges,
                holding,
                routes,
                inputs,
                list(module.parameters()) if split else None,
                nested,
                joins=joinable and Fusion.produces(kept, nested),
                hooks=hooks,
            )
            if self.shortcut:
                self._forwarded.add((request.requester, request.request_id))
                self.server.wake(("fwd", request.requester, request.request_id, 0))
            for k, dest in request.handoff:  # fast mode: straight to the next module's owner
                if k < len(kept):
                    if dest == self.rank:  # the consumer is here too: it takes the kept output
                        self.server.stats["handoffs"] += 1
                    else:  # handed over: no request refers to it here again
                        key = ("act", request.requester, request.request_id, k)
                        self.server.hand(dest, key, kept[k].detach())
                        self.saved[(request.requester, request.request_id)].let_go(k, joined=False)
                    sent[wired[k]] = meta_like(kept[k])
                    here.add(wired[k])
        for i, t in enumerate(outs):
            if i not in here:
                sent[i] = t.detach()
        return Response(request.step, request.request_id, self.rank, skeleton, sent, out_requires)

    def _run(
        self, request: Request, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The module's own forward on the request's arguments (under a checkpoint where asked)."""
        if request.checkpoint and request.state.grad_enabled:
            return self.checkpoint_call(original, *args, **kwargs)
        return original(*args, **kwargs)

    def _kept_output(self, request: Request, forward_id: int, index: int) -> tuple[torch.Tensor, _Saved]:
        """The output a shortcut refers to (as its producer returned it), with its producer's record."""
        saved = self.saved.get((request.requester, forward_id))
        if saved is None and (request.requester, forward_id) not in self._forwarded:
            # the producer's forward was posted too and has not run here yet: wait for it
            self.server.await_local(("fwd", request.requester, forward_id, 0))
            saved = self.saved.get((request.requester, forward_id))
        output = saved.outputs[index] if saved is not None and index < len(saved.outputs) else None
        if output is None:
            raise PipelineError(
                f"rank {self.rank} no longer keeps output {index} of forward request {forward_id} from rank "
                f"{request.requester}, which the request for module {request.module!r} refers to (fast "
                "mode's child-to-child shortcut); its backward already ran, or a consumer took it"
            )
        assert saved is not None
        return output, saved

    def _check_untouched(self, request: Request, held: dict[int, tuple[torch.Tensor, int]]) -> None:
        # A shortcut input shares memory (and the version counter) with the producer's kept output: a
        # module that changed it in place (under no_grad: autograd allows that on a leaf) would have
        # changed what the producer's backward reads. Without the shortcut it would have had a copy.
        for j, (t, version) in held.items():
            if t._version != version:
                raise PipelineError(
                    f"module {request.module!r} changed its input {j} in place; under fast mode that input "
                    "shares memory with the output of the module that produced it (the child-to-child "
                    "shortcut), whose backward needs it unchanged. Clone the input before changing it, or "
                    "set 'fast_mode' to False."
                )

    def _recorded(self, kind: EventKind, request: Request) -> contextlib.AbstractContextManager[None]:
        """The execution as a timeline event (a no-op unless the timeline is recording)."""
        return RECORDER.span(
            kind, rank=self.rank, step=request.step.step, module=request.module, microbatch=request.microbatch
        )

    def _backward(self, request: Request) -> Response:
        assert request.forward_id is not None
        self.backward_requests += 1
        saved = self.saved.pop((request.requester, request.forward_id), None)
        if saved is None:
            raise PipelineError(
                f"rank {self.rank} has no saved forward of module {request.module!r} (request "
                f"{request.forward_id} from rank {request.requester}) to run backward on; was its "
                "backward requested twice?"
            )
        given: list[torch.Tensor | None] = list(request.tensors)
        if saved.joined:  # the next call took its output as it was: the run's one backward ran this one's
            given = [None] * len(given)
        else:
            for k in request.handed:  # gradients the consumers of handed-off outputs sent here themselves
                given[k] = self.server.take(("grad", request.requester, request.forward_id, k))
        pairs = [(saved.edge(k), g) for k, g in enumerate(given) if g is not None]
        if pairs:  # (none for the earlier calls of a run served as one graph: they only answer)
            self._backward_pass(request, saved, pairs)
        grads: list[torch.Tensor | None] = []
        for grad, route in zip(saved.grads, saved.routes, strict=True):
            if route is not None and grad is not None:  # to the producer; the requester gets a placeholder
                key = ("grad", request.requester, route.forward_id, route.kept_index)
                self.server.hand(route.producer, key, grad)
                grads.append(meta_like(grad))
            else:
                grads.append(grad)
        for hook in saved.hooks:  # (after the backward: the last call's fire in it)
            hook.remove()
        return Response(request.step, request.request_id, self.rank, tensors=grads)

    def _backward_pass(
        self, request: Request, saved: _Saved, pairs: list[tuple[GradientEdge, torch.Tensor]]
    ) -> None:
        """The backward of a call from its outputs' edges with the given gradients: whole, or (split
        backward) the input half now and the weight half queued."""
        task = TaskContext(request.microbatch, request.position)
        if saved.params is not None and self.weights is not None:
            with self._recorded(EventKind.BWD, request), task_context(task), applied(request.state):
                found, half = backward_input(
                    [e for e, _ in pairs],
                    [g for _, g in pairs],
                    saved.inputs,
                    saved.params,
                    must_run=saved.nested,
                )
            saved.grads[:] = found
            state, span = request.state, self._recorded(EventKind.BWD, request)
            self.weights.add(request.microbatch, half, lambda: _weight_context(task, state, span))
        else:
            with self._recorded(EventKind.BWD, request), task_context(task), applied(request.state):
                torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])


@contextlib.contextmanager
def _weight_context(
    task: TaskContext, state: Any, span: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    """A deferred weight half runs as its call's backward did: task context, grad mode, autocast; the
    timeline records it as a backward of the call (``span``)."""
    with span, task_context(task), applied(state):
        yield


def _make_forward(
    remote: weakref.ReferenceType[Remote], path: str, owner: int, original: Callable[..., Any]
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        r = remote()
        if r is None:
            return original(*args, **kwargs)
        if owner != r.pp_rank:
            return r.call(path, owner, args, kwargs)
        out = original(*args, **kwargs)
        if owner == 0:  # pp_rank 0 computed (TaskContext.opened); read only until its first remote call
            task = current()
            if task is not None:
                task.computed = True
        return out

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward
