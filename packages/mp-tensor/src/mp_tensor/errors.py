"""Exceptions raised by mp_tensor's distributed modules, registry and replacement.

The names follow smp's (docs/api.md), so the umbrella can expose them under smp's names.
Every user-facing error names the value it received, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "DistEmbeddingConfigError",
    "DistTransformerConfigError",
    "HFTranslationError",
    "MPTensorError",
    "NoTPContextError",
    "TPInputError",
    "TPModuleRegisterError",
    "UnsupportedTPModuleError",
]


class MPTensorError(Exception):
    """Base class of every error raised by mp_tensor (outside ``mp_tensor.atp``)."""


class DistTransformerConfigError(ValueError, MPTensorError):
    """A distributed transformer module got arguments it cannot implement (smp's name)."""


class DistEmbeddingConfigError(ValueError, MPTensorError):
    """A ``DistributedEmbedding`` got arguments it cannot implement (smp's name)."""


class HFTranslationError(ValueError, MPTensorError):
    """A state dict handed to an ``smp.nn.huggingface`` translate function is not in the expected layout,
    or names a model family that has no mp layout."""


class TPModuleRegisterError(RuntimeError, MPTensorError):
    """``tp_register`` got something that is not a DistributedModule, or a bad hook (smp's name)."""


class UnsupportedTPModuleError(RuntimeError, MPTensorError):
    """A module was asked to be distributed but has no distributed implementation (smp's name)."""


class NoTPContextError(RuntimeError, MPTensorError):
    """A distributed module was built with no tensor-parallel group to run in."""


class TPInputError(ValueError, MPTensorError):
    """A distributed module's forward got a tensor whose shape or layout it cannot distribute."""
