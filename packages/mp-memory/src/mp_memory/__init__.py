"""Memory savers for mp: activation checkpointing and offloading, sharding, delayed initialization, mixed precision, checkpoints."""

__version__ = "0.1.0"
