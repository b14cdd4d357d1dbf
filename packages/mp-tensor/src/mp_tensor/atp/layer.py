"""The ATP transformer layer (§3.2.1, Figure 6) and the single-device layer it reproduces.

:class:`TransformerLayer` is a plain pre-LayerNorm GPT block on one device. :class:`ATPTransformerLayer`
runs the same computation on ``DeviceMesh(d1, d2)``:

* the layer's input and output are ``[Replicate, Shard(-1)]``: ``[b, s, h/d2]`` on every rank;
* attention: LayerNorm, column-first QKV linear (*f1*), the heads scattered over axis 2 so the attention
  core is fully sharded (``a/(d1*d2)`` heads per rank), gathered back, row-first output linear (*f2*);
* MLP: LayerNorm, column-first first linear (*f3*), GeLU, row-first second linear (*f4*).

*f1, f3* all-reduce over axis 2 in forward and axis 1 in backward; *f2, f4* the reverse (both live
inside :class:`ATPLinear`). The LayerNorms see ``h/d2`` features each and all-reduce their two
moments over axis 2 (a ``[b, s, 1]`` tensor each), as smp's memory-optimized layer norm does. On
``DeviceMesh(N, 1)`` this is Megatron-LM's layer exactly: replicated activations, whole LayerNorms,
one all-reduce per block in each direction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_comm.collectives import all_gather, all_reduce, split
from mp_tensor.atp.distributed import get_mesh
from mp_tensor.atp.errors import ShardingError
from mp_tensor.atp.linear import COLUMN_FIRST, ROW_FIRST, ATPLinear
from mp_tensor.atp.mesh import DeviceMesh
from mp_tensor.atp.overlap import check_chunks
from mp_tensor.atp.spec import Placement, Replicate, Shard, distribute

__all__ = ["ATPLayerNorm", "ATPTransformerLayer", "TransformerLayer", "attention_core"]

#: The spec of the layer's input and output activations.
ACTIVATION_SPEC: tuple[Placement, Placement] = (Replicate(), Shard(-1))


def attention_core(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
    """Scaled dot-product attention on ``[b, s, heads, d]`` tensors; returns ``[b, s, heads, d]``."""
    out: Tensor = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


class TransformerLayer(nn.Module):
    """A pre-LayerNorm GPT transformer layer on one device: the reference for :class:`ATPTransformerLayer`."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn_hidden: int | None = None,
        *,
        causal: bool = True,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if hidden % heads:
            raise ShardingError(
                f"hidden={hidden} is not a multiple of heads={heads}; pick sizes that divide."
            )
        ffn = 4 * hidden if ffn_hidden is None else ffn_hidden
        kw = {"device": device, "dtype": dtype}
        self.hidden, self.heads, self.ffn_hidden, self.causal = hidden, heads, ffn, causal
        self.ln1 = nn.LayerNorm(hidden, eps=eps, **kw)  # type: ignore[arg-type]
        self.qkv = nn.Linear(hidden, 3 * hidden, **kw)  # type: ignore[arg-type]
        self.proj = nn.Linear(hidden, hidden, **kw)  # type: ignore[arg-type]
        self.ln2 = nn.LayerNorm(hidden, eps=eps, **kw)  # type: ignore[arg-type]
        self.fc1 = nn.Linear(hidden, ffn, **kw)  # type: ignore[arg-type]
        self.fc2 = nn.Linear(ffn, hidden, **kw)  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[b, s, hidden]``."""
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        x = x + self.proj(attention_core(q, k, v, causal=self.causal).reshape(b, s, h))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class ATPLayerNorm(nn.Module):
    """LayerNorm over a hidden dim sharded on mesh axis 2 (``[Replicate, Shard(-1)]`` activations).

    Mean and variance are summed over axis 2 (two-pass); their backward sums too, since every rank's
    piece of the output depends on them.
    """

    def __init__(
        self,
        hidden: int,
        *,
        mesh: DeviceMesh | None = None,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh = get_mesh(mesh)
        self.hidden, self.eps = hidden, eps
        local = hidden // self.mesh.shape[1]
        if local * self.mesh.shape[1] != hidden:
            raise ShardingError(
                f"ATPLayerNorm: hidden={hidden} is not divisible by the mesh's second axis "
                f"{self.mesh.shape[1]} (mesh {self.mesh.shape}); pick a mesh whose d2 divides it."
            )
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[..., hidden/d2]``, this rank's piece."""
        if self.mesh.shape[1] == 1:
            out: Tensor = F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)
            return out
        group = self.mesh.group(1)
        mean = all_reduce(x.sum(-1, keepdim=True), group, grad="all_reduce") / self.hidden
        centered = x - mean
        var = all_reduce((centered * centered).sum(-1, keepdim=True), group, grad="all_reduce") / self.hidden
        return centered * torch.rsqrt(var + self.eps) * self.weight + self.bias


class ATPTransformerLayer(nn.Module):
    """:class:`TransformerLayer` with row- and column-first tensor parallelism on ``DeviceMesh(d1, d2)``.

    Takes and returns ``[b, s, hidden/d2]`` pieces (``[Replicate, Shard(-1)]``). Needs ``heads`` divisible
    by ``d1 * d2`` and ``hidden``, ``ffn_hidden`` divisible by ``d1`` and ``d2``. Build it from a reference
    layer with :meth:`from_reference` to hold that layer's weights. ``chunks`` and ``deterministic`` go to
    every linear (:class:`ATPLinear`).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn_hidden: int | None = None,
        *,
        mesh: DeviceMesh | None = None,
        causal: bool = True,
        eps: float = 1e-5,
        chunks: int = 1,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh = get_mesh(mesh)
        d1, d2 = self.mesh.shape
        ffn = 4 * hidden if ffn_hidden is None else ffn_hidden
        if heads % (d1 * d2) or hidden % heads:
            raise ShardingError(
                f"ATPTransformerLayer: heads={heads} must be divisible by d1*d2={d1 * d2} (mesh "
                f"{self.mesh.shape}) and divide hidden={hidden}; pick a mesh or head count that fits."
            )
        self.hidden, self.heads, self.ffn_hidden, self.causal = hidden, heads, ffn, causal
        kw = {"mesh": self.mesh, "device": device, "dtype": dtype}
        lin = {**kw, "deterministic": deterministic}
        self.ln1 = ATPLayerNorm(hidden, eps=eps, **kw)  # type: ignore[arg-type]
        self.qkv = ATPLinear(hidden, 3 * hidden, COLUMN_FIRST, **lin)  # type: ignore[arg-type]  # f1
        self.proj = ATPLinear(hidden, hidden, ROW_FIRST, **lin)  # type: ignore[arg-type]  # f2
        self.ln2 = ATPLayerNorm(hidden, eps=eps, **kw)  # type: ignore[arg-type]
        self.fc1 = ATPLinear(hidden, ffn, COLUMN_FIRST, **lin)  # type: ignore[arg-type]  # f3
        self.fc2 = ATPLinear(ffn, hidden, ROW_FIRST, **lin)  # type: ignore[arg-type]  # f4
        self.chunks = chunks

    @property
    def chunks(self) -> int:
        """Batch chunks for compute/communication overlap in every linear (1: no overlap)."""
        return self.qkv.chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        check_chunks(value)
        for linear in (self.qkv, self.proj, self.fc1, self.fc2):
            linear.chunks = value

    def forward(self, x: Tensor) -> Tensor:
        """``x``: this rank's ``[b, s, hidden/d2]`` piece; returns the output's piece, same spec."""
        d1 = self.mesh.shape[0]
        b, s, _ = x.shape
        head_dim = self.hidden // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads // d1, 3, head_dim)  # whole heads per d1 block
        qkv = split(qkv, 2, self.mesh.group(1))  # scatter: the attention core is fully sharded
        q, k, v = qkv.unbind(3)
        context = all_gather(attention_core(q, k, v, causal=self.causal), 2, self.mesh.group(1))  # gather
        x = x + self.proj(context.reshape(b, s, self.hidden // d1))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out

    # ---------------------------------------------------------------------------- reference

    def shard_reference(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's pieces of a :class:`TransformerLayer`'s named tensors (parameters or their grads).

        The names are the reference's, and also this layer's: ``qkv.weight``, ``ln1.bias``, ... The QKV
        rows are regrouped head by head first, so each column-first block holds whole heads.
        """
        out = {}
        for name, tensor in tensors.items():
            module_name, _, kind = name.rpartition(".")
            module = self.get_submodule(module_name)
            t = self._heads_major(tensor) if module_name == "qkv" else tensor
            if isinstance(module, ATPLinear):
                spec = module.weight_spec if kind == "weight" else module.bias_spec
            else:
                spec = (Replicate(), Shard(0))
            out[name] = distribute(t, spec, self.mesh)
        return out

    def _heads_major(self, t: Tensor) -> Tensor:
        """QKV rows ordered (q|k|v, head, d) -> (head, q|k|v, d)."""
        head_dim = self.hidden // self.heads
        rest = t.shape[1:]
        return t.reshape(3, self.heads, head_dim, *rest).transpose(0, 1).reshape(3 * self.hidden, *rest)

    @torch.no_grad()
    def load_reference(self, reference: TransformerLayer) -> None:
        """Copy this rank's pieces of ``reference``'s parameters into the layer."""
        pieces = self.shard_reference(dict(reference.named_parameters()))
        for name, p in self.named_parameters():
            p.copy_(pieces[name])

    @classmethod
    def from_reference(
        cls,
        reference: TransformerLayer,
        *,
        mesh: DeviceMesh | None = None,
        chunks: int = 1,
        deterministic: bool = False,
    ) -> ATPTransformerLayer:
        """An ATP layer holding this rank's pieces of ``reference`` (the same on every rank)."""
        p = reference.qkv.weight
        layer = cls(
            reference.hidden,
            reference.heads,
            reference.ffn_hidden,
            mesh=mesh,
            causal=reference.causal,
            eps=reference.ln1.eps,
            chunks=chunks,
            deterministic=deterministic,
            device=p.device,
            dtype=p.dtype,
        )
        layer.load_reference(reference)
        return layer

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, heads={self.heads}, ffn_hidden={self.ffn_hidden}, "
            f"mesh={self.mesh.shape}, heads_per_rank={self.heads // math.prod(self.mesh.shape)}, "
            f"chunks={self.chunks}"
        )
