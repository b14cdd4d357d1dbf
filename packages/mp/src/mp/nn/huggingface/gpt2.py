"""``smp.nn.huggingface.gpt2``: HF GPT-2 <-> ``DistributedTransformerLMHead`` state dicts (full)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mp_tensor import gpt2_from_smp, gpt2_lm_head_kwargs, gpt2_to_smp

__all__ = [
    "gpt2_lm_head_kwargs",
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_state_dict_to_hf_gpt2",
]


def translate_state_dict_to_hf_gpt2(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """A ``DistributedTransformerLMHead`` state dict -> an HF ``GPT2LMHeadModel`` one. ``max_seq_len``
    adds the causal-mask buffers transformers < 4.31 saved (leave None for current transformers)."""
    return gpt2_from_smp(state_dict, max_seq_len)


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF ``GPT2LMHeadModel``/``GPT2Model`` state dict -> the ``DistributedTransformerLMHead`` layout."""
    return gpt2_to_smp(state_dict)
