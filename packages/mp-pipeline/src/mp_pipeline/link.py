"""A remote call in the requester's autograd graph (see mp_pipeline.remote).

The outputs of a remote forward that require grad on their owner are wired into the requester's graph
through :class:`RemoteFunction` and :class:`Unpack`: the latter hands the output gradients over, the
former (whose only output is a CPU token, so that its wait never blocks the CUDA autograd device thread)
sends them to the owner in a backward request (:meth:`Link.backward`) and returns the input gradients it
gets back, or, under fast mode, posts the request and returns the predicted placeholders
(mp_pipeline.posted).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mp_pipeline.context import capture
from mp_pipeline.errors import FlowChangedError, NotInStepError, PipelineError, RemoteExecutionError
from mp_pipeline.fast import CallKey
from mp_pipeline.messages import Failure, Request, Response, StepId
from mp_pipeline.schedule import Phase

if TYPE_CHECKING:
    from mp_pipeline.remote import Remote

__all__ = ["Chained", "Link", "RemoteFunction", "Run", "Unpack", "raise_failure", "remote_error"]


def raise_failure(response: Response) -> None:
    if response.failure is not None:
        raise remote_error(response.failure)


def remote_error(failure: Failure) -> RemoteExecutionError:
    """The exception a requester raises for a failed request."""
    return RemoteExecutionError(
        f"{failure.describe()}\n--- traceback on rank {failure.rank} ---\n{failure.traceback}",
        rank=failure.rank,
        module=failure.module,
        microbatch=failure.microbatch,
        phase=failure.phase,
        remote_traceback=failure.traceback,
        exc_type=failure.exc_type,
    )


class Link:
    """One remote forward call, as its backward needs it."""

    __slots__ = (
        "__weakref__",
        "backward_sent",
        "call",
        "dest",
        "grads",
        "microbatch",
        "module",
        "n_inputs",
        "n_outputs",
        "position",
        "remote",
        "request_id",
        "step",
    )

    def __init__(  # noqa: PLR0917 - internal, built in one place
        self,
        remote: Remote,
        dest: int,
        step: StepId,
        request_id: int,
        module: str,
        microbatch: int,
        position: tuple[str, ...],
        n_inputs: int,
        n_outputs: int,
        call: CallKey | None = None,
    ) -> None:
        self.remote = remote
        self.call = call
        """Fast mode: the call's place in the step (its backward may be posted, see Remote.predicted)."""
        self.dest = dest
        self.step = step
        self.request_id = request_id
        self.module = module
        self.microbatch = microbatch
        self.position = position
        self.n_inputs = n_inputs
        # Only the count: the outputs' grad_fn holds this link (through ctx), so a link holding the
        # outputs would be a cycle through autograd's C++ graph that Python's collector cannot see,
        # keeping every step's received activations and their graphs alive.
        self.n_outputs = n_outputs
        self.grads: tuple[torch.Tensor | None, ...] | None = None
        self.backward_sent = False
        """The owner has been asked for this call's backward (it no longer keeps the outputs)."""

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        self.backward_sent = True
        if all(g is None for g in grads):
            return [None] * self.n_inputs
        server = self.remote.server
        if server is None or server.step != self.step:
            raise NotInStepError(
                f"the backward of module {self.module!r} (called in a pipelined step) ran after that step "
                "ended; call model.backward(loss) inside the @smp.step function"
            )
        # a meta gradient is the placeholder of one the consumer sent to the owner itself (fast mode)
        handed = tuple(k for k, g in enumerate(grads) if g is not None and g.is_meta)
        request = Request(
            step=self.step,
            request_id=server.next_request_id(),
            requester=self.remote.rank,
            phase=Phase.BACKWARD,
            module=self.module,
            microbatch=self.microbatch,
            position=self.position,
            payload=None,
            tensors=[None if g is None or g.is_meta else g.detach() for g in grads],
            requires_grad=(),
            state=capture(),
            forward_id=self.request_id,
            handed=handed,
        )
        call, predictions = self.call, self.remote.predictions
        grad = request.state.grad_enabled
        predicted = predictions.predicted(call, Phase.BACKWARD, grad) if call is not None else None
        replay = server.replay
        if call is not None and replay is not None and replay.active is not None:
            # per-rank replay (mp_pipeline.replay): the owner runs it from its program
            check = None
            if predicted is not None:
                check = predictions.checker(call, Phase.BACKWARD, grad, self.module, raise_failure)
            posted = check is not None and check.digest is not None
            request.request_id = replay.match(self.dest, request, posted)
            replied = server.replayed(self.dest, request, check if posted else None)
            if replied is None:
                assert predicted is not None
                return predicted.placeholders()
            response = replied
        elif predicted is not None and call is not None:
            check = predictions.checker(call, Phase.BACKWARD, grad, self.module, raise_failure)
            server.post(self.dest, request, check)
            return predicted.placeholders()
        else:
            response = server.call(self.dest, request)
        if response.failure is not None:
            raise remote_error(response.failure)
        if call is not None:
            predictions.learn(call, Phase.BACKWARD, grad, response)
        if len(response.tensors) != self.n_inputs:
            raise PipelineError(
                f"rank {response.responder} returned {len(response.tensors)} input gradients for module "
                f"{self.module!r}; expected {self.n_inputs}"
            )
        return list(response.tensors)


class RemoteFunction(torch.autograd.Function):
    """Joins a remote call to the requester's graph; its backward asks the owner for input gradients.

    Its only output is a zero-size CPU token, which :class:`Unpack` turns into the received outputs.
    The autograd engine runs a node on the thread of its gradients' device: CUDA nodes all share one
    device thread, CPU nodes run on the thread that called backward. This node waits for the owner's
    response, so it must block only its own caller (a server worker, which hands the rank to others
    meanwhile), never the device thread that every concurrent backward of this rank needs.
    """

    @staticmethod
    def forward(ctx: Any, link: Link, anchor: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.link = link
        ctx.set_materialize_grads(False)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, token_grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        link: Link = ctx.link
        grads, link.grads = link.grads, None
        return (None, None, *link.backward(grads or (None,) * link.n_outputs))


class Unpack(torch.autograd.Function):
    """The received outputs of a remote call; backward only hands their gradients to the link."""

    @staticmethod
    def forward(
        ctx: Any, link: Link, received: list[torch.Tensor], token: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.link = link
        ctx.set_materialize_grads(False)
        return tuple(received)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, torch.Tensor]:
        ctx.link.grads = grads
        return None, None, torch.zeros(0)


class Run:
    """Consecutive replayed calls of one microbatch on pp_rank 0 whose graph is one :class:`Chained` node.

    Call ``k + 1`` joins the run when its only input that requires grad is the only output of call ``k``
    that does, a ``meta`` placeholder handed straight to its owner (fast mode's only consumer, checked by
    the shortcut), not retaining its gradient, with no autograd node made on the thread in between (so
    that no other part of the graph can run between their backwards). Its node then stands for the whole
    run: its inputs are the run's first call's (placeholders too: nothing is kept alive), and its backward
    calls each call's :meth:`Link.backward` in turn, last call first, passing each one's input gradient to
    the call before as autograd would have (shape checked, dtype cast, the placeholder's tensor hooks run
    on it, also those registered later); the earlier calls' nodes never run. Every call is still matched
    against the program, forward and backward.
    """

    __slots__ = ("__weakref__", "inputs", "links", "taken")

    def __init__(self, link: Link, inputs: list[torch.Tensor]) -> None:
        self.links = [link]
        self.inputs = tuple(inputs) if all(t.is_meta for t in inputs) else None
        """The autograd inputs of the run's node, its first call's inputs that require grad, where they are
        all placeholders (they hold no memory); None: other calls cannot join this one."""
        self.taken: list[_Taken] = []
        """Per call after the first: the placeholder it took from the call before."""

    def join(self, link: Link, taken: torch.Tensor) -> None:
        hooks = taken._backward_hooks
        if hooks is None:  # the dict autograd runs the tensor's hooks from, shared with its node
            hooks = taken._backward_hooks = collections.OrderedDict()
            assert taken.grad_fn is not None
            taken.grad_fn._register_hook_dict(taken)
        self.links.append(link)
        self.taken.append(_Taken(weakref.ref(taken), taken.shape, taken.dtype, hooks))

    def passed(self, k: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient of the placeholder that call ``k`` (> 0) took, for call ``k - 1``'s backward: as
        autograd's engine would have passed it."""
        taken = self.taken[k - 1]
        placeholder = taken.tensor()
        if placeholder is not None and placeholder.retains_grad:
            raise FlowChangedError(
                f"retain_grad() was called on the output of module {self.links[k - 1].module!r} after "
                f"module {self.links[k].module!r} took it, the two replayed as one autograd node: the flow "
                "changed (set 'fast_mode' to False, or call it before the next module takes the output)"
            )
        if grad is None:
            return None
        if grad.shape != taken.shape:
            raise PipelineError(
                f"the backward of module {self.links[k].module!r} returned an input gradient of shape "
                f"{tuple(grad.shape)} for an input of shape {tuple(taken.shape)}"
            )
        if grad.dtype != taken.dtype:
            grad = grad.to(taken.dtype)
        for hook in tuple(taken.hooks.values()):
            replaced = hook(grad)
            if replaced is not None:
                grad = replaced
        return grad


class _Taken(NamedTuple):
    tensor: weakref.ReferenceType[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    hooks: dict[int, Callable[[torch.Tensor], torch.Tensor | None]]
    """The placeholder's tensor hooks (autograd's dict for it: hooks registered later land here too)."""


class Chained(torch.autograd.Function):
    """A remote call in the requester's graph as one node: :class:`RemoteFunction` and :class:`Unpack` in
    one, without the anchor, for a replayed call whose outputs are CPU tensors or ``meta`` placeholders
    (their node runs on the thread that called backward, which may wait) and that has inputs requiring grad
    (they join it to the graph). ``count``: the calls of ``run`` it stands for (a chain of blocks on
    another rank costs pp_rank 0 one node per :class:`Run`, not per call)."""

    @staticmethod
    def forward(
        ctx: Any, run: Run, count: int, received: list[torch.Tensor], *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.run, ctx.count = run, count
        ctx.set_materialize_grads(False)
        return tuple(received)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        run: Run = ctx.run
        links = run.links
        server = links[0].remote.server
        if server is not None:  # (else Link.backward raises NotInStepError)
            server.stats["chained_nodes"] = server.stats.get("chained_nodes", 0) + 1
        for k in range(ctx.count - 1, 0, -1):
            (grad,) = links[k].backward(grads)
            grads = (run.passed(k, grad),)
        return (None, None, None, *links[0].backward(grads))


class Received(torch.autograd.Function):
    """An input a remote forward received that requires grad, made a non-leaf on a zero-size anchor.

    The owner keeps the gradient slot, not the tensor, so the input's memory goes once the module no
    longer holds it (a checkpointed module keeps its own copy, which offloading moves to the host); a leaf
    would have been kept for its ``.grad``. The output shares the input's memory and version counter
    (``detach``), so an in-place change of a shortcut input is still seen (remote.Remote._check_untouched).
    """

    @staticmethod
    def forward(
        ctx: Any, grads: list[torch.Tensor | None], index: int, anchor: torch.Tensor, data: torch.Tensor
    ) -> torch.Tensor:
        ctx.grads, ctx.index = grads, index
        ctx.set_materialize_grads(False)
        return data.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None, None]:
        if grad is not None:  # as a leaf's .grad: dense and contiguous for the transport
            ctx.grads[ctx.index] = grad if grad.is_contiguous() else grad.contiguous()
        return None, None, None, None
