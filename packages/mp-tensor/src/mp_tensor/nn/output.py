"""``DistributedTransformerOutputLayer``: the MLP block H -> I -> H in its two distributions (docs/tensor.md).

"speed": ``dense1`` split over its output channels behind a backward all-reduce, ``dense2``
over its input channels followed by a forward all-reduce; replicated layer norm.
"memory": both split over their input channels, each followed by a reduce-scatter over its
output channels; distributed layer norm. The residual is always added (see :mod:`.attention`).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import enter, leave, tp_dropout
from mp_tensor.nn.args import TransformerArgs
from mp_tensor.nn.attention import working_layout
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.layernorm import LayerNormShard
from mp_tensor.nn.linear import LinearShard
from mp_tensor.nn.rank_major import linear_reduce_scatter

__all__ = ["DistributedTransformerOutputLayer", "activate"]


def activate(x: Tensor, activation: str) -> Tensor:
    """The output layer's activation: "gelu" (erf), "gelu_new" (tanh approximation) or "relu"."""
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_new":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


class DistributedTransformerOutputLayer(DistributedModule):
    """Tensor-parallel MLP block; functionally :class:`mp_tensor.reference.TransformerOutputLayer`."""

    def __init__(  # noqa: PLR0917
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
        *,
        tp: TPContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tp=tp)
        values = dict(kwargs)
        values.update(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            hidden_dropout_prob=hidden_dropout_prob,
            activation=activation,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
            fp32_residual_addition=fp32_residual_addition,
        )
        for key in ("num_attention_heads", "attention_head_size", "cross_attention", "causal_mask_size"):
            values.pop(key, None)
        values.pop("attention_dropout_prob", None)
        self.args = a = TransformerArgs.parse(type(self).__name__, self.tp_size, values)
        memory = self.tp.optimize == "memory"
        h, i = a.hidden_size, a.intermediate_size
        use_normal, init_range = a.use_normal_initialization, a.initializer_range
        self.dense1 = LinearShard(
            self.tp, i, h, weight_split=1 if memory else 0, bias_split=0,
            use_normal=use_normal, initializer_range=init_range,
        )  # fmt: skip
        self.dense2 = LinearShard(
            self.tp, h, i, weight_split=1, bias_split=0 if memory else None,
            use_normal=use_normal, initializer_range=init_range,
        )  # fmt: skip
        if a.pre_layernorm:
            self.pre_layernorm = LayerNormShard(self.tp, h, a.layernorm_epsilon, sharded=memory)
        if a.post_layernorm:
            self.layernorm = LayerNormShard(self.tp, h, a.layernorm_epsilon, sharded=memory)
        self.layout_io = False  # True inside a DistributedTransformerLayer (see forward)

    def forward_layout(self, hidden: Tensor) -> Tensor:
        """The block on the working layout."""
        a, ctx = self.args, self.tp
        memory = ctx.optimize == "memory"
        group = ctx.group if ctx.distributed else None
        norm = self.pre_layernorm.apply_to(hidden, ctx) if a.pre_layernorm else hidden
        if memory:
            (x,) = linear_reduce_scatter([(norm, self.dense1.weight)], group)
            if self.dense1.bias is not None:
                x = x + self.dense1.bias
            (y,) = linear_reduce_scatter([(activate(x, a.activation), self.dense2.weight)], group)
        else:
            x = norm if group is None else col.all_reduce_backward(norm, group)
            x = F.linear(x, self.dense1.weight, self.dense1.bias)
            y = F.linear(activate(x, a.activation), self.dense2.weight)
            if group is not None:
                y = col.all_reduce(y, group)
        if self.dense2.bias is not None:
            y = y + self.dense2.bias
        y = tp_dropout(y, a.hidden_dropout_prob, self.training, ctx, working_layout(ctx))
        if not a.parallel_attn_output:  # else the layer adds the residual once for attention and MLP
            y = y + hidden
        return self.layernorm.apply_to(y, ctx) if a.post_layernorm else y

    def forward(self, inp: Tensor) -> Tensor:
        """The block on the ``local`` layout, or on the working layout inside a transformer layer
        (``layout_io``, set by the layer: it calls its blocks as modules so that a pipeline can place
        them on different stages)."""
        if self.layout_io:
            return self.forward_layout(inp)
        layout = working_layout(self.tp)
        return leave(self.forward_layout(enter(inp, self.tp, layout, type(self).__name__)), self.tp, layout)
