"""Memory mode's reduce-scattered linear maps (mp_tensor.nn.rank_major): equal to the unsplit maps in
outputs and gradients, one collective for several outputs, and that collective on contiguous rank blocks
(dimension 0 of a contiguous ``[T, ...]`` buffer: no transposing copy, no strided datatype)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_comm import collectives as col
from mp_tensor.nn.rank_major import linear_reduce_scatter
from tests.mp_tensor._tp_probe import count_collectives, tally
from tests.mp_tensor._tp_util import with_group

IN = 16


def _case(world: Any) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        gen = torch.Generator().manual_seed(3)
        xa = torch.randn(2, 5, IN, generator=gen, requires_grad=True)  # q, k, v's input
        xb = torch.randn(3, IN, generator=gen, requires_grad=True)  # another token count
        xc = torch.randn(3, IN, generator=gen, requires_grad=True)  # added to xb's output
        ws = [torch.randn(o, IN, generator=gen, requires_grad=True) for o in (12, 12, 6, 4, 4)]
        pairs_full = [(xa, ws[0]), (xa, ws[1]), (xa, ws[2]), (xb, ws[3]), (xc, ws[4])]
        outputs = [0, 1, 2, 3, 3]
        ups = [torch.randn(2, 5, 12, generator=gen), torch.randn(2, 5, 12, generator=gen)]
        ups += [torch.randn(2, 5, 6, generator=gen), torch.randn(3, 4, generator=gen)]
        # reference: the unsplit maps, every output's objective over all its channels
        refs = [F.linear(xa, ws[0]), F.linear(xa, ws[1]), F.linear(xa, ws[2])]
        refs.append(F.linear(xb, ws[3]) + F.linear(xc, ws[4]))
        sum((r * u).sum() for r, u in zip(refs, ups, strict=True)).backward()
        want = {"x": [t.grad.clone() for t in (xa, xb, xc)], "w": [w.grad.clone() for w in ws]}
        # this rank: its input channels and its columns of each weight
        cols = slice(rank * IN // n, (rank + 1) * IN // n)
        local_x = {id(t): t.detach()[..., cols].clone().requires_grad_() for t in (xa, xb, xc)}
        local_w = [w.detach()[:, cols].clone().requires_grad_() for w in ws]
        pairs = [(local_x[id(x)], lw) for (x, _), lw in zip(pairs_full, local_w, strict=True)]
        seen: list[tuple[int, bool, tuple[int, ...]]] = []
        plain = col.reduce_scatter

        def spy(x: torch.Tensor, dim: int, g: Any) -> torch.Tensor:
            seen.append((dim, x.is_contiguous(), tuple(x.shape)))
            return plain(x, dim, g)

        col.reduce_scatter = spy  # type: ignore[assignment]
        try:
            with count_collectives() as fwd:
                got = linear_reduce_scatter(pairs, group, outputs)
        finally:
            col.reduce_scatter = plain  # type: ignore[assignment]
        mine = [_own(r, rank, n) for r in refs]
        with count_collectives() as bwd:
            sum((g * _own(u, rank, n)).sum() for g, u in zip(got, ups, strict=True)).backward()
        # under autocast: the operands cast as F.linear's are (bfloat16 on CPU), the output in that dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (auto,) = linear_reduce_scatter([(local_x[id(xa)], local_w[0])], group)
        return {
            "autocast": (auto.dtype, (auto.float() - mine[0]).abs().max().item()),
            "out": max((g - m).abs().max().item() for g, m in zip(got, mine, strict=True)),
            "shapes": [tuple(g.shape) for g in got],
            "x": max(
                (local_x[id(t)].grad - w[..., cols]).abs().max().item()  # type: ignore[operator]
                for t, w in zip((xa, xb, xc), want["x"], strict=True)
            ),
            "w": max(
                (lw.grad - w[:, cols]).abs().max().item()  # type: ignore[operator]
                for lw, w in zip(local_w, want["w"], strict=True)
            ),
            "fwd": tally(fwd),
            "bwd": tally(bwd),
            "seen": seen,
        }

    return with_group(run)  # type: ignore[no-any-return]


def _own(u: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    width = u.shape[-1] // n
    return u[..., rank * width : (rank + 1) * width]


def test_rank_major_linears_equal_the_unsplit_maps(worlds: Any) -> None:
    for rank, res in enumerate(worlds.run(2, _case, timeout=120)):
        assert res["shapes"] == [(2, 5, 6), (2, 5, 6), (2, 5, 3), (3, 2)], res
        assert res["out"] < 1e-5 and res["x"] < 1e-5 and res["w"] < 1e-5, (rank, res)
        assert res["autocast"][0] == torch.bfloat16 and res["autocast"][1] < 0.1, res
        assert res["fwd"] == {"reduce_scatter": 1}, res  # four outputs, one collective
        assert res["bwd"] == {"all_gather": 1}, res
        total = 2 * 5 * 6 + 2 * 5 * 6 + 2 * 5 * 3 + 3 * 2  # this rank's share of every output
        assert res["seen"] == [(0, True, (2, total))], res
