"""The memory savers' errors (checkpoint I/O has its own: ``mp_memory.checkpoint.errors``). Each message
names the value received, what was expected and the fix; the umbrella raises them as smp's classes."""

from __future__ import annotations

__all__ = ["CheckpointArgumentError", "MemorySaverError", "PrecisionError"]


class MemorySaverError(ValueError):
    """Base of the memory savers' user-facing errors."""


class CheckpointArgumentError(MemorySaverError):
    """A bad argument to activation checkpointing (a strategy, a module that is not one)."""


class PrecisionError(MemorySaverError):
    """A bad mixed-precision setting (a dtype, a loss-scale argument)."""
