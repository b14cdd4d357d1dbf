"""Hugging Face transformers blocks mapped to mp's distributed layers (GPT-2, BERT, RoBERTa, Llama,
Mistral, Qwen2/3, GPT-NeoX, GPT-Neo, GPT-J, T5, ViT), and smp's state-dict translations
(:mod:`mp_tensor.hf.translate`).

Nothing here imports ``transformers``: the blocks are matched by class name and read through their
attributes, so the mappings cost nothing when transformers is not used.
"""
