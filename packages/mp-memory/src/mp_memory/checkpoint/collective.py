"""Agreement between the ranks of a save: every rank learns whether any failed, and what each reported."""

from __future__ import annotations

import contextlib
import importlib
import traceback
from typing import Any

import torch.distributed as dist

from mp_memory.checkpoint.errors import CheckpointAgreementError, CheckpointError

__all__ = ["agree"]


def agree(error: BaseException | None, payload: Any, group: Any, what: str, rank: int) -> list[Any]:
    """All-gather ``payload`` over ``group`` (None: this process alone) and raise on every rank if any
    rank passed an ``error``, naming the ranks and their errors. Returns the payloads in group order.

    Every rank raises the same class: that of the first failing rank's checkpoint error (a ValueError,
    as ``CorruptCheckpointError``), so that ``except smp.CorruptCheckpointError`` catches it on every
    rank and not only where the file was read; any other failure is raised as a ``CheckpointError``.

    When the all-gather itself fails (a rank of the group ended mid-save: gloo reports "Connection closed
    by peer"), this rank raises :class:`CheckpointAgreementError` naming ``what`` and the failure: a
    checkpoint error like the others, so that a background save's failure is reported as one (and ends
    the process with status 1 at exit) instead of escaping as a bare RuntimeError."""
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [payload]
    text = kind = None
    if error is not None:
        text = f"rank {rank}: {type(error).__name__}: {error}"
        if isinstance(error, ValueError):  # a checkpoint error: its class travels (by name)
            kind = (type(error).__module__, type(error).__qualname__)
        else:  # an unexpected failure: where it happened
            text += "\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__))
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, (text, kind, payload), group=group)
    except RuntimeError as exc:  # torch.distributed's errors (DistError, gloo's) are RuntimeErrors
        raise CheckpointAgreementError(
            f"{what}: rank {rank} could not agree with the other ranks ({type(exc).__name__}: "
            f"{str(exc).strip()[:500]}); expected every rank of the group to take part. A rank probably "
            "ended (crashed or was killed) during it, or the network between them failed; newest still "
            "names the last complete checkpoint. Fix: see that rank's own output for why it ended, then "
            "resume from newest"
        ) from exc
    failed = [(t, k) for t, k, _ in out if t is not None]
    if failed:
        message = f"{what} failed on {len(failed)} rank(s):\n" + "\n".join(t for t, _ in failed)
        combined = _agreed_error(failed[0][1], message)
        if error is None:
            raise combined
        raise combined from error
    return [p for _, _, p in out]


def _agreed_error(kind: tuple[str, str] | None, message: str) -> Exception:
    """The failing rank's error class (named by module and qualified name) with the agreed message; a
    CheckpointError where that class cannot be found here or made from a message alone."""
    if kind is not None:
        with contextlib.suppress(Exception):
            cls: Any = importlib.import_module(kind[0])
            for part in kind[1].split("."):
                cls = getattr(cls, part)
            if isinstance(cls, type) and issubclass(cls, Exception):
                made = cls(message)
                if str(made) == message:  # a class whose constructor rewrites the message is not used
                    return made
    return CheckpointError(message)
