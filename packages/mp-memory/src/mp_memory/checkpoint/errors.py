"""The checkpoint errors of mp-memory. The umbrella (``mp``) raises them as smp's exception classes."""

from __future__ import annotations

__all__ = [
    "CheckpointAgreementError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLayoutError",
    "CheckpointMissingError",
    "CheckpointWriteError",
    "UntrustedCheckpointError",
]


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded as asked."""


class CheckpointMissingError(CheckpointError):
    """A checkpoint, or some of its parts, does not exist (or its save never completed)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file exists but is truncated, empty or damaged (size or checksum mismatch)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint file failed (a full disk, a quota, a file size limit, an I/O error)."""


class CheckpointAgreementError(CheckpointError):
    """The ranks of a save or load could not agree: the collective over their group itself failed (a
    rank ended, crashed or was killed during the save, or the network between them failed)."""


class CheckpointLayoutError(CheckpointError):
    """A checkpoint was written for a layout that cannot be loaded here.

    ``larger``: the checkpoint has parts for ranks this layout does not have."""

    def __init__(self, message: str, *, larger: bool = False) -> None:
        super().__init__(message)
        self.larger = larger


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file holds objects that only a trusted (code-running) load could rebuild."""
