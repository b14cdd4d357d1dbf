"""``DistributedTransformerLMHead``: embeddings, a ``DistributedTransformer`` and a tied LM head.

The word, position and (when ``num_token_types > 0``) token-type embeddings are split along the hidden
dimension: the token ids of the TP group are gathered, each rank looks up its channels, and the sum is
already the ``sharded`` layout of "memory" mode (an all-gather of the channels gives the ``replicated``
layout of "speed" mode). The LM head reuses the word embedding: each rank multiplies its channels of
the hidden states by its channels of the embedding and a reduce-scatter over the samples sums the
partial logits and hands each rank its own samples, whose loss it computes. With ``prescaled_batch`` the
TP group shares one batch: given labels, rank j keeps the j-th 1/T of the samples' logits and the loss
is the whole batch's mean (each rank's part summed by a scalar all-reduce), so no rank repeats another's
cross entropy; without labels (or a batch T does not divide) an all-reduce gives every rank all logits.

``forward(inputs)`` takes ``(input_ids, attention_mask, token_type_ids, position_ids, labels)``, or with
``add_cross_attention`` ``(input_ids, attention_mask, token_type_ids, position_ids, cross_states,
cross_mask, labels)`` (smp's documented 8-tuple, with ``cross_states`` twice, is accepted too).
``attention_mask``/``cross_mask`` are ``[N, S]`` 0/1 tensors where 1 marks a *masked* position. It
returns the logits ``[N, S, vocab]``, or ``(loss, logits)`` when ``labels`` is given (cross entropy
ignoring -100; shifted by one token when ``causal_mask_size`` is set), or the final hidden states when
``add_lm_head`` is False. mp adds ``final_layernorm`` (a layer norm after the last layer, GPT-2's
``ln_f``) and ``embedding_dropout_prob`` (default: ``hidden_dropout_prob``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import (
    enter,
    gather_samples,
    leave,
    replicated_to_sharded,
    sharded_to_replicated,
    tp_dropout,
)
from mp_tensor.errors import DistTransformerConfigError, TPInputError
from mp_tensor.nn.args import TransformerArgs
from mp_tensor.nn.attention import working_layout
from mp_tensor.nn.base import DistributedModule, ParamInit, ParamSpec, set_param_init, set_param_spec
from mp_tensor.nn.layernorm import LayerNormShard
from mp_tensor.nn.linear import LinearShard
from mp_tensor.nn.transformer import DistributedTransformer, layer_kwargs

__all__ = ["DistributedTransformerLMHead", "lm_loss", "split_lm_inputs"]


def split_lm_inputs(inputs: tuple[Any, ...], cross: bool) -> dict[str, Any]:
    """Name the fields of an LM-head input tuple."""
    if not cross:
        if len(inputs) != 5:
            raise TPInputError(
                f"the LM head got a tuple of {len(inputs)} inputs; expected (input_ids, attention_mask, "
                "token_type_ids, position_ids, labels)."
            )
        ids, mask, tt, pos, labels = inputs
        return {
            "ids": ids,
            "mask": mask,
            "tt": tt,
            "pos": pos,
            "cross": None,
            "cross_mask": None,
            "labels": labels,
        }
    if len(inputs) == 8:
        ids, mask, tt, pos, cross, _, cross_mask, labels = inputs
    elif len(inputs) == 7:
        ids, mask, tt, pos, cross, cross_mask, labels = inputs
    else:
        raise TPInputError(
            f"the LM head with add_cross_attention got a tuple of {len(inputs)} inputs; expected (input_ids, "
            "attention_mask, token_type_ids, position_ids, cross_states, cross_mask, labels)."
        )
    return {
        "ids": ids,
        "mask": mask,
        "tt": tt,
        "pos": pos,
        "cross": cross,
        "cross_mask": cross_mask,
        "labels": labels,
    }


def lm_loss(logits: Tensor, labels: Tensor, causal: bool) -> Tensor:
    """Mean cross entropy over the labelled tokens (-100 ignored), next-token shifted when ``causal``."""
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).to(logits.device), ignore_index=-100
    )


def additive_mask(mask: Tensor | None, mask_value: float, dtype: torch.dtype) -> Tensor | None:
    """``[N, S]`` 0/1 (1 = masked) -> ``[N, 1, 1, S]`` additive mask."""
    if mask is None:
        return None
    return mask[:, None, None, :].to(dtype) * mask_value


class DistributedTransformerLMHead(DistributedModule):
    """Tensor-parallel transformer language model (smp.nn.DistributedTransformerLMHead)."""

    def __init__(  # noqa: PLR0917
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        num_token_types: int = 0,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        tp: TPContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tp=tp)
        values = dict(kwargs)
        values.update(
            {k: v for k, v in locals().items() if k not in ("self", "tp", "kwargs", "values", "__class__")}
        )
        self.args = a = TransformerArgs.parse(type(self).__name__, self.tp_size, values)
        if a.causal_mask_size is not None and a.causal_mask_size < a.num_positions:
            raise DistTransformerConfigError(
                f"{type(self).__name__}: causal_mask_size={a.causal_mask_size} is smaller than "
                f"num_positions={a.num_positions}; pass causal_mask_size >= num_positions (or None)."
            )
        h = a.hidden_size
        self.word_embedding = self._embedding(a.vocab_size, h, a.initializer_range)
        if a.use_positional_embedding:
            self.position_embedding = self._embedding(a.num_positions, h, a.initializer_range)
        if a.num_token_types > 0:
            self.token_type_embedding = self._embedding(a.num_token_types, h, a.initializer_range)
        self.transformer = DistributedTransformer(
            tp=self.tp,
            num_layers=a.num_layers,
            attention_layers_type=a.attention_layers_type,
            **layer_kwargs(a),
        )
        if a.add_lm_head and (a.use_lm_head_bias or not a.tie_input_output_embedding):
            # its own head: weight split over the hidden channels as the embedding's, bias on each rank
            # added to the reduced logits of the rank's samples
            self.lm_head = LinearShard(
                self.tp, a.vocab_size, h, weight_split=1, bias=a.use_lm_head_bias, bias_split=None,
                use_normal=True, initializer_range=a.initializer_range, bias_scaled_batch=False,
            )  # fmt: skip
            if a.tie_input_output_embedding:
                self.lm_head.weight = self.word_embedding.weight  # type: ignore[assignment]
        if a.final_layernorm:
            self.layernorm = LayerNormShard(
                self.tp, h, a.layernorm_epsilon, sharded=self.tp.optimize == "memory"
            )

    def _embedding(self, rows: int, dim: int, init_range: float) -> nn.Embedding:
        emb = nn.Embedding(rows, dim // self.tp_size)
        with torch.no_grad():
            full = torch.empty(rows, dim).normal_(0.0, init_range)
            emb.weight.copy_(self.shard(full, 1))
            if self.tp.dtype is not None:
                emb.weight.data = emb.weight.data.to(self.tp.dtype)
        set_param_spec(emb.weight, ParamSpec(split_dim=1, scaled_batch=True))
        init = ParamInit((rows, dim), "normal", init_range, 1, self.tp_rank, self.tp_size)
        set_param_init(emb.weight, init)  # drawn again by delayed initialization
        return emb

    def forward(self, inputs: tuple[Any, ...]) -> Any:
        a = self.args
        f = split_lm_inputs(inputs, a.add_cross_attention)
        loss, out = self.lm_forward(f, f["labels"], shift=a.causal_mask_size is not None)
        return out if loss is None else (loss, out)

    def lm_forward(
        self, f: dict[str, Any], labels: Tensor | None, *, shift: bool
    ) -> tuple[Tensor | None, Tensor]:
        """``(loss or None, logits)`` for the named inputs ``f`` (:func:`split_lm_inputs`), or ``(None,
        hidden states)`` without an LM head; ``shift``: next-token targets (``labels[:, 1:]``)."""
        a, ctx = self.args, self.tp
        ids: Tensor = f["ids"]
        if ids.dim() != 2:
            raise TPInputError(
                f"{type(self).__name__} got input_ids of shape {tuple(ids.shape)}; expected [N, S]."
            )
        batch, seq = ids.shape
        if f["tt"] is not None and a.num_token_types == 0:
            raise DistTransformerConfigError(
                f"{type(self).__name__} got token_type_ids but was built with num_token_types=0; build it "
                "with num_token_types > 0 or pass token_type_ids=None."
            )
        pos = f["pos"]
        if pos is None:
            pos = torch.arange(seq, device=ids.device).unsqueeze(0).expand(batch, seq)
        elif a.rotary_dim is not None and not bool((pos == torch.arange(seq, device=pos.device)).all()):
            raise TPInputError(
                f"{type(self).__name__} with rotary_dim={a.rotary_dim} got position_ids other than 0..S-1; "
                "the rotary embeddings use positions 0..S-1 (as smp). Pass position_ids=None."
            )
        emb = F.embedding(gather_samples(ids, ctx), self.word_embedding.weight)
        if a.use_positional_embedding:
            emb = emb + F.embedding(gather_samples(pos, ctx, batch), self.position_embedding.weight)
        if f["tt"] is not None:
            emb = emb + F.embedding(gather_samples(f["tt"], ctx, batch), self.token_type_embedding.weight)
        p = a.hidden_dropout_prob if a.embedding_dropout_prob is None else a.embedding_dropout_prob
        emb = tp_dropout(emb, p, self.training, ctx, "sharded")
        memory = ctx.optimize == "memory"
        layout = working_layout(ctx)
        hidden = emb if memory else sharded_to_replicated(emb, ctx)
        mask = gather_samples(additive_mask(f["mask"], a.mask_value, emb.dtype), ctx, batch)
        cross = None if f["cross"] is None else enter(f["cross"], ctx, layout, type(self).__name__)
        cross_mask = gather_samples(additive_mask(f["cross_mask"], a.mask_value, emb.dtype), ctx, batch)
        hidden = self.transformer.forward_layout(hidden, mask, cross, cross_mask)
        if a.final_layernorm:
            hidden = self.layernorm.apply_to(hidden, ctx)
        if not a.add_lm_head:
            return None, leave(hidden, ctx, layout)
        channels = hidden if memory else replicated_to_sharded(hidden, ctx)
        return self._head(channels, labels, shift)

    def _head(self, channels: Tensor, labels: Tensor | None, shift: bool) -> tuple[Tensor | None, Tensor]:
        """Logits from this rank's hidden channels (a partial product summed over the TP group) and the
        loss. Each rank keeps its own samples' logits (a reduce-scatter over the samples), so the cross
        entropy runs once per sample in the group. With ``prescaled_batch`` the ranks share their samples:
        given labels (and a batch the TP degree divides) rank j keeps the j-th 1/T of them and the loss is
        the group's mean (a scalar all-reduce); without labels every rank gets all logits (all-reduce)."""
        ctx = self.tp
        head = getattr(self, "lm_head", None)
        logits = F.linear(channels, self.word_embedding.weight if head is None else head.weight)
        bias = None if head is None else head.bias
        group = ctx.group if ctx.distributed else None
        own = group is not None and ctx.prescaled_batch and labels is not None
        own = own and logits.shape[0] % ctx.size == 0
        if group is not None:
            if ctx.prescaled_batch and not own:
                logits = col.all_reduce(logits, group)
            else:
                logits = col.reduce_scatter(logits, 0, group)
        if bias is not None:
            # prescaled and own samples: every rank needs the whole group's bias gradient (a replicated
            # parameter whose gradients the data-parallel reduction averages as identical copies)
            logits = logits + (col.all_reduce_backward(bias, group) if own and group else bias)
        if labels is None:
            return None, logits
        if not own:
            return lm_loss(logits, labels, shift), logits
        assert group is not None
        return _group_mean_loss(logits, labels, shift, ctx), logits


def _group_mean_loss(logits: Tensor, labels: Tensor, shift: bool, ctx: TPContext) -> Tensor:
    """The mean cross entropy over the TP group's shared batch, from this rank's share of the samples'
    ``logits``: each rank sums its tokens' losses over the group's count of labelled tokens, and a scalar
    all-reduce (identity backward) adds the parts. Equals :func:`lm_loss` over the whole batch."""
    assert ctx.group is not None
    targets = F.pad(labels[:, 1:], (0, 1), value=-100) if shift else labels
    mine = targets.chunk(ctx.size)[ctx.rank].to(logits.device)
    count = (targets != -100).sum().to(torch.float32)
    part = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), mine.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return col.all_reduce((part / count).reshape(1), ctx.group).reshape(())
