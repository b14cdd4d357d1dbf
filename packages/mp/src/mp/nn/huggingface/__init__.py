"""``smp.nn.huggingface``: smp's Hugging Face state-dict translations, one module per family
(``gpt2``, ``bert``, ``roberta``, ``gptj``, ``gptneo``, ``gptneox``). See :mod:`mp_tensor.hf.translate`."""

from mp.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox, roberta

__all__ = ["bert", "gpt2", "gptj", "gptneo", "gptneox", "roberta"]
