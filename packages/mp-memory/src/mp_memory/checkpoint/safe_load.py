"""Unpickling checkpoint parts without running code from them.

Parts load with ``torch.load(weights_only=True)``: tensors, numbers, strings, None and containers of
them. That covers model and optimizer state dicts and mp's own metadata (checked here against an
allow-list). Anything else (a user's own classes, or a planted payload) is refused with
UntrustedCheckpointError unless the caller trusts the file: ``trusted=True`` (``trust_file=True`` in the
smp API, or ``weights_only=False`` passed to ``smp.load``) or ``MP_CHECKPOINT_TRUST=1`` in the
environment.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from mp_memory.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMissingError,
    UntrustedCheckpointError,
)
from mp_memory.checkpoint.manifest import verify_file
from mp_memory.checkpoint.publish import PartRecord
from mp_memory.checkpoint.schema import read_header

__all__ = ["TRUST_ENV", "check_metadata", "is_trusted", "load_part"]

TRUST_ENV = "MP_CHECKPOINT_TRUST"


def is_trusted(trusted: bool | None) -> bool:
    """``trusted`` if given, else whether ``MP_CHECKPOINT_TRUST=1``."""
    return bool(trusted) if trusted is not None else os.environ.get(TRUST_ENV, "") in ("1", "true", "yes")


def load_part(
    path: str,
    record: PartRecord | None,
    *,
    map_location: Any = None,
    trusted: bool = False,
    pickle_module: Any = None,
    **load_args: Any,
) -> Any:
    """Read the part at ``path`` (checked against ``record`` when there is one) and unpickle it."""
    source: Any
    if record is not None:
        # Checked in place, then loaded through a memory map (the part is published by rename and never
        # rewritten in place, so the mapping stays valid): no copy of its bytes on the way.
        verify_file(path, record)
        source, size = path, record.size
        args_extra: dict[str, Any] = {"mmap": True}
    else:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            raise CheckpointMissingError(f"checkpoint file {path!r} does not exist") from None
        if not data:
            raise CheckpointCorruptError(f"checkpoint file {path!r} is empty (0 bytes): a save was cut short")
        source, size, args_extra = io.BytesIO(data), len(data), {}
    args = {**load_args, **args_extra}
    if trusted:
        args["weights_only"] = False
        if pickle_module is not None:
            args["pickle_module"] = pickle_module
    else:
        args["weights_only"] = True
    try:
        return torch.load(source, map_location=map_location, **args)
    except pickle.UnpicklingError as exc:
        if trusted:
            raise CheckpointCorruptError(f"checkpoint file {path!r} cannot be unpickled: {exc}") from exc
        raise UntrustedCheckpointError(
            f"checkpoint file {path!r} holds objects other than tensors, numbers, strings and containers "
            f"(torch.load(weights_only=True) refused: {str(exc).splitlines()[0]}). Loading it would run "
            "code from the file. If you trust the file, pass trust_file=True (smp.resume_from_checkpoint) "
            f"or weights_only=False (smp.load), or set {TRUST_ENV}=1"
        ) from exc
    except CheckpointError:
        raise
    except Exception as exc:  # EOFError, zip errors, OSError 22, MemoryError on a torn length ...
        raise CheckpointCorruptError(
            f"checkpoint file {path!r} is damaged: torch.load failed with {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''} ({size} bytes). Restore it, or load an "
            "older checkpoint"
        ) from exc


def check_metadata(obj: Any, path: str) -> None:
    """Refuse a state dict whose mp entries are not the records mp writes
    (:func:`mp_memory.checkpoint.schema.read_header`)."""
    if not isinstance(obj, dict):
        return
    try:
        read_header(obj)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"checkpoint file {path!r}: {exc}") from None
