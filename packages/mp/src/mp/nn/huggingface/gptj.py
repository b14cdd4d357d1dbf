"""``smp.nn.huggingface.gptj``: HF GPT-J <-> ``DistributedTransformerLMHead`` state dicts (full), the layout
of the distributed GPT-J that ``smp.tensor_parallelism()`` builds (:mod:`mp_tensor.hf.translate_gpt`)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mp_tensor import gptj_from_smp, gptj_lm_head_kwargs, gptj_to_smp

__all__ = [
    "gptj_lm_head_kwargs",
    "translate_hf_gptj_state_dict_to_smdistributed",
    "translate_hf_gptj_state_dict_to_smdistributed_gptj",
    "translate_state_dict_to_hf_gptj",
]


def translate_state_dict_to_hf_gptj(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """A ``DistributedTransformerLMHead`` state dict -> an HF ``GPTJForCausalLM`` one. ``max_seq_len``
    adds the causal-mask buffers older transformers saved (leave None for current transformers)."""
    return gptj_from_smp(state_dict, max_seq_len)


def translate_hf_gptj_state_dict_to_smdistributed_gptj(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF ``GPTJForCausalLM`` state dict -> the ``DistributedTransformerLMHead`` layout."""
    return gptj_to_smp(state_dict)


def translate_hf_gptj_state_dict_to_smdistributed(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """smp's older name of :func:`translate_hf_gptj_state_dict_to_smdistributed_gptj` (``max_seq_len``
    unused, as in smp)."""
    return gptj_to_smp(state_dict)
