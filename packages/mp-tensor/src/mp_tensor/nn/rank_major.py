"""Linear maps split over their input channels whose outputs are reduce-scattered over the output
channels ("memory" mode, docs/tensor.md), computed rank-major.

Each rank multiplies its input channels by its columns of ``W``, which gives a partial sum of the whole
output ``[tokens, out]``; a reduce-scatter over the output channels sums the parts and hands rank j its
slice j. Computed as ``F.linear`` then reduce-scattered along the last dimension, rank j's slice is a
strided block, so every collective paid a transposing copy (forward) or a strided MPI datatype (the
backward all-gather). Here the partial output is written rank-major, ``[T, tokens, out/T]``: one GEMM
per rank block of ``W``'s rows, into a contiguous block each, so the reduce-scatter and its backward
all-gather run on dimension 0 over contiguous blocks, and the backward GEMMs read the gathered gradient
in place. Several outputs (query, key and value) share one buffer and one collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mp_comm import collectives as col

__all__ = ["linear_reduce_scatter"]


class _RankMajorLinear(torch.autograd.Function):
    """``(x_k, W_k)`` pairs -> ``[T, total]``: for each rank block t, output i's segment is the sum over
    its pairs of ``x_k @ W_k[t-th rows]^T`` (``[tokens_i, out_i/T]``, contiguous)."""

    @staticmethod
    def forward(ctx: Any, n: int, outputs: tuple[int, ...], *tensors: Tensor) -> Tensor:
        xs, ws = tensors[0::2], tensors[1::2]
        sizes, starts = _segments(xs, ws, outputs, n)
        x0 = xs[0]
        buf = x0.new_empty((n, sum(sizes)), dtype=torch.result_type(x0, ws[0]))
        for t in range(n):
            done: set[int] = set()
            for x, w, i in zip(xs, ws, outputs, strict=True):
                width = w.shape[0] // n
                seg = buf[t].narrow(0, starts[i], sizes[i]).view(-1, width)
                block = w.narrow(0, t * width, width)
                x2 = x.reshape(-1, x.shape[-1])
                if i in done:
                    seg.addmm_(x2, block.t())
                else:
                    torch.mm(x2, block.t(), out=seg)
                    done.add(i)
        ctx.save_for_backward(*tensors)
        ctx.n, ctx.outputs, ctx.starts, ctx.sizes = n, outputs, starts, sizes
        return buf

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        tensors = ctx.saved_tensors
        n, outputs, starts, sizes = ctx.n, ctx.outputs, ctx.starts, ctx.sizes
        g = grad.contiguous()
        out: list[Tensor | None] = [None, None]
        for k, i in enumerate(outputs):
            x, w = tensors[2 * k], tensors[2 * k + 1]
            width = w.shape[0] // n
            x2 = x.reshape(-1, x.shape[-1])
            gx: Tensor | None = None
            gw: Tensor | None = None
            need_x, need_w = ctx.needs_input_grad[2 + 2 * k], ctx.needs_input_grad[3 + 2 * k]
            if need_w:
                gw = torch.empty_like(w)
            for t in range(n):
                gt = g[t].narrow(0, starts[i], sizes[i]).view(-1, width)
                block = w.narrow(0, t * width, width)
                if need_x:
                    gx = torch.mm(gt, block) if gx is None else gx.addmm_(gt, block)
                if gw is not None:
                    torch.mm(gt.t(), x2, out=gw.narrow(0, t * width, width))
            out += [None if gx is None else gx.view(x.shape), gw]
        return tuple(out)


def _segments(
    xs: Sequence[Tensor], ws: Sequence[Tensor], outputs: Sequence[int], n: int
) -> tuple[list[int], list[int]]:
    """Per output: its segment's length in a rank block (tokens x out/T) and its start."""
    count = max(outputs) + 1
    sizes = [0] * count
    for x, w, i in zip(xs, ws, outputs, strict=True):
        size = math.prod(x.shape[:-1]) * (w.shape[0] // n)
        if sizes[i] not in (0, size):
            raise ValueError(f"linear_reduce_scatter: the pairs of output {i} disagree in shape")
        sizes[i] = size
    starts = [sum(sizes[:i]) for i in range(count)]
    return sizes, starts


def linear_reduce_scatter(
    pairs: Sequence[tuple[Tensor, Tensor]],
    group: dist.ProcessGroup | None,
    outputs: Sequence[int] | None = None,
) -> list[Tensor]:
    """This rank's output channels of ``sum_k F.linear(x_k, W_k)`` over the TP group.

    ``pairs``: ``(x [..., in/T], W [out, in/T])``, this rank's input channels and its columns of each
    weight. ``outputs[k]``: which output pair k adds to (default: one output per pair); pairs of one output
    have the same leading shape and ``out``. Returns one tensor ``[..., out/T]`` per output, in order,
    each holding output channels ``[j*out/T, (j+1)*out/T)`` on tp rank j, summed over the group; one
    reduce-scatter serves them all. ``group`` None: the plain sums (one rank).
    """
    index = list(range(len(pairs))) if outputs is None else list(outputs)
    if group is None or dist.get_world_size(group) == 1:
        sums: dict[int, Tensor] = {}
        for (x, w), i in zip(pairs, index, strict=True):
            y = F.linear(x, w)
            sums[i] = y if i not in sums else sums[i] + y
        return [sums[i] for i in range(len(sums))]
    n = dist.get_world_size(group)
    flat = [t for pair in pairs for t in pair]
    device = flat[0].device.type
    # cast as autocast casts F.linear's operands (GEMMs write in place); meta (mp-plan's traces) has none
    if device != "meta" and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        flat = [t.to(dtype) for t in flat]
        with torch.autocast(device, enabled=False):
            buf: Tensor = _RankMajorLinear.apply(n, tuple(index), *flat)  # type: ignore[no-untyped-call]
    else:
        buf = _RankMajorLinear.apply(n, tuple(index), *flat)  # type: ignore[no-untyped-call]
    mine = col.reduce_scatter(buf, 0, group).view(-1)
    sizes, _ = _segments(flat[0::2], flat[1::2], index, n)
    shapes: dict[int, tuple[int, ...]] = {}
    for (x, w), i in zip(pairs, index, strict=True):
        shapes[i] = (*x.shape[:-1], w.shape[0] // n)
    return [part.view(shapes[i]) for i, part in enumerate(torch.split(mine, sizes))]
