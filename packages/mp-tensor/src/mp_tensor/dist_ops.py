"""Data movement of tensor parallelism across data-parallel ranks (docs/tensor.md).

By default every tp_rank holds *different* samples. A distributed module works on the samples of the
whole TP group, so its input is exchanged on the way in and its output returned on the way out. There
are three layouts of an activation of hidden size H on a TP group of T ranks with B local samples each:

=============  ================================  =============================================
layout         shape on tp_rank j                 contents
=============  ================================  =============================================
``local``      ``[B, ..., H]``                    this rank's samples, every channel
``sharded``    ``[T*B, ..., H/T]``                every rank's samples (in tp_rank order), channels j
``replicated`` ``[T*B, ..., H]``                  every rank's samples, every channel, same on all
=============  ================================  =============================================

With ``prescaled_batch`` the TP group shares one batch, so ``local`` is ``replicated`` and only slicing
happens. The transitions (and their backward, which the chain rule asks for) are:

- local → sharded: all-to-all (split channels, concatenate samples); prescaled: slice the channels.
- sharded → local: the inverse all-to-all; prescaled: all-gather the channels.
- local → replicated: all-gather the samples; prescaled: nothing.
- replicated → local: keep this rank's samples (backward all-gathers); prescaled: nothing.
- sharded ↔ replicated: all-gather / slice the channels.

smp's ``smp.nn.utils`` primitives (``fwd_allreduce_for_tp`` ...) are here too, over an explicit
context or the current one.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from mp_comm import collectives as col
from mp_tensor.context import TPContext, current_context
from mp_tensor.errors import TPInputError

__all__ = [
    "Layout",
    "bwd_allreduce_for_tp",
    "check_batch",
    "enter",
    "fused_allgather_for_tp",
    "fwd_allreduce_for_tp",
    "gather_samples",
    "leave",
    "reduce_scatter_for_tp",
    "replicated_to_sharded",
    "scatter_and_merge_for_tp",
    "sharded_to_replicated",
    "tp_dropout",
]

Layout = Literal["sharded", "replicated"]


def check_batch(x: Tensor, what: str) -> None:
    if x.dim() < 2:
        raise TPInputError(
            f"{what} got a tensor of shape {tuple(x.shape)}; tensor parallelism across data-parallel ranks "
            "needs a leading sample (batch) dimension and a channel dimension. Add a batch dimension."
        )


def enter(x: Tensor, ctx: TPContext, layout: Layout, what: str = "a distributed module") -> Tensor:
    """``local`` → ``layout`` (channels are the last dimension, samples the first)."""
    if not ctx.distributed:
        return x
    check_batch(x, what)
    assert ctx.group is not None
    if layout == "sharded":
        if ctx.prescaled_batch:
            return col.split(x, -1, ctx.group)
        return col.all_to_all(x, -1, 0, ctx.group)
    if ctx.prescaled_batch:
        return x
    return col.all_gather(x, 0, ctx.group)


def leave(x: Tensor, ctx: TPContext, layout: Layout) -> Tensor:
    """``layout`` → ``local``."""
    if not ctx.distributed:
        return x
    assert ctx.group is not None
    if layout == "sharded":
        if ctx.prescaled_batch:
            return col.all_gather(x, -1, ctx.group)
        return col.all_to_all(x, 0, -1, ctx.group)
    if ctx.prescaled_batch:
        return x
    return col.split(x, 0, ctx.group)


def sharded_to_replicated(x: Tensor, ctx: TPContext) -> Tensor:
    """All-gather the channels; backward keeps this rank's slice (the consumer is replicated)."""
    if not ctx.distributed:
        return x
    assert ctx.group is not None
    return col.all_gather(x, -1, ctx.group)


def replicated_to_sharded(x: Tensor, ctx: TPContext) -> Tensor:
    """Keep this rank's channels; backward all-gathers them."""
    if not ctx.distributed:
        return x
    assert ctx.group is not None
    return col.split(x, -1, ctx.group)


@overload
def gather_samples(x: Tensor, ctx: TPContext, batch: int | None = None) -> Tensor: ...
@overload
def gather_samples(x: None, ctx: TPContext, batch: int | None = None) -> None: ...
def gather_samples(x: Tensor | None, ctx: TPContext, batch: int | None = None) -> Tensor | None:
    """Every TP rank's samples of a tensor that needs no gradient (masks, token ids), in tp_rank order.

    ``batch``: the local batch size; a tensor whose first dimension is 1 (broadcast over samples) is
    expanded to it first, so that every rank's part lines up with its samples.
    """
    if x is None or not ctx.distributed or ctx.prescaled_batch:
        return x
    assert ctx.group is not None
    x = x.detach()
    if x.dim() == 0:
        return x
    if batch is not None and x.shape[0] == 1 and batch != 1:
        x = x.expand(batch, *x.shape[1:])
    return col.all_gather(x.contiguous(), 0, ctx.group)


# ---------------------------------------------------------------------- smp's smp.nn.utils primitives


def _group(ctx: TPContext | None) -> TPContext:
    return current_context(ctx, who="a tensor-parallel collective")


def fused_allgather_for_tp(tensor: Tensor, dim: int, *, tp: TPContext | None = None) -> Tensor:
    """All-gather ``tensor`` over the TP group and concatenate along ``dim`` (backward: this rank's slice)."""
    ctx = _group(tp)
    return tensor if ctx.group is None else col.all_gather(tensor, dim, ctx.group)


def fwd_allreduce_for_tp(tensor: Tensor, *, tp: TPContext | None = None) -> Tensor:
    """Sum ``tensor`` over the TP group in forward; identity in backward."""
    ctx = _group(tp)
    return tensor if ctx.group is None else col.all_reduce(tensor, ctx.group)


def bwd_allreduce_for_tp(tensor: Tensor, *, tp: TPContext | None = None) -> Tensor:
    """Identity in forward; sums the gradient over the TP group in backward."""
    ctx = _group(tp)
    return tensor if ctx.group is None else col.all_reduce_backward(tensor, ctx.group)


def scatter_and_merge_for_tp(
    tensor: Tensor, split_dim: int, merge_dim: int, *, tp: TPContext | None = None
) -> Tensor:
    """Slice ``split_dim`` into tp_size pieces, all-to-all them, concatenate arrivals on ``merge_dim``."""
    ctx = _group(tp)
    return tensor if ctx.group is None else col.all_to_all(tensor, split_dim, merge_dim, ctx.group)


def reduce_scatter_for_tp(tensor: Tensor, dim: int, *, tp: TPContext | None = None) -> Tensor:
    """Sum over the TP group and keep this rank's slice of ``dim`` (backward: all-gather)."""
    ctx = _group(tp)
    return tensor if ctx.group is None else col.reduce_scatter(tensor, dim, ctx.group)


# ------------------------------------------------------------------------------------------ dropout

_generators: dict[tuple[int, str, int], torch.Generator] = {}


def tp_dropout(x: Tensor, p: float, training: bool, ctx: TPContext, kind: Layout) -> Tensor:
    """Dropout whose mask is the same on every TP rank for a replicated activation, and differs per rank
    for a sharded one (its generators are seeded from ``ctx.seed``, not from the global RNG)."""
    if not training or p == 0.0:
        return x
    if not ctx.distributed:
        return torch.nn.functional.dropout(x, p, True)
    if x.device.type == "meta":  # shapes only (mp-plan traces distributed models on meta): no generator
        return x * torch.empty_like(x) / (1.0 - p)
    offset = 0 if kind == "replicated" else 1 + ctx.rank
    key = (ctx.seed, x.device.type, offset if x.device.index is None else offset * 1024 + x.device.index)
    gen = _generators.get(key)
    if gen is None:
        gen = torch.Generator(device=x.device)
        gen.manual_seed(ctx.seed * 7919 + offset)
        _generators[key] = gen
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)
