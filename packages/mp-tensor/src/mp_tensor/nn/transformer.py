"""The transformer layer and the transformer (smp's ``TransformerLayer``, ``Transformer``; docs/tensor.md).

A layer is an attention block, an optional cross-attention block and an output (MLP) block. The
outermost module moves its inputs into the working layout once (an all-to-all in "memory" mode, an
all-gather in "speed" mode, slicing or nothing with ``prescaled_batch``) and its output back, so a
``DistributedTransformer`` of L layers exchanges samples twice, not 2L times. Its layers are still
called as modules, through ``seq_layers`` (an ``nn.Sequential`` passing one tuple from layer to layer),
on the working layout (their ``layout_io``): so a pipeline can run each layer on its own stage and
activation checkpointing can wrap them, as smp's ``seq_layers`` allowed.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.dist_ops import enter, gather_samples, leave
from mp_tensor.errors import DistTransformerConfigError
from mp_tensor.nn.args import TransformerArgs
from mp_tensor.nn.attention import DistributedAttentionLayer, working_layout
from mp_tensor.nn.base import DistributedModule
from mp_tensor.nn.layernorm import LayerNormShard
from mp_tensor.nn.output import DistributedTransformerOutputLayer

__all__ = ["DistributedTransformer", "DistributedTransformerLayer", "layer_kwargs", "layer_windows"]

_ATTENTION_KEYS = (
    "num_attention_heads",
    "attention_head_size",
    "hidden_size",
    "attention_dropout_prob",
    "hidden_dropout_prob",
    "layernorm_epsilon",
    "initializer_range",
    "use_normal_initialization",
    "causal_mask_size",
    "pre_layernorm",
    "post_layernorm",
    "mask_value",
    "fused_softmax",
    "attention_in_fp32",
    "query_key_layer_scaling",
    "rotary_dim",
    "rotary_emb_base",
    "gpt_neox_type_rotary",
    "use_alibi",
    "alibi_bias_max",
    "window_size",
    "scale_attention_scores",
    "use_qkv_bias",
    "use_attn_dense_bias",
    "parallel_attn_output",
    "single_pre_layernorm",
)
_OUTPUT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "hidden_dropout_prob",
    "activation",
    "layernorm_epsilon",
    "initializer_range",
    "use_normal_initialization",
    "pre_layernorm",
    "post_layernorm",
    "parallel_attn_output",
    "single_pre_layernorm",
)
_LAYER_KEYS = tuple(dict.fromkeys((*_ATTENTION_KEYS, *_OUTPUT_KEYS, "add_cross_attention")))


def layer_kwargs(args: TransformerArgs, keys: tuple[str, ...] = _LAYER_KEYS) -> dict[str, Any]:
    """The constructor arguments of a sub-block, taken from parsed ``args``."""
    return {key: getattr(args, key) for key in keys}


def layer_windows(args: TransformerArgs) -> list[int | None]:
    """The sliding window of each layer: ``window_size`` on the layers ``attention_layers_type`` marks
    "local" (on every layer when it is None), no window on the "global" ones."""
    kinds = args.attention_layers_type
    if kinds is None:
        return [args.window_size] * args.num_layers
    return [args.window_size if kind == "local" else None for kind in kinds]


def _collect(local: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    values = dict(kwargs)
    values.update({k: v for k, v in local.items() if k not in ("self", "tp", "kwargs", "__class__")})
    return values


class DistributedTransformerLayer(DistributedModule):
    """Tensor-parallel transformer layer; ``forward((hidden, mask))`` returns ``(out, mask)``.

    With ``add_cross_attention``: ``forward((hidden, cross_states, mask, cross_mask))`` returns the same
    4-tuple with ``hidden`` replaced by the output.
    """

    def __init__(  # noqa: PLR0917
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        use_alibi: bool = False,
        alibi_bias_max: float = 8.0,
        rotary_dim: int | None = None,
        window_size: int | None = None,
        tp: TPContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tp=tp)
        values = _collect(locals(), kwargs)
        values.pop("num_layers", None)
        if values.pop("attention_layers_type", None) is not None:
            raise DistTransformerConfigError(
                f"{type(self).__name__} got attention_layers_type, which picks the local layers of a "
                "DistributedTransformer; pass window_size (or None) to a single layer instead."
            )
        self.args = a = TransformerArgs.parse(type(self).__name__, self.tp_size, values)
        if a.single_pre_layernorm:  # one norm feeding attention and MLP (GPT-J's ln_1)
            memory = self.tp.optimize == "memory"
            self.pre_layernorm = LayerNormShard(self.tp, a.hidden_size, a.layernorm_epsilon, sharded=memory)
        self.attention = DistributedAttentionLayer(tp=self.tp, **layer_kwargs(a, _ATTENTION_KEYS))
        if a.add_cross_attention:
            cross = {**layer_kwargs(a, _ATTENTION_KEYS), "window_size": None}
            self.cross_attention = DistributedAttentionLayer(tp=self.tp, cross_attention=True, **cross)
        self.output = DistributedTransformerOutputLayer(tp=self.tp, **layer_kwargs(a, _OUTPUT_KEYS))
        # its blocks are called as modules, on the working layout (forward_layout)
        self.attention.layout_io = self.output.layout_io = True
        if a.add_cross_attention:
            self.cross_attention.layout_io = True
        self.layout_io = False
        """True inside a ``DistributedTransformer``: ``forward`` takes and returns the working layout (the
        container moved the samples once for all its layers)."""

    def forward_layout(
        self,
        hidden: Tensor,
        mask: Tensor | None,
        cross: Tensor | None = None,
        cross_mask: Tensor | None = None,
    ) -> Tensor:
        """The layer on the working layout; its blocks are called as modules (hooks, pipeline stages and
        activation checkpointing of ``layer.attention`` / ``layer.output`` apply)."""
        a = self.args
        x = self.pre_layernorm.apply_to(hidden, self.tp) if a.single_pre_layernorm else hidden
        if a.parallel_attn_output:  # attention and MLP read the same input; one residual for both
            return self.attention((x, mask)) + self.output(x) + hidden  # type: ignore[no-any-return]
        out = self.attention((x, mask))
        if self.args.add_cross_attention:
            out = self.cross_attention((out, cross, cross_mask))
        return self.output(out)  # type: ignore[no-any-return]

    def forward(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.layout_io:
            return _run_layers(self, inputs)
        if self.args.add_cross_attention:
            hidden, cross, mask, cross_mask = inputs
            return self.forward_layout(hidden, mask, cross, cross_mask), cross, mask, cross_mask
        hidden, mask = inputs
        return self.forward_layout(hidden, mask), mask


class DistributedTransformer(DistributedModule):
    """``num_layers`` tensor-parallel transformer layers in sequence (reference: ``Transformer``)."""

    def __init__(  # noqa: PLR0917
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        tp: TPContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tp=tp)
        self.args = a = TransformerArgs.parse(type(self).__name__, self.tp_size, _collect(locals(), kwargs))
        layers = [
            DistributedTransformerLayer(tp=self.tp, **{**layer_kwargs(a), "window_size": window})
            for window in layer_windows(a)
        ]
        for layer in layers:
            layer.layout_io = True
        self.seq_layers = nn.Sequential(*layers)

    @property
    def layers(self) -> list[DistributedTransformerLayer]:
        return list(self.seq_layers)  # type: ignore[arg-type]

    def forward_layout(
        self,
        hidden: Tensor,
        mask: Tensor | None,
        cross: Tensor | None = None,
        cross_mask: Tensor | None = None,
    ) -> Tensor:
        """Every layer on the working layout, called through ``seq_layers``."""
        if self.args.add_cross_attention:
            return self.seq_layers((hidden, cross, mask, cross_mask))[0]  # type: ignore[no-any-return]
        return self.seq_layers((hidden, mask))[0]  # type: ignore[no-any-return]

    def forward(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Same inputs and outputs as :class:`DistributedTransformerLayer`."""
        return _run_layers(self, inputs)


def _run_layers(
    owner: DistributedTransformerLayer | DistributedTransformer, inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """``owner`` on local-layout inputs: into the working layout once, through it, and back."""
    cross_mode = owner.args.add_cross_attention
    if cross_mode:
        hidden, cross, mask, cross_mask = inputs
    else:
        hidden, mask = inputs
        cross = cross_mask = None
    ctx = owner.tp
    layout = working_layout(ctx)
    name = type(owner).__name__
    batch = hidden.shape[0]
    h = enter(hidden, ctx, layout, name)
    c = None if cross is None else enter(cross, ctx, layout, name)
    m = gather_samples(mask, ctx, batch)
    cm = gather_samples(cross_mask, ctx, batch)
    out = leave(owner.forward_layout(h, m, c, cm), ctx, layout)
    if cross_mode:
        return out, cross, mask, cross_mask
    return out, mask
