"""``smp.nn.huggingface.gptneox``: HF GPT-NeoX <-> ``DistributedTransformerLMHead`` state dicts (full), the
layout of the distributed GPT-NeoX that ``smp.tensor_parallelism()`` builds
(:mod:`mp_tensor.hf.translate_gpt`). ``query_key_value`` orders its rows by head, so the translations need
the model's ``num_attention_heads`` (smp read it from the model it had built; pass it here)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mp_tensor import gptneox_from_smp, gptneox_lm_head_kwargs, gptneox_to_smp

__all__ = [
    "gptneox_lm_head_kwargs",
    "translate_hf_state_dict_to_smdistributed_gptneox",
    "translate_state_dict_to_hf_gptneox",
]


def translate_state_dict_to_hf_gptneox(
    state_dict: Mapping[str, Tensor], num_attention_heads: int
) -> dict[str, Tensor]:
    """A ``DistributedTransformerLMHead`` state dict -> an HF ``GPTNeoXForCausalLM`` one."""
    return gptneox_from_smp(state_dict, num_attention_heads)


def translate_hf_state_dict_to_smdistributed_gptneox(
    state_dict: Mapping[str, Tensor], num_attention_heads: int, tied: bool | None = None
) -> dict[str, Tensor]:
    """An HF ``GPTNeoXForCausalLM`` state dict -> the ``DistributedTransformerLMHead`` layout (``tied``:
    the config's ``tie_word_embeddings``; None: when ``lm_head.weight`` shares the embedding's storage)."""
    return gptneox_to_smp(state_dict, num_attention_heads, tied)
