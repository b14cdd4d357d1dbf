"""``DistributedAttentionLayer``: the attention block in its two distributions (docs/tensor.md).

``optimize="speed"`` (Megatron-style): activations are ``replicated``; query/key/value are
split over their output channels (whole heads per rank) behind a backward all-reduce, the output
projection over its input channels followed by one forward all-reduce; layer norm is replicated.

``optimize="memory"``: activations are ``sharded`` by channels; every linear map is split
over its input channels and followed by a reduce-scatter over its output channels (query, key and value
share one), so rank j ends up with the heads (or hidden channels) of slice j; layer norm is distributed
(:func:`sharded_layer_norm`). No activation is replicated.

``forward`` takes and returns the ``local`` layout; the transformer modules call :meth:`forward_layout`
directly on the working layout so that only the outermost module exchanges samples.

The residual connection is added whether or not ``post_layernorm`` is set (smp's reference listing returns
the attention output without it when ``post_layernorm`` is False, which leaves no way to express a
pre-layernorm transformer such as GPT-2; :mod:`mp_tensor.reference` does the same as this module).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import Layout, enter, gather_samples, leave, tp_dropout
from mp_tensor.errors import TPInputError
from mp_tensor.nn.args import TransformerArgs
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.layernorm import LayerNormShard
from mp_tensor.nn.linear import LinearShard
from mp_tensor.nn.positions import alibi_bias, alibi_slopes, apply_rotary, keep_mask, rotary_tables
from mp_tensor.nn.rank_major import linear_reduce_scatter

__all__ = ["DistributedAttentionLayer", "attend", "working_layout"]


def working_layout(ctx: TPContext) -> Layout:
    """The layout transformer modules compute in: ``sharded`` for "memory", ``replicated`` for "speed"."""
    return "sharded" if ctx.optimize == "memory" else "replicated"


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    heads: int,
    head_size: int,
    mask: Tensor | None,
    causal_size: int | None,
    mask_value: float,
    dropout: Any,
    fused: bool = False,
    fp32: bool = False,
    scale: bool = True,
    window: int | None = None,
    slopes: Tensor | None = None,
) -> Tensor:
    """Scaled dot-product attention of ``heads`` heads; ``q [N,Sq,heads*d]``, ``k, v [N,Sk,heads*d]``.

    ``fused`` (smp's ``fused_softmax``; pass it only when ``dropout`` is the identity, since the
    attention dropout must draw from the TP group's random state) runs torch's fused
    ``scaled_dot_product_attention`` with the causal and padding masks as one additive bias. ``fp32``:
    scores, softmax and context in fp32, the result cast back to ``q``'s dtype. ``scale``: divide the
    scores by sqrt(head_size); ``window``: sliding-window causal mask; ``slopes``: the ALiBi slopes of
    these heads (:mod:`mp_tensor.nn.positions`).
    """
    if fp32 and q.dtype != torch.float32:
        out = attend(
            q.float(),
            k.float(),
            v.float(),
            heads=heads,
            head_size=head_size,
            mask=None if mask is None else mask.float(),
            causal_size=causal_size,
            mask_value=mask_value,
            dropout=dropout,
            fused=fused,
            scale=scale,
            window=window,
            slopes=slopes,
        )
        return out.to(q.dtype)
    n, sq = q.shape[0], q.shape[1]
    sk = k.shape[1]
    qh = q.reshape(n, sq, heads, head_size).permute(0, 2, 1, 3)
    kh = k.reshape(n, sk, heads, head_size).permute(0, 2, 3, 1)
    vh = v.reshape(n, sk, heads, head_size).permute(0, 2, 1, 3)
    keep = None
    if causal_size is not None:
        if max(sq, sk) > causal_size:
            raise TPInputError(
                f"the attention got sequence length {max(sq, sk)}, longer than "
                f"causal_mask_size={causal_size}; pass shorter sequences or a larger causal_mask_size."
            )
        keep = keep_mask(sq, sk, window, q.device)
    alibi = None if slopes is None else alibi_bias(slopes.to(q.device), sq, sk, q.dtype)
    if fused:
        bias = mask
        if keep is not None:
            causal = torch.zeros(sq, sk, dtype=q.dtype, device=q.device).masked_fill(~keep, mask_value)
            bias = causal if bias is None else bias + causal
        if alibi is not None:
            bias = alibi if bias is None else bias + alibi
        out = F.scaled_dot_product_attention(
            qh, kh.transpose(-1, -2), vh, attn_mask=bias, scale=None if scale else 1.0
        )
        return out.permute(0, 2, 1, 3).reshape(n, sq, heads * head_size)
    scores = torch.matmul(qh, kh)
    if scale:
        scores = scores / math.sqrt(head_size)
    if alibi is not None:
        scores = scores + alibi
    if keep is not None:
        scores = torch.where(keep, scores, torch.full_like(scores, mask_value))
    if mask is not None:
        scores = scores + mask
    probs = dropout(F.softmax(scores, dim=-1))
    context = torch.matmul(probs, vh).permute(0, 2, 1, 3)
    return context.reshape(n, sq, heads * head_size)


class DistributedAttentionLayer(DistributedModule):
    """Tensor-parallel attention block; functionally :class:`mp_tensor.reference.AttentionLayer`."""

    def __init__(  # noqa: PLR0917
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        cross_attention: bool = False,
        causal_mask_size: int | None = None,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        tp: TPContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tp=tp)
        values = dict(kwargs)
        values.update(
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            hidden_size=hidden_size,
            attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            cross_attention=cross_attention,
            causal_mask_size=causal_mask_size,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
        )
        values.pop("intermediate_size", None)
        self.args = a = TransformerArgs.parse(type(self).__name__, self.tp_size, values)
        memory = self.tp.optimize == "memory"
        h, all_heads = a.hidden_size, a.all_head_size
        init = {"use_normal": a.use_normal_initialization, "initializer_range": a.initializer_range}
        if memory:  # every linear map split over its input channels, bias on the reduce-scattered output
            qkv_split, dense_bias_split = {"weight_split": 1, "bias_split": 0}, 0
        else:  # query/key/value by output channels (heads), output projection by input channels
            qkv_split, dense_bias_split = {"weight_split": 0, "bias_split": 0}, None
        qkv = {**qkv_split, **init, "bias": a.use_qkv_bias}
        self.query = LinearShard(self.tp, all_heads, h, **qkv)  # type: ignore[arg-type]
        self.key = LinearShard(self.tp, all_heads, h, **qkv)  # type: ignore[arg-type]
        self.value = LinearShard(self.tp, all_heads, h, **qkv)  # type: ignore[arg-type]
        self.dense = LinearShard(
            self.tp, h, all_heads, weight_split=1, bias_split=dense_bias_split, bias=a.use_attn_dense_bias,
            **init,  # type: ignore[arg-type]
        )  # fmt: skip
        if a.pre_layernorm:
            self.pre_layernorm = LayerNormShard(self.tp, h, a.layernorm_epsilon, sharded=memory)
        if a.post_layernorm:
            self.layernorm = LayerNormShard(self.tp, h, a.layernorm_epsilon, sharded=memory)
        self.local_heads = a.num_attention_heads // self.tp_size
        self.layout_io = False  # True inside a DistributedTransformerLayer (see forward)

    # --------------------------------------------------------------------------- working layout
    def _bias(self, x: Tensor, b: Tensor | None) -> Tensor:
        return x if b is None else x + b

    def _project_memory(self, norm: Tensor, cross: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        ctx = self.tp
        group = ctx.group if ctx.distributed else None
        wq, wk, wv = self.query.weight, self.key.weight, self.value.weight
        src = norm if cross is None else cross
        q, k, v = linear_reduce_scatter([(norm, wq), (src, wk), (src, wv)], group)  # one reduce-scatter
        return self._bias(q, self.query.bias), self._bias(k, self.key.bias), self._bias(v, self.value.bias)

    def _project_speed(self, norm: Tensor, cross: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        ctx = self.tp
        x = norm if ctx.group is None or not ctx.distributed else col.all_reduce_backward(norm, ctx.group)
        src = x
        if cross is not None:
            src = (
                cross
                if ctx.group is None or not ctx.distributed
                else col.all_reduce_backward(cross, ctx.group)
            )
        q = F.linear(x, self.query.weight, self.query.bias)
        k = F.linear(src, self.key.weight, self.key.bias)
        v = F.linear(src, self.value.weight, self.value.bias)
        return q, k, v

    def forward_layout(self, hidden: Tensor, mask: Tensor | None, cross: Tensor | None = None) -> Tensor:
        """The block on the working layout (see :func:`working_layout`); ``mask`` covers the same samples."""
        a, ctx = self.args, self.tp
        memory = ctx.optimize == "memory"
        norm = self.pre_layernorm.apply_to(hidden, ctx) if a.pre_layernorm else hidden
        if a.cross_attention and cross is None:
            raise TPInputError(f"{type(self).__name__} with cross_attention=True needs cross_states.")
        q, k, v = (self._project_memory if memory else self._project_speed)(norm, cross)

        def drop_probs(p: Tensor) -> Tensor:
            return tp_dropout(p, a.attention_dropout_prob, self.training, ctx, "sharded")

        if a.rotary_dim is not None:
            q, k = self._rotary(q), self._rotary(k)
        context = attend(
            q,
            k,
            v,
            heads=self.local_heads,
            head_size=a.attention_head_size,
            mask=mask,
            causal_size=None if a.cross_attention else a.causal_mask_size,
            mask_value=a.mask_value,
            dropout=drop_probs,
            fused=a.fused_softmax and not (self.training and a.attention_dropout_prob > 0),
            fp32=a.attention_in_fp32 or a.query_key_layer_scaling,
            scale=a.scale_attention_scores,
            window=a.window_size,
            slopes=self._slopes() if a.use_alibi else None,
        )
        if memory:
            group = ctx.group if ctx.distributed else None
            (out,) = linear_reduce_scatter([(context, self.dense.weight)], group)
        else:
            out = F.linear(context, self.dense.weight)
            if ctx.distributed and ctx.group is not None:
                out = col.all_reduce(out, ctx.group)
        out = self._bias(out, self.dense.bias)
        out = tp_dropout(out, a.hidden_dropout_prob, self.training, ctx, working_layout(ctx))
        if not a.parallel_attn_output:  # else the layer adds the residual once for attention and MLP
            out = out + hidden
        return self.layernorm.apply_to(out, ctx) if a.post_layernorm else out

    def _rotary(self, x: Tensor) -> Tensor:
        """Rotary embedding of ``x [N, S, local heads * d]`` (this rank's heads)."""
        a = self.args
        n, s = x.shape[0], x.shape[1]
        assert a.rotary_dim is not None
        cos, sin = rotary_tables(s, a.rotary_dim, a.rotary_emb_base, a.gpt_neox_type_rotary, x.device)
        heads = x.reshape(n, s, self.local_heads, a.attention_head_size)
        return apply_rotary(heads, cos, sin, a.gpt_neox_type_rotary).reshape(x.shape)

    def _slopes(self) -> Tensor:
        """The ALiBi slopes of this rank's heads (heads are split over the ranks in order)."""
        slopes = alibi_slopes(self.args.num_attention_heads, self.args.alibi_bias_max)
        return slopes[self.tp_rank * self.local_heads : (self.tp_rank + 1) * self.local_heads]

    # ------------------------------------------------------------------------------ local layout
    def forward(self, inputs: tuple[Tensor, ...]) -> Tensor:
        """``(hidden_states, attention_mask)``, or ``(hidden_states, cross_states, attention_mask)``, on the
        ``local`` layout, or on the working layout inside a transformer layer (``layout_io``, set by the
        layer: it calls its blocks as modules so that a pipeline can place them on different stages)."""
        if self.args.cross_attention:
            hidden, cross, mask = inputs
        else:
            hidden, mask = inputs
            cross = None
        if self.layout_io:
            return self.forward_layout(hidden, mask, cross)
        layout = working_layout(self.tp)
        name = type(self).__name__
        hs = enter(hidden, self.tp, layout, name)
        cs = None if cross is None else enter(cross, self.tp, layout, name)
        ms = gather_samples(mask, self.tp, hidden.shape[0])
        return leave(self.forward_layout(hs, ms, cs), self.tp, layout)
