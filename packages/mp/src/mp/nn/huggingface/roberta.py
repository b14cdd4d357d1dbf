"""``smp.nn.huggingface.roberta``: HF RoBERTa <-> the same with the encoder as a ``DistributedTransformer``
(``encoder.layer.<i>`` <-> ``encoder.seq_layers.<i>``), full unsharded state dicts."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mp_tensor import bert_from_smp, bert_to_smp

__all__ = ["translate_hf_state_dict_to_smdistributed_roberta", "translate_state_dict_to_hf_roberta"]


def translate_state_dict_to_hf_roberta(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """mp's layout -> HF's. ``max_seq_len`` adds ``embeddings.position_ids``, which transformers < 4.31
    saved (leave None for current transformers)."""
    return bert_from_smp(state_dict, max_seq_len, family="roberta")


def translate_hf_state_dict_to_smdistributed_roberta(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HF's layout -> mp's."""
    return bert_to_smp(state_dict, family="roberta")
