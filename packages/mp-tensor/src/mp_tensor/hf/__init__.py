"""Hugging Face transformers blocks mapped to mp's distributed transformer layer (GPT-2, BERT, RoBERTa).

Nothing here imports ``transformers``: the blocks are matched by class name and read through their
attributes, so the mappings cost nothing when transformers is not used.
"""
