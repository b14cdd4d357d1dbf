"""Hugging Face ``T5Block`` (encoder and decoder blocks of T5 and T5 v1.1) ->
:class:`DistributedT5Block`: the whole block distributed in either layout of :mod:`mp_tensor.hf.block`.

- Self-attention (and, in decoder blocks, cross-attention over the encoder's states): q/k/v split by
  whole heads, ``o`` by its input channels; T5's unscaled scores plus the relative position bias.
- The relative position bias: the first block's ``relative_attention_bias`` table is split by heads,
  so each rank computes the bias of its own heads only and hands it to the next blocks (as Hugging
  Face's stack hands the full bias on). Those blocks read this rank's heads out of it; no collective.
- Feed-forward: ``DenseReluDense`` (``wi``/``wo``) or the gated variant of T5 v1.1 (``wi_0``, ``wi_1``,
  ``wo``) with relu, gelu, gelu_new or silu; RMS layer norms (T5LayerNorm).
- Dropout (``dropout_rate``) through :func:`mp_tensor.dist_ops.tp_dropout`: the same mask on every rank
  for replicated activations, its own mask per rank for split ones (heads, ``d_ff`` channels).

Speed mode costs one all-reduce forward per sub-layer (2 per encoder block, 3 per decoder block) and
their mirrors backward, plus one backward all-reduce of the encoder states' gradient for the
cross-attention keys/values of each decoder block. The distributed block keeps Hugging Face's
parameter names: its full state dict is the block's (the translate functions are the identity).

Refused (the block stays Hugging Face's and its Linears are distributed one by one, with a log line):
``num_heads`` or ``d_ff`` not divisible by the TP degree (memory mode: ``d_model`` too), another
``dense_act_fn``. Incremental decoding is refused at call time: a block leaves the key/value cache
Hugging Face hands it empty, and raises when the same cache comes back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.dist_ops import Layout, enter, gather_samples, leave, tp_dropout
from mp_tensor.errors import TPInputError
from mp_tensor.hf.block import MegatronBlock
from mp_tensor.hf.common import GELU_APPROXIMATION, additive, sizes_reason
from mp_tensor.nn.base import DistributedModule, ParamInit, ParamSpec, set_param_init, set_param_spec
from mp_tensor.registry import Registration

__all__ = ["BLOCK", "DistributedT5Block", "activate", "registrations"]

BLOCK = "transformers.models.t5.modeling_t5.T5Block"

ACTIVATIONS = (*GELU_APPROXIMATION, "silu")


def activate(x: Tensor, name: str) -> Tensor:
    """Hugging Face's activation ``name`` (one of :data:`ACTIVATIONS`)."""
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate=GELU_APPROXIMATION[name])


def relative_position_bucket(
    relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """T5's bucket of each relative position (Mesh TensorFlow's scheme, as in Hugging Face)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).to(torch.long) * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    exact = num_buckets // 2
    large = exact + (
        torch.log(relative.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(relative < exact, relative, large)


class _BiasTable(nn.Module):
    """This rank's heads of ``relative_attention_bias.weight [buckets, heads]`` (split by heads)."""

    def __init__(self, block: DistributedT5Block, buckets: int, heads: int) -> None:
        super().__init__()
        full = torch.randn(buckets, heads)  # overwritten by the block's weights when it replaces one
        self.weight = nn.Parameter(block.shard(full, 1).clone().to(block.tp.dtype or full.dtype))
        set_param_spec(self.weight, ParamSpec(1, scaled_batch=True))
        init = ParamInit((buckets, heads), "normal", 1.0, 1, block.tp_rank, block.tp_size)
        set_param_init(self.weight, init)  # drawn again by delayed initialization


class DistributedT5Block(MegatronBlock):
    """A tensor-parallel T5 block. ``forward((hidden, mask, position_bias, encoder_hidden, encoder_mask))``
    with additive masks ``[N,1,S,S]`` / ``[N,1,S,S_enc]`` (encoder_* None in encoder blocks) returns
    ``(hidden, position_bias, None)``: Hugging Face's triple, the bias holding this rank's heads."""

    def __init__(
        self,
        d_model: int,
        d_kv: int,
        num_heads: int,
        d_ff: int,
        *,
        is_decoder: bool = False,
        has_relative_attention_bias: bool = False,
        gated: bool = False,
        dense_act_fn: str = "relu",
        layer_norm_epsilon: float = 1e-6,
        dropout_rate: float = 0.0,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__(tp=tp, hidden_size=d_model, num_heads=num_heads, d_ff=d_ff)
        self.is_decoder, self.gated, self.act, self.p = is_decoder, gated, dense_act_fn, dropout_rate
        self.num_heads, self.heads, self.d_kv = num_heads, num_heads // self.tp_size, d_kv
        self.buckets, self.max_distance = relative_attention_num_buckets, relative_attention_max_distance
        self.has_bias = has_relative_attention_bias
        inner = num_heads * d_kv
        self.layer = nn.ModuleList()
        for name in ("SelfAttention", "EncDecAttention") if is_decoder else ("SelfAttention",):
            sub, attn = nn.Module(), nn.Module()
            for proj in ("q", "k", "v"):
                setattr(attn, proj, self.linear_in(inner, d_model, False))
            attn.o = self.linear_out(d_model, inner, False)
            if name == "SelfAttention" and has_relative_attention_bias:
                attn.relative_attention_bias = _BiasTable(self, relative_attention_num_buckets, num_heads)
            setattr(sub, name, attn)
            sub.layer_norm = self.norm(d_model, layer_norm_epsilon, rms=True)
            self.layer.append(sub)
        ff, dense = nn.Module(), nn.Module()
        for proj in ("wi_0", "wi_1") if gated else ("wi",):
            setattr(dense, proj, self.linear_in(d_ff, d_model, False))
        dense.wo = self.linear_out(d_model, d_ff, False)
        ff.DenseReluDense = dense
        ff.layer_norm = self.norm(d_model, layer_norm_epsilon, rms=True)
        self.layer.append(ff)

    # --------------------------------------------------------------------------------- pieces

    def _drop(self, x: Tensor, kind: Layout) -> Tensor:
        return tp_dropout(x, self.p, self.training, self.tp, kind)

    def _residual_kind(self) -> Layout:
        return "sharded" if self.memory else "replicated"

    def _bias(self, table: _BiasTable, sq: int, sk: int) -> Tensor:
        """``[1, heads_here, sq, sk]``: this rank's heads of the relative position bias."""
        device = table.weight.device
        relative = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
        bucket = relative_position_bucket(relative, not self.is_decoder, self.buckets, self.max_distance)
        return F.embedding(bucket, table.weight).permute(2, 0, 1).unsqueeze(0)

    def _attention(
        self, attn: Any, x: Tensor, kv: Tensor | None, bias: Tensor | None, mask: Tensor
    ) -> Tensor:
        n, sq, d = x.shape[0], x.shape[1], self.d_kv
        if kv is None:
            q, k, v = self.project(x, [attn.q, attn.k, attn.v])
        else:
            (q,) = self.project(x, [attn.q])
            k, v = self.project(kv, [attn.k, attn.v])
        q, k, v = (t.view(n, t.shape[1], self.heads, d).transpose(1, 2) for t in (q, k, v))
        scores_bias = mask if bias is None else bias + mask
        if self.training and self.p > 0:
            probs = torch.softmax(q @ k.transpose(-1, -2) + scores_bias, dim=-1)
            out = self._drop(probs, "sharded") @ v  # heads differ per rank
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=scores_bias, scale=1.0)
        return self.fan_in(out.transpose(1, 2).reshape(n, sq, self.heads * d), attn.o)

    def _feed_forward(self, dense: Any, x: Tensor) -> Tensor:
        if self.gated:
            gate, linear = self.project(x, [dense.wi_0, dense.wi_1])
            inner = activate(gate, self.act) * linear
        else:
            (inner,) = self.project(x, [dense.wi])
            inner = activate(inner, self.act)
        return self.fan_in(self._drop(inner, "sharded"), dense.wo)  # d_ff channels differ per rank

    def _own_heads(self, bias: Tensor) -> Tensor:
        """A bias handed over by an undistributed first block holds every head: keep this rank's."""
        if bias.shape[1] == self.num_heads and self.heads != self.num_heads:
            return bias.narrow(1, self.tp_rank * self.heads, self.heads)
        return bias

    def _body(
        self, h: Tensor, mask: Tensor, bias: Tensor | None, enc: Tensor | None, enc_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        sub = cast(Any, self.layer[0])
        attn = sub.SelfAttention
        if bias is None:
            sq = h.shape[1]
            bias = self._bias(attn.relative_attention_bias, sq, sq) if self.has_bias else None
        else:
            bias = self._own_heads(bias)
        kind = self._residual_kind()
        h = h + self._drop(self._attention(attn, sub.layer_norm(h), None, bias, mask), kind)
        if self.is_decoder and enc is not None:
            assert enc_mask is not None
            cross = cast(Any, self.layer[1])
            out = self._attention(cross.EncDecAttention, cross.layer_norm(h), enc, None, enc_mask)
            h = h + self._drop(out, kind)
        ff = cast(Any, self.layer[-1])
        h = h + self._drop(self._feed_forward(ff.DenseReluDense, ff.layer_norm(h)), kind)
        if bias is None:  # no table and none handed over: Hugging Face's zeros, of this rank's heads
            bias = h.new_zeros(1, self.heads, h.shape[1], h.shape[1])
        return h, bias

    def forward(
        self, inputs: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]
    ) -> tuple[Tensor, Tensor, None]:
        hidden, mask, bias, enc, enc_mask = inputs
        ctx, batch = self.tp, hidden.shape[0]
        layout: Layout = "sharded" if self.memory else "replicated"
        h = enter(hidden, ctx, layout, type(self).__name__)
        e = None if enc is None else enter(enc, ctx, layout, type(self).__name__)
        m, em = gather_samples(mask, ctx, batch), gather_samples(enc_mask, ctx, batch)
        out, bias = self._body(h, m, bias, e, em)
        return leave(out, ctx, layout), bias, None


# ------------------------------------------------------------------------------ the HF mapping


def _causal(n: int, s: int, like: Tensor) -> Tensor:
    blocked = torch.ones(s, s, dtype=torch.bool, device=like.device).triu(1)
    zeros = torch.zeros(s, s, dtype=like.dtype, device=like.device)
    return zeros.masked_fill(blocked, torch.finfo(like.dtype).min).expand(n, 1, s, s).contiguous()


def forward_hook(  # noqa: PLR0917
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_bias: Tensor | None = None,
    encoder_hidden_states: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    encoder_decoder_position_bias: Tensor | None = None,
    cache: Any = None,
    past_key_values: Any = None,
    *,
    is_decoder: bool = False,
    token: object = None,
    **kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A T5Block's call -> ``((hidden, additive_mask, position_bias, encoder_hidden, encoder_mask),)``.

    Hugging Face passes None for a mask without padding (a causal one in decoder blocks under SDPA);
    each becomes an additive tensor of the same shape on every rank, since ranks exchange them.
    """
    for kv in (cache, past_key_values):
        if kv is not None:
            _refuse_decoding(kv, token)
    n, s = hidden_states.shape[0], hidden_states.shape[1]
    if attention_mask is None and is_decoder:
        mask = _causal(n, s, hidden_states)
    else:
        mask = additive(attention_mask, hidden_states)
    enc_mask = None
    if encoder_hidden_states is not None:
        enc_mask = additive(encoder_attention_mask, hidden_states, encoder_hidden_states.shape[1])
    return ((hidden_states, mask, position_bias, encoder_hidden_states, enc_mask),), {}


_TP_BLOCKS_ATTR = "_mp_tp_blocks"
"""Set on a Hugging Face cache: the TP blocks it has been passed to (a second pass is decoding)."""


def _refuse_decoding(cache: Any, token: object) -> None:
    """A cache is accepted once per block and left empty (T5 models create one even in training, since
    ``use_cache`` defaults to True); the same cache back at the same block is a decoding step."""
    length = getattr(cache, "get_seq_length", None)
    seen = getattr(cache, _TP_BLOCKS_ATTR, None)
    if (callable(length) and length() > 0) or (seen is not None and token in seen):
        raise TPInputError(
            "a tensor-parallel T5 block got a key/value cache a second time; incremental decoding "
            "(generate with a cache) is not supported by tensor-parallel blocks, which never fill it. "
            "Call the model (or generate) with use_cache=False."
        )
    if seen is None:
        seen = set()
        setattr(cache, _TP_BLOCKS_ATTR, seen)
    seen.add(token)


def _kwargs(layer: nn.Module) -> dict[str, Any]:
    block = cast(Any, layer)
    attn = block.layer[0].SelfAttention
    config, dense = attn.config, block.layer[-1].DenseReluDense
    gated = hasattr(dense, "wi_0")
    return {
        "d_model": attn.d_model,
        "d_kv": attn.key_value_proj_dim,
        "num_heads": attn.n_heads,
        "d_ff": (dense.wi_0 if gated else dense.wi).out_features,
        "is_decoder": bool(block.is_decoder),
        "has_relative_attention_bias": bool(attn.has_relative_attention_bias),
        "gated": gated,
        "dense_act_fn": str(config.dense_act_fn),
        "layer_norm_epsilon": block.layer[0].layer_norm.variance_epsilon,
        "dropout_rate": float(config.dropout_rate),
        "relative_attention_num_buckets": attn.relative_attention_num_buckets,
        "relative_attention_max_distance": attn.relative_attention_max_distance,
    }


def check(layer: nn.Module, tp_size: int) -> str | None:
    kw = _kwargs(layer)
    if kw["dense_act_fn"] not in ACTIVATIONS:
        return f"dense_act_fn={kw['dense_act_fn']!r} is not mapped (use one of {', '.join(ACTIVATIONS)})"
    if float(getattr(cast(Any, layer).layer[0].SelfAttention, "scaling", 1.0)) != 1.0:
        return "T5 attention with a score scaling other than 1.0 is not mapped"
    return sizes_reason(tp_size, num_heads=kw["num_heads"], d_ff=kw["d_ff"])


def _identity(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return dict(sd)


def build(layer: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    kw = _kwargs(layer)
    new = DistributedT5Block(**kw, tp=ctx)
    new.load_full_state_dict(layer.state_dict())
    hook = functools.partial(forward_hook, is_decoder=kw["is_decoder"], token=object())
    new.set_call_hooks(hook, None)
    return new


def registrations() -> list[Registration]:
    return [
        Registration(
            name,
            DistributedT5Block,
            builder=build,
            check=check,
            to_original=_identity,
            from_original=_identity,
        )
        for name in (BLOCK,)
    ]
