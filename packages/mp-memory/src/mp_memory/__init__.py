"""mp-memory: the memory savers of mp.

Activation checkpointing and offloading, optimizer-state and parameter sharding, delayed parameter
initialization, mixed precision, and checkpoint save/load with resharding (not built yet: this
distribution holds only its name and version so far).
"""

__version__ = "0.1.0"
