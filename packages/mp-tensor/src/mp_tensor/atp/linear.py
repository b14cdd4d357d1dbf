"""``ATPLinear``: row-first and column-first tensor parallelism of ``Y = XW`` on ``DeviceMesh(d1, d2)``.

Specs are the paper's (§3.2, Figure 5), for ``W`` as ``[in, out]`` (``Y = XW``):

=============  =========================  =========================  =========================
strategy       ``W``                      input ``X``                output ``Y``
=============  =========================  =========================  =========================
column-first   ``[Shard(1), Shard(0)]``   ``[Replicate, Shard(-1)]`` ``[Shard(-1), Replicate]``
row-first      ``[Shard(0), Shard(1)]``   ``[Shard(-1), Replicate]`` ``[Replicate, Shard(-1)]``
=============  =========================  =========================  =========================

Each rank multiplies its piece of ``X`` by its ``[in/d_a, out/d_b]`` block of ``W``, which gives a
piece of ``Y`` that is partial over one axis; a grouped all-reduce on that axis finishes it: axis 2
(``d2`` ranks, ``[b, out/d1]``) for column-first, axis 1 (``d1`` ranks, ``[b, out/d2]``) for row-first.
Backward all-reduces the input gradient on the other axis (the conjugate operator), overlapped with the
weight-gradient GEMM; forward can be chunked over the batch (:mod:`mp_tensor.atp.overlap`). On
``DeviceMesh(N, 1)`` column-first is Megatron's column-parallel linear and row-first its row-parallel one.
The input and output are the rank's local pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mp_tensor.atp.distributed import get_mesh
from mp_tensor.atp.errors import ShardingError
from mp_tensor.atp.mesh import DeviceMesh
from mp_tensor.atp.overlap import check_chunks, chunked_linear_reduce, linear_backward_overlapped
from mp_tensor.atp.spec import Placement, Replicate, Shard, distribute, normalize_spec, to_global

__all__ = ["COLUMN_FIRST", "ROW_FIRST", "ATPLinear", "Strategy", "strategy_of"]

#: ``W``'s spec for column-first tensor parallelism (Figure 5, right).
COLUMN_FIRST: tuple[Placement, Placement] = (Shard(1), Shard(0))
#: ``W``'s spec for row-first tensor parallelism (Figure 5, left).
ROW_FIRST: tuple[Placement, Placement] = (Shard(0), Shard(1))

Strategy = Literal["column", "row"]


def strategy_of(spec: Sequence[Placement]) -> Strategy:
    """``"column"`` for ``[Shard(1), Shard(0)]``, ``"row"`` for ``[Shard(0), Shard(1)]``; else an error."""
    placements = normalize_spec(spec, 2, 2)
    if placements == COLUMN_FIRST:
        return "column"
    if placements == ROW_FIRST:
        return "row"
    raise ShardingError(
        f"ATPLinear weight spec {list(spec)} is neither column-first [Shard(1), Shard(0)] nor row-first "
        "[Shard(0), Shard(1)]; pass one of these two (specs are for W as [in, out])."
    )


@dataclass(frozen=True, eq=False)
class _Plan:
    forward_group: dist.ProcessGroup  # all-reduce of the output
    backward_group: dist.ProcessGroup  # all-reduce of the input gradient
    chunks: int
    deterministic: bool


class _ATPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, plan: _Plan) -> Tensor:
        ctx.plan = plan
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        y = chunked_linear_reduce(
            x, weight, plan.forward_group, plan.chunks, deterministic=plan.deterministic
        )
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grad_x, grad_w, grad_b = linear_backward_overlapped(
            grad,
            x,
            weight,
            plan.backward_group,
            plan.chunks,
            deterministic=plan.deterministic,
            need_input=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.has_bias and ctx.needs_input_grad[2],
        )
        return grad_x, grad_w, grad_b, None


class ATPLinear(nn.Module):
    """A linear layer sharded over a 2-D device mesh, row-first or column-first (the paper's ``ATPLinear``).

    ``shard_strategy`` is ``W``'s spec with ``W`` as ``[in_features, out_features]``: ``[Shard(1),
    Shard(0)]`` (column-first) or ``[Shard(0), Shard(1)]`` (row-first). The forward takes and returns
    the rank's local pieces (see the table in this module's docstring). Parameters are initialized as
    ``nn.Linear``'s, from the global tensors drawn with torch's default generator: every rank must have
    seeded it alike, and then the pieces are those of ``nn.Linear(in_features, out_features)`` built
    after the same seed. ``chunks`` splits the batch for overlap (1 is off); ``deterministic`` sums
    in rank order, so that every chunk count gives bitwise the same result
    (:mod:`mp_tensor.atp.overlap`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        shard_strategy: Sequence[Placement],
        bias: bool = True,
        *,
        mesh: DeviceMesh | None = None,
        chunks: int = 1,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh = get_mesh(mesh)
        self.deterministic = deterministic
        if self.mesh.ndim != 2:
            raise ShardingError(
                f"ATPLinear needs a 2-D mesh, got shape {self.mesh.shape}; use DeviceMesh(N, 1) for 1-D."
            )
        self.in_features, self.out_features = in_features, out_features
        self.strategy: Strategy = strategy_of(shard_strategy)
        self.chunks = check_chunks(chunks)
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear.reset_parameters, in its order
        full_bias = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            full_bias = torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound)
        self.weight = nn.Parameter(distribute(weight, self.weight_spec, self.mesh).clone())
        self.bias = (
            nn.Parameter(distribute(full_bias, self.bias_spec, self.mesh).clone())
            if full_bias is not None
            else None
        )

    # ------------------------------------------------------------------------------------ specs

    @property
    def weight_spec(self) -> tuple[Placement, Placement]:
        """The spec of ``self.weight``, which is stored ``[out, in]`` as in ``nn.Linear``."""
        return (Shard(0), Shard(1)) if self.strategy == "column" else (Shard(1), Shard(0))

    @property
    def bias_spec(self) -> tuple[Placement, Placement]:
        """The spec of ``self.bias``: it follows the output's feature dim."""
        return (Shard(0), Replicate()) if self.strategy == "column" else (Replicate(), Shard(0))

    @property
    def input_spec(self) -> tuple[Placement, Placement]:
        """The spec of the input this layer takes."""
        return (Replicate(), Shard(-1)) if self.strategy == "column" else (Shard(-1), Replicate())

    @property
    def output_spec(self) -> tuple[Placement, Placement]:
        """The spec of the output this layer returns."""
        return (Shard(-1), Replicate()) if self.strategy == "column" else (Replicate(), Shard(-1))

    # ---------------------------------------------------------------------------------- forward

    def forward(self, x: Tensor) -> Tensor:
        """``x``: this rank's piece of the input (``input_spec``); returns its piece of the output."""
        expected = self.weight.shape[1]
        if x.shape[-1] != expected:
            raise ShardingError(
                f"ATPLinear({self.in_features}, {self.out_features}, {self.strategy}-first) on mesh "
                f"{self.mesh.shape} takes local inputs whose last dim is {expected}, got shape "
                f"{tuple(x.shape)}; pass this rank's piece of the input (spec {list(self.input_spec)})."
            )
        column = self.strategy == "column"
        plan = _Plan(
            forward_group=self.mesh.group(1 if column else 0),
            backward_group=self.mesh.group(0 if column else 1),
            chunks=self.chunks,
            deterministic=self.deterministic,
        )
        out: Tensor = _ATPLinearFunction.apply(x, self.weight, self.bias, plan)  # type: ignore[no-untyped-call]
        return out

    # ---------------------------------------------------------------------------- global views

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        shard_strategy: Sequence[Placement],
        *,
        mesh: DeviceMesh | None = None,
        chunks: int = 1,
        deterministic: bool = False,
    ) -> ATPLinear:
        """An ``ATPLinear`` holding this rank's pieces of ``linear``'s parameters (same on every rank)."""
        module = cls(
            linear.in_features,
            linear.out_features,
            shard_strategy,
            bias=linear.bias is not None,
            mesh=mesh,
            chunks=chunks,
            deterministic=deterministic,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        module.load_global(linear.weight, linear.bias)
        return module

    @torch.no_grad()
    def load_global(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's pieces of the global ``weight`` (``[out, in]``) and ``bias`` into the layer."""
        self.weight.copy_(distribute(weight, self.weight_spec, self.mesh))
        if self.bias is not None and bias is not None:
            self.bias.copy_(distribute(bias, self.bias_spec, self.mesh))

    def global_weight(self) -> Tensor:
        """The whole ``[out, in]`` weight, gathered from the mesh (collective)."""
        return to_global(self.weight, self.weight_spec, self.mesh)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"strategy={self.strategy}-first, mesh={self.mesh.shape}, local={tuple(self.weight.shape)}, "
            f"bias={self.bias is not None}, chunks={self.chunks}, deterministic={self.deterministic}"
        )
