"""The hyperparameters shared by the transformer modules, parsed and validated once.

Both the distributed transformer modules and their non-distributed references take these keyword
arguments (docs/tensor.md). The checks are smp's ``DistTransformerConfigError``
rules plus divisibility by the tensor-parallel degree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from mp_tensor.errors import DistTransformerConfigError

__all__ = ["ACTIVATIONS", "TransformerArgs"]

log = logging.getLogger(__name__)

#: "gelu" (erf) and "relu" are smp's; "gelu_new" (the tanh approximation, GPT-2's) is mp's addition.
ACTIVATIONS = ("gelu", "relu", "gelu_new")

# smp accepted these extra keys; these values are the only ones mp implements.
_ACCEPTED_DEFAULTS: dict[str, object] = {
    "scale_attn_by_layer_idx": False,
    "distribute_embedding": False,
}
# Accepted with any value and without effect: keys that only matter with an option refused above
# (layer_idx with scale_attn_by_layer_idx), and smp's test switch.
# ``whole_stack`` is read by the replacement of a whole Hugging Face model (mp_tensor.hf.stack);
# ``fused_dropout`` picks smp's kernel for the same dropout, which torch's applies either way.
_IGNORED = frozenset({"layer_idx", "_precision_test", "whole_stack", "fused_dropout"})
ATTENTION_TYPES = ("global", "local")


@dataclass(frozen=True)
class TransformerArgs:
    num_layers: int = 12
    num_attention_heads: int = 32
    attention_head_size: int = 32
    hidden_size: int = 1024
    intermediate_size: int = 4096
    vocab_size: int = 30522
    num_positions: int = 1024
    attention_dropout_prob: float = 0.1
    hidden_dropout_prob: float = 0.1
    embedding_dropout_prob: float | None = None
    activation: str = "gelu"
    layernorm_epsilon: float = 1e-5
    num_token_types: int = 0
    causal_mask_size: int | None = None
    add_cross_attention: bool = False
    cross_attention: bool = False
    add_lm_head: bool = True
    initializer_range: float = 0.02
    use_normal_initialization: bool = False
    pre_layernorm: bool = False
    post_layernorm: bool = True
    final_layernorm: bool = False
    fp32_residual_addition: bool = False
    mask_value: float = -1e4
    #: True: attention through torch's fused ``scaled_dot_product_attention`` when no attention dropout
    #: applies (eval, or ``attention_dropout_prob=0``); False: the explicit softmax (smp's unfused path).
    fused_softmax: bool = True
    #: smp's ``attention_in_fp32`` / Megatron's ``query_key_layer_scaling`` (which implies it): the
    #: attention scores and softmax computed in fp32 whatever the parameters' dtype, so half precision
    #: cannot overflow there. Megatron's 1/layer scaling is undone inside its fp32 softmax, so in fp32 it
    #: is exactly this; both are identities for fp32 models.
    attention_in_fp32: bool = False
    query_key_layer_scaling: bool = False
    #: Rotary position embeddings on the first ``rotary_dim`` channels of every query and key head
    #: (None: none), with base ``rotary_emb_base`` (None: 10000), GPT-J's interleaved pairs or, with
    #: ``gpt_neox_type_rotary``, GPT-NeoX's rotated halves (:mod:`mp_tensor.nn.positions`).
    rotary_dim: int | None = None
    rotary_emb_base: float | None = None
    gpt_neox_type_rotary: bool = False
    #: ALiBi: a per-head linear bias ``slope_h * (j - i)`` on the scores, slopes from ``alibi_bias_max``.
    use_alibi: bool = False
    alibi_bias_max: float = 8.0
    #: Sliding-window (local) causal attention: a query sees the ``window_size`` keys up to itself. In a
    #: ``DistributedTransformer`` it applies to the layers ``attention_layers_type`` marks "local" (all
    #: layers when that is None).
    window_size: int | None = None
    attention_layers_type: tuple[str, ...] | None = None
    #: False: scores are not divided by sqrt(attention_head_size) (GPT-Neo).
    scale_attention_scores: bool = True
    use_qkv_bias: bool = True
    use_attn_dense_bias: bool = True
    #: GPT-J / GPT-NeoX blocks: ``out = attention(x) + mlp(x) + x`` instead of the sequential residuals;
    #: ``single_pre_layernorm``: one layer norm at the layer's input feeds both (GPT-J's ``ln_1``).
    parallel_attn_output: bool = False
    single_pre_layernorm: bool = False
    use_positional_embedding: bool = True
    use_lm_head_bias: bool = False
    tie_input_output_embedding: bool = True

    @property
    def all_head_size(self) -> int:
        """Channels of the attention context: heads x head size."""
        return self.num_attention_heads * self.attention_head_size

    @classmethod
    def parse(cls, who: str, tp_size: int, values: dict[str, Any]) -> TransformerArgs:
        """Validate ``values`` (the constructor's arguments) for module ``who`` on ``tp_size`` ranks."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        fused_gelu = bool(values.get("fused_bias_gelu", False))
        for key, value in values.items():
            if key == "fused_bias_gelu":
                continue
            if key == "attention_layers_type" and value is not None:
                kwargs[key] = tuple(value)
            elif key in known:
                kwargs[key] = value
            elif key in _ACCEPTED_DEFAULTS:
                if value != _ACCEPTED_DEFAULTS[key]:
                    raise DistTransformerConfigError(
                        f"{who} got {key}={value!r}; mp implements only {key}={_ACCEPTED_DEFAULTS[key]!r}. "
                        f"Drop the argument or use a module of your own for this variant."
                    )
            elif key not in _IGNORED:
                log.warning("%s: ignoring unknown argument %s=%r", who, key, value)
        if fused_gelu:
            # Megatron's fused bias-GeLU kernel (smp's fused_bias_gelu) computes the tanh approximation.
            act = kwargs.get("activation", "gelu")
            if act not in ("gelu", "gelu_new"):
                raise DistTransformerConfigError(
                    f"{who} got fused_bias_gelu=True with activation={act!r}; the fused bias-GeLU replaces a "
                    "GeLU. Pass activation='gelu' or fused_bias_gelu=False."
                )
            kwargs["activation"] = "gelu_new"
        args = cls(**kwargs)
        args._check(who, tp_size)
        return args

    def _check(self, who: str, tp_size: int) -> None:
        def fail(message: str) -> None:
            raise DistTransformerConfigError(f"{who}: {message}")

        if not (self.pre_layernorm or self.post_layernorm or self.single_pre_layernorm):
            fail(
                "got pre_layernorm=False, post_layernorm=False and single_pre_layernorm=False; at least one "
                "of them must be True."
            )
        if self.pre_layernorm and self.single_pre_layernorm:
            fail("got pre_layernorm=True with single_pre_layernorm=True; pass pre_layernorm=False with it.")
        self._check_positions(fail)
        if self.activation not in ACTIVATIONS:
            fail(f"got activation={self.activation!r}; expected one of {ACTIVATIONS}.")
        if self.fp32_residual_addition:
            fail("got fp32_residual_addition=True, which mp does not implement; pass False.")
        for name in (
            "num_attention_heads",
            "attention_head_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
        ):
            if getattr(self, name) < 1:
                fail(f"got {name}={getattr(self, name)}; expected a positive integer.")
        for name in ("attention_dropout_prob", "hidden_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(f"got {name}={getattr(self, name)}; expected a probability in [0, 1).")
        if self.causal_mask_size is not None and self.causal_mask_size < 1:
            fail(
                f"got causal_mask_size={self.causal_mask_size}; expected None or the maximum sequence length."
            )
        for name in ("num_attention_heads", "hidden_size", "intermediate_size"):
            if getattr(self, name) % tp_size:
                fail(
                    f"{name}={getattr(self, name)} is not divisible by the tensor-parallel degree {tp_size}; "
                    f"use a multiple of {tp_size}."
                )

    def _check_positions(self, fail: Any) -> None:
        """The rotary, ALiBi and sliding-window options."""
        cross = self.cross_attention or self.add_cross_attention
        if self.rotary_dim is not None:
            d = self.attention_head_size
            if not (
                isinstance(self.rotary_dim, int) and 0 < self.rotary_dim <= d and self.rotary_dim % 2 == 0
            ):
                fail(
                    f"got rotary_dim={self.rotary_dim!r}; expected an even integer in "
                    f"[2, attention_head_size={d}] (or None for no rotary embedding)."
                )
            if cross:
                fail(
                    f"got rotary_dim={self.rotary_dim} with cross attention; mp applies rotary embeddings to "
                    "self-attention only. Pass rotary_dim=None or add_cross_attention=False."
                )
        if self.rotary_emb_base is not None and not self.rotary_emb_base > 0:
            fail(
                f"got rotary_emb_base={self.rotary_emb_base!r}; expected a positive number "
                "(10000 by default)."
            )
        if not self.alibi_bias_max > 0:
            fail(f"got alibi_bias_max={self.alibi_bias_max!r}; expected a positive number (8 by default).")
        if self.window_size is not None:
            if not (isinstance(self.window_size, int) and self.window_size > 0):
                fail(f"got window_size={self.window_size!r}; expected a positive integer or None.")
            if self.causal_mask_size is None:
                fail(
                    f"got window_size={self.window_size} without causal_mask_size; the sliding window "
                    "narrows the causal mask. Pass causal_mask_size (the maximum sequence length) too."
                )
        if self.attention_layers_type is not None:
            kinds = self.attention_layers_type
            if len(kinds) != self.num_layers or any(k not in ATTENTION_TYPES for k in kinds):
                fail(
                    f"got attention_layers_type={list(kinds)!r}; expected one of {ATTENTION_TYPES} per layer "
                    f"({self.num_layers} layers)."
                )
            if "local" in kinds and self.window_size is None:
                fail("attention_layers_type has 'local' layers but window_size is None; pass window_size.")
        if self.parallel_attn_output and self.add_cross_attention:
            fail("got parallel_attn_output=True with add_cross_attention=True; pass one of them only.")

    def replace(self, **changes: Any) -> TransformerArgs:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return TransformerArgs(**values)
