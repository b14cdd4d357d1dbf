"""mp-memory: the memory savers of mp.

Activation checkpointing and offloading, optimizer-state and parameter sharding, delayed parameter
initialization, mixed precision, and checkpoint save/load with resharding. Built so far:
``mp_memory.activation`` (activation checkpointing on torch.utils.checkpoint).
"""

__version__ = "0.1.0"
