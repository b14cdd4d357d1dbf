"""Non-distributed reference implementations of the transformer modules, as smp documented them.

These are what the distributed modules of :mod:`mp_tensor.nn` compute: a module of your own that is
functionally one of these can be registered (``smp.tp_register``) against the distributed one, and
their state dicts are the layout :meth:`DistributedModule.full_state_dict` gathers into.

They follow smp's reference listings, with ``parse_args`` made concrete (:class:`TransformerArgs`, the same
validation as the distributed modules) and these choices where the listing is silent or inconsistent:

- the residual connection is always added; the listing drops it when ``post_layernorm`` is False, which
  leaves no way to write a pre-layernorm transformer (GPT-2) with these modules;
- query/key/value map ``hidden_size`` to ``num_attention_heads * attention_head_size`` (the listing
  recomputes the head size as ``hidden_size // num_attention_heads``; both agree when the sizes do);
- the causal mask keeps key positions ``<=`` the query position, masked scores are set to
  ``mask_value`` (-1e4) before the attention mask is added;
- the output layer's dropout uses ``hidden_dropout_prob`` (the listing reads ``attention_dropout_prob``,
  which that module does not take);
- ``activation`` may also be ``"gelu_new"`` (tanh approximation) for GPT-2;
- ``TransformerLMHead`` (not listed in the seed) is written out here as the distributed one computes;
- smp's later options (rotary, ALiBi, sliding window, ``parallel_attn_output``, ``single_pre_layernorm``,
  biases, unscaled scores, untied LM head) are written as smp's transformer computed them, with the
  position helpers of :mod:`mp_tensor.nn.positions` (checked against Hugging Face's models).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.nn.args import TransformerArgs
from mp_tensor.nn.positions import alibi_bias, alibi_slopes, apply_rotary, keep_mask, rotary_tables

__all__ = ["AttentionLayer", "Transformer", "TransformerLMHead", "TransformerLayer", "TransformerOutputLayer"]


_ATTENTION_ONLY = (
    "num_attention_heads",
    "attention_head_size",
    "causal_mask_size",
    "window_size",
    "rotary_dim",
    "rotary_emb_base",
    "gpt_neox_type_rotary",
)


def _act(x: Tensor, activation: str) -> Tensor:
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_new":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


class AttentionLayer(nn.Module):
    """Reference for ``DistributedAttentionLayer``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        kwargs.pop("intermediate_size", None)
        a = self.args = TransformerArgs.parse(type(self).__name__, 1, kwargs)
        h, all_heads = a.hidden_size, a.all_head_size
        self.query = nn.Linear(h, all_heads, bias=a.use_qkv_bias)
        self.key = nn.Linear(h, all_heads, bias=a.use_qkv_bias)
        self.value = nn.Linear(h, all_heads, bias=a.use_qkv_bias)
        self.dense = nn.Linear(all_heads, h, bias=a.use_attn_dense_bias)
        self.dropout1 = nn.Dropout(a.attention_dropout_prob)
        self.dropout2 = nn.Dropout(a.hidden_dropout_prob)
        if a.pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(h, eps=a.layernorm_epsilon)
        if a.post_layernorm:
            self.layernorm = nn.LayerNorm(h, eps=a.layernorm_epsilon)

    def transpose(self, tensor: Tensor, key: bool = False) -> Tensor:
        a = self.args
        tensor = torch.reshape(tensor, (*tensor.size()[:-1], a.num_attention_heads, a.attention_head_size))
        return tensor.permute(0, 2, 3, 1) if key else tensor.permute(0, 2, 1, 3)

    def apply_causal_mask(self, scores: Tensor) -> Tensor:
        sq, sk = scores.shape[-2], scores.shape[-1]
        keep = keep_mask(sq, sk, self.args.window_size, scores.device)
        return scores.masked_fill(~keep, self.args.mask_value)

    def rotate(self, tensor: Tensor) -> Tensor:
        """Rotary embedding of ``tensor [N, S, heads * d]`` (positions 0..S-1)."""
        a = self.args
        if a.rotary_dim is None:
            return tensor
        n, s = tensor.shape[0], tensor.shape[1]
        cos, sin = rotary_tables(s, a.rotary_dim, a.rotary_emb_base, a.gpt_neox_type_rotary, tensor.device)
        heads = tensor.reshape(n, s, a.num_attention_heads, a.attention_head_size)
        return apply_rotary(heads, cos, sin, a.gpt_neox_type_rotary).reshape(tensor.shape)

    def forward(self, inp: tuple[Tensor, ...]) -> Tensor:
        a = self.args
        if a.cross_attention:
            hidden_states, cross_states, attention_mask = inp
        else:
            hidden_states, attention_mask = inp
        norm_states = self.pre_layernorm(hidden_states) if a.pre_layernorm else hidden_states
        query_layer = self.query(norm_states)
        source = cross_states if a.cross_attention else norm_states
        key_layer = self.key(source)
        value_layer = self.value(source)
        query_layer = self.transpose(self.rotate(query_layer))
        key_layer = self.transpose(self.rotate(key_layer), key=True)
        value_layer = self.transpose(value_layer)
        attention_scores = torch.matmul(query_layer, key_layer)
        if a.scale_attention_scores:
            attention_scores = attention_scores / math.sqrt(a.attention_head_size)
        if a.use_alibi:
            slopes = alibi_slopes(a.num_attention_heads, a.alibi_bias_max).to(attention_scores.device)
            sq, sk = attention_scores.shape[-2:]
            attention_scores = attention_scores + alibi_bias(slopes, sq, sk, attention_scores.dtype)
        if not a.cross_attention and a.causal_mask_size is not None:
            attention_scores = self.apply_causal_mask(attention_scores)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout1(F.softmax(attention_scores, dim=-1))
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3)
        context_layer = torch.reshape(context_layer, (*context_layer.size()[:-2], a.all_head_size))
        self_attention: Tensor = self.dropout2(self.dense(context_layer))
        if a.parallel_attn_output:  # the layer adds the residual
            return self.layernorm(self_attention) if a.post_layernorm else self_attention
        if a.post_layernorm:
            return self.layernorm(self_attention + hidden_states)  # type: ignore[no-any-return]
        return self_attention + hidden_states


class TransformerOutputLayer(nn.Module):
    """Reference for ``DistributedTransformerOutputLayer``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        for key in (*_ATTENTION_ONLY, "cross_attention"):
            kwargs.pop(key, None)
        a = self.args = TransformerArgs.parse(type(self).__name__, 1, kwargs)
        self.dense1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.dense2 = nn.Linear(a.intermediate_size, a.hidden_size)
        self.dropout = nn.Dropout(a.hidden_dropout_prob)
        if a.pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(a.hidden_size, eps=a.layernorm_epsilon)
        if a.post_layernorm:
            self.layernorm = nn.LayerNorm(a.hidden_size, eps=a.layernorm_epsilon)

    def forward(self, inp: Tensor) -> Tensor:
        a = self.args
        norm_inp = self.pre_layernorm(inp) if a.pre_layernorm else inp
        output: Tensor = self.dropout(self.dense2(_act(self.dense1(norm_inp), a.activation)))
        if a.parallel_attn_output:  # the layer adds the residual
            return self.layernorm(output) if a.post_layernorm else output
        if a.post_layernorm:
            return self.layernorm(inp + output)  # type: ignore[no-any-return]
        return inp + output


class TransformerLayer(nn.Module):
    """Reference for ``DistributedTransformerLayer``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        kwargs.pop("num_layers", None)
        self.args = a = TransformerArgs.parse(type(self).__name__, 1, dict(kwargs))
        sub = {k: v for k, v in kwargs.items() if k != "add_cross_attention"}
        if a.single_pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(a.hidden_size, eps=a.layernorm_epsilon)
        self.attention = AttentionLayer(**sub)
        self.output = TransformerOutputLayer(**sub)
        if self.args.add_cross_attention:
            self.cross_attention = AttentionLayer(cross_attention=True, **sub)

    def forward(self, inp: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.args.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inp
        else:
            hidden_states, attention_mask = inp
        a = self.args
        x = self.pre_layernorm(hidden_states) if a.single_pre_layernorm else hidden_states
        if a.parallel_attn_output:
            out = self.attention((x, attention_mask)) + self.output(x) + hidden_states
            return out, attention_mask
        attention_output = self.attention((x, attention_mask))
        if self.args.add_cross_attention:
            attention_output = self.cross_attention((attention_output, cross_states, cross_mask))
        output = self.output(attention_output)
        if self.args.add_cross_attention:
            return output, cross_states, attention_mask, cross_mask
        return output, attention_mask


class Transformer(nn.Module):
    """Reference for ``DistributedTransformer``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args = a = TransformerArgs.parse(type(self).__name__, 1, dict(kwargs))
        layer_kwargs = {k: v for k, v in kwargs.items() if k not in ("num_layers", "attention_layers_type")}
        windows = [a.window_size] * a.num_layers
        if a.attention_layers_type is not None:
            windows = [a.window_size if t == "local" else None for t in a.attention_layers_type]
        self.seq_layers = nn.Sequential(
            *[TransformerLayer(**{**layer_kwargs, "window_size": w}) for w in windows]
        )

    def forward(self, inp: tuple[Any, ...]) -> tuple[Any, ...]:
        for layer in self.seq_layers:
            inp = layer(inp)
        return inp


class TransformerLMHead(nn.Module):
    """Reference for ``DistributedTransformerLMHead`` (see :mod:`mp_tensor.nn.lm_head` for the contract)."""

    _LM_ONLY = (
        "vocab_size",
        "num_positions",
        "num_token_types",
        "add_lm_head",
        "final_layernorm",
        "embedding_dropout_prob",
        "use_positional_embedding",
        "use_lm_head_bias",
        "tie_input_output_embedding",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        a = self.args = TransformerArgs.parse(type(self).__name__, 1, dict(kwargs))
        h = a.hidden_size
        self.word_embedding = nn.Embedding(a.vocab_size, h)
        if a.use_positional_embedding:
            self.position_embedding = nn.Embedding(a.num_positions, h)
        if a.num_token_types > 0:
            self.token_type_embedding = nn.Embedding(a.num_token_types, h)
        for emb in self.modules():
            if isinstance(emb, nn.Embedding):
                nn.init.normal_(emb.weight, 0.0, a.initializer_range)
        p = a.hidden_dropout_prob if a.embedding_dropout_prob is None else a.embedding_dropout_prob
        self.dropout = nn.Dropout(p)
        self.transformer = Transformer(**{k: v for k, v in kwargs.items() if k not in self._LM_ONLY})
        if a.final_layernorm:
            self.layernorm = nn.LayerNorm(h, eps=a.layernorm_epsilon)
        if a.add_lm_head and (a.use_lm_head_bias or not a.tie_input_output_embedding):
            self.lm_head = nn.Linear(h, a.vocab_size, bias=a.use_lm_head_bias)
            if a.tie_input_output_embedding:
                self.lm_head.weight = self.word_embedding.weight

    def forward(self, inputs: tuple[Any, ...]) -> Any:
        from mp_tensor.nn.lm_head import additive_mask, lm_loss, split_lm_inputs

        a = self.args
        f = split_lm_inputs(inputs, a.add_cross_attention)
        ids = f["ids"]
        pos = f["pos"]
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        hidden = self.word_embedding(ids)
        if a.use_positional_embedding:
            hidden = hidden + self.position_embedding(pos)
        if f["tt"] is not None:
            hidden = hidden + self.token_type_embedding(f["tt"])
        hidden = self.dropout(hidden)
        mask = additive_mask(f["mask"], a.mask_value, hidden.dtype)
        if a.add_cross_attention:
            cross_mask = additive_mask(f["cross_mask"], a.mask_value, hidden.dtype)
            hidden = self.transformer((hidden, f["cross"], mask, cross_mask))[0]
        else:
            hidden = self.transformer((hidden, mask))[0]
        if a.final_layernorm:
            hidden = self.layernorm(hidden)
        if not a.add_lm_head:
            return hidden
        head = getattr(self, "lm_head", None)
        logits = F.linear(hidden, self.word_embedding.weight) if head is None else head(hidden)
        if f["labels"] is None:
            return logits
        return lm_loss(logits, f["labels"], a.causal_mask_size is not None), logits
