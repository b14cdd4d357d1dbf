"""``smp.nn.huggingface.gptneo``: HF GPT-Neo <-> ``DistributedTransformerLMHead`` state dicts (full), the
layout of the distributed GPT-Neo that ``smp.tensor_parallelism()`` builds
(:mod:`mp_tensor.hf.translate_gpt`)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mp_tensor import gptneo_from_smp, gptneo_lm_head_kwargs, gptneo_to_smp

__all__ = [
    "gptneo_lm_head_kwargs",
    "translate_hf_gptneo_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptneo",
    "translate_state_dict_to_hf_gptneo",
]


def translate_state_dict_to_hf_gptneo(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """A ``DistributedTransformerLMHead`` state dict -> an HF ``GPTNeoForCausalLM`` one. ``max_seq_len``
    adds the causal-mask buffers older transformers saved (leave None for current transformers)."""
    return gptneo_from_smp(state_dict, max_seq_len)


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF ``GPTNeoForCausalLM`` state dict -> the ``DistributedTransformerLMHead`` layout."""
    return gptneo_to_smp(state_dict)


def translate_hf_gptneo_state_dict_to_smdistributed(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """smp's older name of :func:`translate_hf_state_dict_to_smdistributed_gptneo` (``max_seq_len``
    unused, as in smp)."""
    return gptneo_to_smp(state_dict)
