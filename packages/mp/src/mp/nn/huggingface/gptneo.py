"""``smp.nn.huggingface.gptneo``: smp's GPT-Neo translations. mp keeps Hugging Face's parameter names for
GPT-Neo blocks (smp's distributed-transformer layout is not built), so both functions raise
:class:`mp_tensor.errors.HFTranslationError` saying so."""

from mp_tensor.hf.translate import unsupported

__all__ = ["translate_hf_state_dict_to_smdistributed_gptneo", "translate_state_dict_to_hf_gptneo"]

translate_state_dict_to_hf_gptneo = unsupported("gptneo")
translate_hf_state_dict_to_smdistributed_gptneo = unsupported("gptneo")
