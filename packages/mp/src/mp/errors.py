"""The smp exception hierarchy, under smp's names so that scripts written for smp can catch them.

The tree follows smdistributed.modelparallel v1 (docs/api.md):

- ``SMPValidationError(ValueError)`` for bad input and misuse, ``SMPConfigError(ValueError)`` for
  configuration problems;
- ``SMPUnsupportedError(RuntimeError)`` for features or combinations that are not supported;
- ``SMPRuntimeError(RuntimeError)`` for failures while running a step.

mp adds :class:`ConfigError`, the error every configuration check raises. It derives from both
``SMPInvalidArgumentError`` (what smp raised for a bad config) and ``SMPConfigError``, so a handler for
either smp class, or for plain ``ValueError``, catches it.
"""

from __future__ import annotations

from mp_memory import CheckpointCorruptError, UntrustedCheckpointError

# Raised by the packages below the facade, which cannot import mp; re-exported under smp's names so
# `except smp.InvalidPartitionIDError` works. They subclass ValueError / RuntimeError as smp's do.
from mp_partition import InvalidPartitionIDError
from mp_pipeline import InvalidStepOutputError
from mp_tensor import (
    DistEmbeddingConfigError,
    DistTransformerConfigError,
    TPModuleRegisterError,
    UnsupportedTPModuleError,
)

__all__ = [
    "BwdExecutionNotInStepFnError",
    "CheckpointingConfigError",
    "CommGroupConfigError",
    "ConfigError",
    "CorruptCheckpointError",
    "DDPNotEnabledError",
    "DelayedParamDeviceError",
    "DistEmbeddingConfigError",
    "DistTransformerConfigError",
    "DistributedModelNotWrappedError",
    "DistributedModelWrappedError",
    "FullHalfStateUnderTPError",
    "FwdExecutionNotInStepFnError",
    "IncompatibleCheckpointFoundError",
    "IncompatibleCheckpointRankFoundError",
    "InvalidPartitionIDError",
    "InvalidStepOutputError",
    "MissingCheckpointFilesError",
    "ModelNotPartitionedError",
    "MultipleDistributedModelError",
    "MultipleDtypeOptShardingError",
    "NotInitializedError",
    "NotSupportedByFastModeError",
    "RealSmdistributedError",
    "SMPCheckpointError",
    "SMPConfigError",
    "SMPInvalidArgumentError",
    "SMPRuntimeError",
    "SMPUnsupportedError",
    "SMPValidationError",
    "StepFunctionCalledError",
    "TPModuleRegisterError",
    "TensorSplitError",
    "UnsupportedTPModuleError",
    "UntrustedCheckpointFileError",
    "WorkerSizeError",
]


# --------------------------------------------------------------------------------------------- roots
class SMPValidationError(ValueError):
    """Bad input or API misuse detected before anything runs."""


class SMPConfigError(ValueError):
    """A configuration problem (smp's second ValueError root)."""


class SMPUnsupportedError(RuntimeError):
    """A feature, module or combination of options that is not supported."""


class SMPRuntimeError(RuntimeError):
    """A failure while running a step."""


# ------------------------------------------------------------------------------ validation errors
class SMPInvalidArgumentError(SMPValidationError):
    """An argument or config value is invalid."""


class ConfigError(SMPInvalidArgumentError, SMPConfigError):
    """A configuration key or value is invalid; ``key`` and ``value`` name what was received.

    ``key`` is the config key as the user wrote it (None when the problem is the config source as a
    whole, e.g. an unreadable file), ``value`` the value received; ``allowed`` and ``fix`` repeat the
    parts of the message that say what is allowed and how to fix it.
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        value: object = None,
        allowed: str | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.allowed = allowed
        self.fix = fix

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str | None, object, str | None, str | None]]:
        return (type(self), (str(self), self.key, self.value, self.allowed, self.fix))


_NOT_INITIALIZED = "smp is not initialized! Call smp.init(config) first."


class NotInitializedError(SMPValidationError):
    """An smp function that needs ``smp.init`` was called before it."""

    def __init__(self, message: str = _NOT_INITIALIZED) -> None:
        super().__init__(message)


class WorkerSizeError(SMPValidationError):
    """The number of processes does not fit the parallelism degrees or the local devices."""


class CommGroupConfigError(SMPValidationError):
    """A communication group argument is not a ``CommGroup``."""


class MultipleDistributedModelError(SMPValidationError):
    """More than one ``DistributedModel`` was created in one process."""


class FwdExecutionNotInStepFnError(SMPValidationError):
    """The distributed model's forward ran outside an ``@smp.step`` function."""


class BwdExecutionNotInStepFnError(SMPValidationError):
    """``model.backward`` ran outside an ``@smp.step`` function."""


class ModelNotPartitionedError(SMPValidationError):
    """An operation needs the model partitioned, which happens in the first step."""


class DistributedModelNotWrappedError(SMPValidationError):
    """An operation needs the model wrapped in ``DistributedModel`` first."""


class DistributedModelWrappedError(SMPValidationError):
    """An operation must happen before the model is wrapped in ``DistributedModel``."""


class StepFunctionCalledError(SMPValidationError):
    """An operation must happen before the first ``@smp.step`` call."""


class CheckpointingConfigError(SMPValidationError):
    """Invalid activation checkpointing arguments."""


class SMPCheckpointError(SMPValidationError):
    """A checkpoint cannot be saved or loaded as asked."""


class FullHalfStateUnderTPError(SMPCheckpointError, SMPUnsupportedError):
    """The full fp16/bf16 optimizer state under tensor parallelism (an unsupported combination, so also
    an SMPUnsupportedError): only the partial state is saved and loaded there."""


class MissingCheckpointFilesError(SMPCheckpointError):
    """Some of the partial checkpoint files for this layout are missing."""


class IncompatibleCheckpointRankFoundError(SMPCheckpointError):
    """A partial checkpoint file belongs to a rank that does not exist in this layout."""


class IncompatibleCheckpointFoundError(SMPCheckpointError):
    """A checkpoint was written for a layout or format that cannot be loaded here."""


# smp has no names for these two; each is smp's SMPCheckpointError and mp-memory's error at once.
class CorruptCheckpointError(SMPCheckpointError, CheckpointCorruptError):
    """A checkpoint file is missing bytes, empty or altered (its size or CRC-32 differs from the
    manifest's), or cannot be unpickled (mp)."""


class UntrustedCheckpointFileError(SMPCheckpointError, UntrustedCheckpointError):
    """A checkpoint file holds objects that only a trusted load (which can run code) rebuilds (mp)."""


class PartitionFileError(SMPValidationError):
    """The ``partition_file`` is missing or unreadable, or does not fit the model and layout (mp)."""


# ----------------------------------------------------------------------------- unsupported errors
class NotSupportedByFastModeError(SMPUnsupportedError):
    """The graph changed between steps, which fast mode does not support; set 'fast_mode' to False."""


class DelayedParamDeviceError(SMPUnsupportedError):
    """Parameter must be on CPU for delayed initialization."""


class MultipleDtypeOptShardingError(SMPUnsupportedError):
    """Optimizer state sharding needs one dtype across all parameters."""


class DDPNotEnabledError(SMPUnsupportedError):
    """The operation needs data parallelism (the ``ddp`` config key) enabled."""


# --------------------------------------------------------------------------------- runtime errors
class TensorSplitError(SMPRuntimeError):
    """Step inputs cannot be split into microbatches as asked."""


# --------------------------------------------------------------------------------- import errors
class RealSmdistributedError(ImportError):
    """mp's ``smdistributed`` alias would shadow a real smdistributed.modelparallel install."""
