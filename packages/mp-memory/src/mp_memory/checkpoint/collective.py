"""Agreement between the ranks of a save: every rank learns whether any failed, and what each reported."""

from __future__ import annotations

import contextlib
import traceback
from typing import Any

import torch.distributed as dist

from mp_memory.checkpoint.errors import CheckpointError

__all__ = ["agree"]


def agree(error: BaseException | None, payload: Any, group: Any, what: str, rank: int) -> list[Any]:
    """All-gather ``payload`` over ``group`` (None: this process alone) and raise on every rank if any
    rank passed an ``error``, naming the ranks and their errors. Returns the payloads in group order."""
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [payload]
    text = None
    if error is not None:
        text = f"rank {rank}: {type(error).__name__}: {error}"
        if not isinstance(error, ValueError):  # an unexpected failure: where it happened
            text += "\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__))
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (text, payload), group=group)
    failed = [t for t, _ in out if t is not None]
    if failed:
        message = f"{what} failed on {len(failed)} rank(s):\n" + "\n".join(failed)
        if error is None:
            raise CheckpointError(message)
        combined: Exception = CheckpointError(message)
        if isinstance(error, ValueError):  # a checkpoint error: keep this rank's kind (smp's classes)
            with contextlib.suppress(Exception):
                combined = type(error)(message)
        raise combined from error
    return [p for _, p in out]
