"""``smp.nn.huggingface.gptj``: smp's GPT-J translations. mp keeps Hugging Face's parameter names for
GPT-J blocks (smp's distributed-transformer layout is not built), so both functions raise
:class:`mp_tensor.errors.HFTranslationError` saying so."""

from mp_tensor.hf.translate import unsupported

__all__ = ["translate_hf_gptj_state_dict_to_smdistributed_gptj", "translate_state_dict_to_hf_gptj"]

translate_state_dict_to_hf_gptj = unsupported("gptj")
translate_hf_gptj_state_dict_to_smdistributed_gptj = unsupported("gptj")
