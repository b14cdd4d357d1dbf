"""smp's whole-stack replacement for GPT-J and GPT-Neo: a Hugging Face ``GPTJForCausalLM`` /
``GPTNeoForCausalLM`` built inside ``tensor_parallelism()`` becomes a
:class:`~mp_tensor.nn.lm_head.DistributedTransformerLMHead` (``model.transformer.seq_layers``), at any
tensor-parallel degree including 1, as smp did (v1.8 / v1.10 / later), with smp's arguments for each family:

- GPT-J: one layer norm feeding attention and MLP in parallel (``single_pre_layernorm``,
  ``parallel_attn_output``), GPT-J's interleaved rotary embeddings on ``rotary_dim`` channels per head,
  no query/key/value/output biases, no position embedding, its own LM head with a bias;
- GPT-Neo: pre-layernorm blocks whose attention alternates global and local (``attention_layers_type``,
  ``window_size``) with unscaled scores, no query/key/value biases, the LM head tied to the embedding.
- GPT-NeoX (smp's ``gptneox``): pre-layernorm blocks, attention and MLP added in parallel
  (``parallel_attn_output``, each with its own norm) or in sequence (``use_parallel_residual=False``),
  NeoX's half-rotation rotary embeddings on ``partial_rotary_factor`` of each head, no position
  embedding, its own LM head without a bias (or the embedding, when tied).

They are called as the Hugging Face model (``input_ids``, ``attention_mask``, ``labels`` -> an output
with ``.loss`` and ``.logits``); their gathered state dicts are translated back to Hugging Face's names
(:mod:`mp_tensor.hf.translate_gpt`). ``whole_stack=False`` keeps the model and distributes its blocks
one by one (:mod:`mp_tensor.hf.gptj`, :mod:`mp_tensor.hf.gptneo`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.hf.common import ACTIVATION_MAP, sizes_reason
from mp_tensor.hf.stack import (
    GPTJ_MODEL,
    GPTNEO_MODEL,
    GPTNEOX_MODEL,
    HFDistributedLMHead,
    whole_stack_requested,
)
from mp_tensor.hf.translate_gpt import (
    gptj_from_smp,
    gptj_to_smp,
    gptneo_from_smp,
    gptneo_to_smp,
    gptneox_from_smp,
    gptneox_to_smp,
)
from mp_tensor.nn.base import DistributedModule
from mp_tensor.registry import REGISTRATION_ATTR, Registration

__all__ = [
    "GPTJDistributedLMHead",
    "GPTNeoDistributedLMHead",
    "GPTNeoXDistributedLMHead",
    "gptj_lm_head_kwargs",
    "gptneo_lm_head_kwargs",
    "gptneox_lm_head_kwargs",
    "registrations",
]


def gptj_lm_head_kwargs(config: Any) -> dict[str, Any]:
    """The :class:`DistributedTransformerLMHead` arguments equivalent to an HF ``GPTJForCausalLM``."""
    head = config.n_embd // config.n_head
    return {
        "num_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "attention_head_size": head,
        "hidden_size": config.n_embd,
        "intermediate_size": config.n_inner if config.n_inner is not None else 4 * config.n_embd,
        "vocab_size": config.vocab_size,
        "num_positions": config.n_positions,
        "causal_mask_size": config.n_positions,
        "attention_dropout_prob": config.attn_pdrop,
        "hidden_dropout_prob": config.resid_pdrop,
        "embedding_dropout_prob": config.embd_pdrop,
        "activation": ACTIVATION_MAP[config.activation_function],
        "layernorm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "rotary_dim": config.rotary_dim or head,
        "pre_layernorm": False,
        "post_layernorm": False,
        "single_pre_layernorm": True,
        "parallel_attn_output": True,
        "use_qkv_bias": False,
        "use_attn_dense_bias": False,
        "use_positional_embedding": False,
        "use_lm_head_bias": True,
        "tie_input_output_embedding": False,
        "final_layernorm": True,
        "mask_value": -1e9,
    }


def _neo_layer_types(config: Any) -> list[str]:
    return [kind for kinds, repeat in config.attention_types for _ in range(repeat) for kind in kinds]


def gptneo_lm_head_kwargs(config: Any) -> dict[str, Any]:
    """The :class:`DistributedTransformerLMHead` arguments equivalent to an HF ``GPTNeoForCausalLM``."""
    return {
        "num_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "attention_head_size": config.hidden_size // config.num_heads,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size or 4 * config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings,
        "causal_mask_size": config.max_position_embeddings,
        "attention_dropout_prob": float(config.attention_dropout),
        "hidden_dropout_prob": float(config.resid_dropout),
        "embedding_dropout_prob": float(config.embed_dropout),
        "activation": ACTIVATION_MAP[config.activation_function],
        "layernorm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "attention_layers_type": _neo_layer_types(config),
        "window_size": config.window_size,
        "scale_attention_scores": False,
        "attention_in_fp32": True,
        "use_qkv_bias": False,
        "pre_layernorm": True,
        "post_layernorm": False,
        "final_layernorm": True,
        "mask_value": -1e9,
    }


def _neox_rope(config: Any) -> dict[str, Any]:
    """GPT-NeoX's rotary parameters (transformers >= 4.56 ``rope_parameters``, or the older fields)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", getattr(config, "rope_theta", getattr(config, "rotary_emb_base", 10000)))
    rope.setdefault("partial_rotary_factor", getattr(config, "rotary_pct", 1.0))
    return rope


def gptneox_lm_head_kwargs(config: Any) -> dict[str, Any]:
    """The :class:`DistributedTransformerLMHead` arguments equivalent to an HF ``GPTNeoXForCausalLM``."""
    head = config.hidden_size // config.num_attention_heads
    rope = _neox_rope(config)
    bias = bool(getattr(config, "attention_bias", True))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    parallel = bool(getattr(config, "use_parallel_residual", True))
    return {
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "attention_head_size": head,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings,
        "causal_mask_size": config.max_position_embeddings,
        "attention_dropout_prob": float(config.attention_dropout),
        "hidden_dropout_prob": float(config.hidden_dropout),
        "embedding_dropout_prob": float(config.hidden_dropout),
        "activation": ACTIVATION_MAP[config.hidden_act],
        "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "rotary_dim": int(head * float(rope["partial_rotary_factor"])),
        "rotary_emb_base": float(rope["rope_theta"]),
        "gpt_neox_type_rotary": True,
        "pre_layernorm": True,
        "post_layernorm": False,
        "parallel_attn_output": parallel,
        "use_qkv_bias": bias,
        "use_attn_dense_bias": bias,
        "use_positional_embedding": False,
        "use_lm_head_bias": False,
        "tie_input_output_embedding": tied,
        "final_layernorm": True,
        "mask_value": -1e9,
    }


class _CausalLM(HFDistributedLMHead):
    """GPT-J's and GPT-Neo's calling convention (their ``forward`` arguments, in order)."""

    output_class = "CausalLMOutputWithPast"

    def forward(  # type: ignore[override]  # noqa: PLR0917
        self,
        input_ids: Tensor | None = None,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The Hugging Face model's arguments; returns ``CausalLMOutputWithPast``."""
        return self.hf_forward(
            input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds, labels,
            logits_to_keep, return_dict, kwargs,
        )  # fmt: skip


class GPTJDistributedLMHead(_CausalLM):
    """A ``DistributedTransformerLMHead`` standing in for a Hugging Face ``GPTJForCausalLM``."""

    family = "GPT-J"

    def __init__(self, config: Any, *, tp: TPContext | None = None, **overrides: Any) -> None:
        super().__init__(config, {**gptj_lm_head_kwargs(config), **overrides}, tp=tp)


class GPTNeoDistributedLMHead(_CausalLM):
    """A ``DistributedTransformerLMHead`` standing in for a Hugging Face ``GPTNeoForCausalLM``."""

    family = "GPT-Neo"

    def __init__(self, config: Any, *, tp: TPContext | None = None, **overrides: Any) -> None:
        super().__init__(config, {**gptneo_lm_head_kwargs(config), **overrides}, tp=tp)


class GPTNeoXDistributedLMHead(_CausalLM):
    """A ``DistributedTransformerLMHead`` standing in for a Hugging Face ``GPTNeoXForCausalLM``."""

    family = "GPT-NeoX"

    def __init__(self, config: Any, *, tp: TPContext | None = None, **overrides: Any) -> None:
        super().__init__(config, {**gptneox_lm_head_kwargs(config), **overrides}, tp=tp)


def _common_reason(module: nn.Module, activation: str) -> str | None:
    if not whole_stack_requested(module):
        return "whole_stack=False was asked for (its blocks are distributed one by one instead)"
    if any(p.is_meta for p in module.parameters()):
        return (
            "its parameters are on the meta device (delayed parameter initialization): the replacement "
            "copies the weights, so the model stays Hugging Face's (build it without delayed init)"
        )
    if activation not in ACTIVATION_MAP:
        return f"activation_function={activation!r} is not mapped"
    return None


def check_gptj(module: nn.Module, tp_size: int) -> str | None:
    """Why this ``GPTJForCausalLM`` cannot become a DistributedTransformerLMHead, or None."""
    config = cast(Any, module).config
    reason = _common_reason(module, config.activation_function)
    if reason is not None:
        return reason
    if getattr(config, "tie_word_embeddings", False):
        return "tie_word_embeddings=True: GPT-J's distributed LM head is its own (with a bias)"
    inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
    return sizes_reason(tp_size, num_attention_heads=config.n_head, intermediate_size=inner)


def check_gptneo(module: nn.Module, tp_size: int) -> str | None:
    """Why this ``GPTNeoForCausalLM`` cannot become a DistributedTransformerLMHead, or None."""
    config = cast(Any, module).config
    reason = _common_reason(module, config.activation_function)
    if reason is not None:
        return reason
    if not getattr(config, "tie_word_embeddings", True):
        return "tie_word_embeddings=False: GPT-Neo's distributed LM head is the word embedding"
    inner = config.intermediate_size or 4 * config.hidden_size
    return sizes_reason(tp_size, num_heads=config.num_heads, intermediate_size=inner)


def check_gptneox(module: nn.Module, tp_size: int) -> str | None:
    """Why this ``GPTNeoXForCausalLM`` cannot become a DistributedTransformerLMHead, or None."""
    config = cast(Any, module).config
    reason = _common_reason(module, config.hidden_act)
    if reason is not None:
        return reason
    rope = _neox_rope(config)
    if rope["rope_type"] != "default":
        return f"rope_type={rope['rope_type']!r} is not mapped (only the default rotary embedding)"
    head = config.hidden_size // config.num_attention_heads
    if int(head * float(rope["partial_rotary_factor"])) % 2:
        return "the rotary dimension (head size x partial_rotary_factor) is odd"
    return sizes_reason(
        tp_size, num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size
    )


def _build_gptneox(module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
    config = cast(Any, module).config
    new = GPTNeoXDistributedLMHead(config, tp=ctx, **dict(overrides))
    heads, tied = config.num_attention_heads, bool(getattr(config, "tie_word_embeddings", False))
    new.load_full_state_dict(gptneox_to_smp(module.state_dict(), heads, tied))
    # the translations need the head count (query_key_value's rows are ordered by head)
    new.__dict__[REGISTRATION_ATTR] = _bind_gptneox(module)
    return new


def _bind_gptneox(module: nn.Module) -> Registration:
    """GPT-NeoX's registration with its translations bound to this model's head count."""
    config = cast(Any, module).config
    heads, tied = config.num_attention_heads, bool(getattr(config, "tie_word_embeddings", False))
    return Registration(
        GPTNEOX_MODEL,
        GPTNeoXDistributedLMHead,
        builder=_build_gptneox,
        check=check_gptneox,
        to_original=lambda sd: gptneox_from_smp(sd, heads),
        from_original=lambda sd: gptneox_to_smp(sd, heads, tied),
        bind=_bind_gptneox,
    )


def _builder(
    cls: type[HFDistributedLMHead], to_smp: Callable[[Mapping[str, Tensor]], dict[str, Tensor]]
) -> Callable[[nn.Module, TPContext, Mapping[str, Any]], DistributedModule]:
    def build(module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]) -> DistributedModule:
        new = cls(cast(Any, module).config, tp=ctx, **dict(overrides))
        new.load_full_state_dict(to_smp(module.state_dict()))
        return new

    return build


def registrations() -> list[Registration]:
    return [
        Registration(
            GPTJ_MODEL,
            GPTJDistributedLMHead,
            builder=_builder(GPTJDistributedLMHead, gptj_to_smp),
            check=check_gptj,
            to_original=gptj_from_smp,
            from_original=gptj_to_smp,
        ),
        Registration(
            GPTNEO_MODEL,
            GPTNeoDistributedLMHead,
            builder=_builder(GPTNeoDistributedLMHead, gptneo_to_smp),
            check=check_gptneo,
            to_original=gptneo_from_smp,
            from_original=gptneo_to_smp,
        ),
        # its translations are bound to each model's head count by the builder
        Registration(
            GPTNEOX_MODEL,
            GPTNeoXDistributedLMHead,
            builder=_build_gptneox,
            check=check_gptneox,
            bind=_bind_gptneox,
        ),
    ]
