"""Chunk-based overlap of GEMMs with their all-reduces (ATP §4.1-4.2).

Forward: the batch dimension is cut into ``chunks`` pieces; each piece's GEMM is followed by an
asynchronous all-reduce of its output, so the all-reduce of chunk k runs while chunk k+1 computes
(Figure 8). Backward: the grad-input GEMM is chunked the same way, each chunk's all-reduce launched as
soon as it is computed, and the grad-weight GEMM, which depends on none of them, runs while they are in
flight (§4.2).

Rows of a GEMM do not depend on each other, so chunking changes no product. An all-reduce, though,
may add the ranks' values in an order that depends on the message size (gloo's and NCCL's rings cut
the message into per-rank segments), so on groups of more than two ranks a chunked all-reduce can
differ from the whole one in the last bit. ``deterministic=True`` replaces it by an *ordered*
all-reduce: an all-to-all hands every rank one segment from each rank, it adds them in rank order, and
an all-gather returns the sums. That moves the same bytes as a ring all-reduce, and every element is
summed as ``((x0 + x1) + x2) + ...`` whatever the chunking, so chunk counts give bitwise equal results.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mp_comm.collectives import CollectiveHandle, all_gather_async, all_to_all_async

__all__ = ["AllReduceStream", "check_chunks", "chunked_linear_reduce", "linear_backward_overlapped"]

log = logging.getLogger(__name__)


def check_chunks(chunks: int) -> int:
    """``chunks`` if it is a positive int, else a ``ValueError`` naming it."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} is not a positive int; pass 1 (no overlap), 2 or 4.")
    return chunks


@dataclass(eq=False)
class _Ordered:
    """An ordered all-reduce of ``target`` in flight: phase 1 all-to-all, then phase 2 all-gather."""

    target: Tensor
    handle: CollectiveHandle
    phase: int = 1


class AllReduceStream:
    """All-reduces (sums) of tensors submitted one after another, in flight while the caller computes.

    ``submit`` starts one (in place on a contiguous tensor); ``drain`` waits for all. With ``ordered``
    the two-phase deterministic all-reduce is used, each submit moving earlier ones a phase on.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, ordered: bool = False) -> None:
        self.size = 1 if group is None else dist.get_world_size(group)
        self.group = group
        self.ordered = ordered
        self._native: list[dist.Work] = []
        self._ordered: list[_Ordered] = []

    def submit(self, t: Tensor) -> None:
        """Start summing ``t`` (contiguous) over the group, in place."""
        if self.size == 1:
            return
        assert t.is_contiguous()
        if not self.ordered:
            self._native.append(dist.all_reduce(t, group=self.group, async_op=True))
            return
        for pending in self._ordered:  # the previous chunks' all-to-alls had this chunk's GEMM to finish
            if pending.phase == 1:
                self._gather(pending)
        assert self.group is not None
        flat = t.view(-1)
        segment = -(-flat.numel() // self.size)
        send = flat.new_zeros(self.size, segment)  # row k: this rank's values of rank k's segment
        send.view(-1)[: flat.numel()] = flat
        self._ordered.append(_Ordered(target=t, handle=all_to_all_async(send, 0, 0, self.group)))

    def _gather(self, pending: _Ordered) -> None:
        assert self.group is not None
        pieces = pending.handle.wait()  # row r: rank r's values of this rank's segment
        total = pieces[0].clone()
        for r in range(1, self.size):
            total += pieces[r]
        pending.handle = all_gather_async(total, 0, self.group)
        pending.phase = 2

    def drain(self) -> None:
        """Wait until every submitted all-reduce has finished and written its tensor."""
        for work in self._native:
            work.wait()
        self._native.clear()
        for pending in self._ordered:
            if pending.phase == 1:
                self._gather(pending)
        for pending in self._ordered:
            flat = pending.target.view(-1)
            flat.copy_(pending.handle.wait()[: flat.numel()])
        self._ordered.clear()


def _pieces(x: Tensor, chunks: int) -> int:
    return min(check_chunks(chunks), max(x.shape[0], 1)) if x.dim() > 1 else 1


def chunked_linear_reduce(
    x: Tensor,
    weight: Tensor,
    group: dist.ProcessGroup | None,
    chunks: int = 1,
    *,
    deterministic: bool = False,
) -> Tensor:
    """``x @ weight.T`` summed over ``group``, in ``chunks`` pieces of dim 0 whose all-reduces overlap.

    ``x`` is ``[batch, ..., in]`` and ``weight`` ``[out, in]``; returns ``[batch, ..., out]``. With no group
    (or a group of one) this is a plain (chunked) GEMM.
    """
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    stream = AllReduceStream(group, ordered=deterministic)
    n = _pieces(x, chunks)
    for x_k, out_k in zip(x.tensor_split(n, 0), out.tensor_split(n, 0), strict=True):
        torch.matmul(x_k, weight.t(), out=out_k)
        stream.submit(out_k)  # chunk k communicates while chunk k+1 computes
    stream.drain()
    return out


def linear_backward_overlapped(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    group: dist.ProcessGroup | None,
    chunks: int = 1,
    *,
    deterministic: bool = False,
    need_input: bool = True,
    need_weight: bool = True,
    need_bias: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``y = x @ weight.T (+ bias)``: (grad_x summed over ``group``, grad_weight, grad_bias).

    The grad-input all-reduces are launched chunk by chunk and the grad-weight GEMM runs while they are
    in flight.
    """
    grad_out = grad_out.contiguous()
    stream = AllReduceStream(group, ordered=deterministic)
    grad_x = None
    if need_input:
        grad_x = x.new_empty(x.shape)
        n = _pieces(x, chunks)
        for g_k, gx_k in zip(grad_out.tensor_split(n, 0), grad_x.tensor_split(n, 0), strict=True):
            torch.matmul(g_k, weight, out=gx_k)
            stream.submit(gx_k)
    grad_w = grad_b = None
    flat_g = grad_out.reshape(-1, grad_out.shape[-1])
    if need_weight:  # overlaps the grad-input all-reduces still in flight
        grad_w = flat_g.t() @ x.reshape(-1, x.shape[-1])
    if need_bias:
        grad_b = flat_g.sum(0)
    stream.drain()
    return grad_x, grad_w, grad_b
