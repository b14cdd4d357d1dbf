"""A run of programmed calls on one owner served as one graph, with one backward (per-rank replay).

Under per-rank replay (mp_pipeline.replay) the owner of a chain of blocks runs them one after the other,
each output handed to the next call on the same rank (fast mode's handoff). Served call by call, every
call is its own autograd record (its input joined to a fresh graph through
:class:`~mp_pipeline.link.Received`) and its own ``torch.autograd.backward``, whose gradient of the input is
then handed back to the call before it for that call's backward: per call, a graph boundary on the way
forward and an autograd pass on the way back.

Here such a handed-off output goes into the next call as it is, graph and all: the calls of the run form
one graph, and the backward of its last call (the one whose output leaves the run) is one
``torch.autograd.backward`` through all of them, down to the run's inputs. The earlier calls' backward
calls, which pp_rank 0's program still makes (and checks), then only answer with what that pass
computed. Each call's response stays what it would have been: the gradient a consumer's input received
is noted by a hook on that input (as a ``meta`` placeholder, which is all the requester gets of a
handed-back gradient), so pp_rank 0's digests agree.

A boundary is joined only where nothing can tell: both calls are programmed calls of pp_rank 0 (so the
order of their backwards is the program's), with grad on, not run under a checkpoint by request (a call
made through ``smp.checkpoint``, whose recomputation serves its own backward pass; a module marked for
checkpointing checkpoints inside its own forward, which a join does not change), without zero_bubble's
split backward
(which runs each call's input and weight halves at times of their own); the producer has exactly one
output that requires grad, with a ``grad_fn`` (it goes only to the next call), and made no call to another
rank; and neither module, nor any module inside it, carries a module hook (forward or backward, global
ones included) or has a part placed on another rank. Outputs that pp_rank 0 reads, a tensor passed to two
modules, and nested calls keep the per-call path. What changes is only where autograd's sums happen: a
parameter used by two calls of one run gets one accumulation of the summed gradient, as in plain PyTorch,
instead of two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mp_pipeline.messages import Request
from mp_pipeline.posted import meta_base
from mp_pipeline.replay import REPLAY_BASE

__all__ = ["Fusion", "meta_like", "note_gradient"]

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
"""The hook dicts of an nn.Module (read through ``vars``: torch has no public query)."""
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
"""torch.nn.modules.module's dicts of the hooks registered for every module."""


def _hook_dicts(module: nn.Module) -> list[Any]:
    """The hook dicts of ``module`` and of every module inside it (each module keeps its own for life:
    registering a hook adds to it)."""
    return [found[name] for m in module.modules() for name in _MODULE_HOOKS if name in (found := vars(m))]


def _global_hooks() -> bool:
    """Whether a module hook is registered for every module."""
    shared = vars(torch.nn.modules.module)
    return any(shared.get(name) for name in _GLOBAL_HOOKS)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t, device="meta")`` (shape, dtype and strides of ``t``, no data), for a
    contiguous ``t`` as a ``detach()`` of the kept meta tensor of its shape and dtype
    (:func:`mp_pipeline.posted.meta_base`): a new tensor in a third of ``empty_like``'s time, made once
    per call an owner runs."""
    if not t.is_contiguous():
        return torch.empty_like(t, device="meta")
    return meta_base(t.shape, t.dtype).detach()


def note_gradient(grads: list[torch.Tensor | None], index: int) -> Callable[[torch.Tensor], None]:
    """A tensor hook that notes, in ``grads[index]``, the gradient that reached the tensor as a ``meta``
    placeholder (what the requester gets of a gradient handed back to its producer)."""

    def hook(grad: torch.Tensor) -> None:
        grads[index] = meta_like(grad)

    return hook


class Fusion:
    """One owner's decisions about which calls join the graph of the call before them.

    ``owners``: module path -> pp_rank of every placed module; ``pp_rank`` and ``driver`` (pp_rank 0's
    global rank): this rank's. :meth:`begin_step` forgets what it found about modules (hooks may be
    registered between steps).
    """

    def __init__(self, owners: Mapping[str, int], pp_rank: int, driver: int) -> None:
        self.owners = owners
        self.pp_rank = pp_rank
        self.driver = driver
        self._hooks: dict[str, list[Any] | None] = {}
        """Per module path: the hook dicts of the modules inside it, or None when a part of it is placed
        on another rank (placements and module trees stay; hooks may come and go)."""
        self._global = False
        """This step: a module hook registered for every module."""

    def begin_step(self) -> None:
        self._global = _global_hooks()

    def plain(self, path: str, module: nn.Module) -> bool:
        """Whether a call of ``module`` (at ``path``) may be part of a run: no module hook in it (nor a
        global one), no part of it placed on another rank (it could call another rank)."""
        if path not in self._hooks:
            prefix = f"{path}." if path else ""
            whole = all(owner == self.pp_rank for q, owner in self.owners.items() if q.startswith(prefix))
            self._hooks[path] = _hook_dicts(module) if whole else None
        dicts = self._hooks[path]
        return dicts is not None and not self._global and not any(dicts)

    def joinable(self, request: Request, module: nn.Module, split: bool) -> bool:
        """Whether ``request`` (a forward) may join the graph of a call before it, or be joined by one after
        it: a programmed call of pp_rank 0, with grad, not checkpointed, whole backward, plain module."""
        return (
            request.requester == self.driver
            and request.request_id >= REPLAY_BASE
            and request.state.grad_enabled
            and not request.checkpoint
            and not split
            and self.plain(request.module, module)
        )

    @staticmethod
    def produces(kept: list[torch.Tensor], nested: list[torch.Tensor]) -> bool:
        """Whether a joinable call's outputs let the next call join it: exactly one output that requires
        grad, made by an operation (not a leaf), and no call to another rank made inside it."""
        return len(kept) == 1 and kept[0].grad_fn is not None and not nested
