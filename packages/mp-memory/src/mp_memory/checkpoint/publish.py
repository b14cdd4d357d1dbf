"""Atomic, durable files: write under a temporary name, fsync, rename, fsync the folder.

A crash at any point leaves either the old file or the new one under the final name, never a torn one;
what it leaves under a temporary name (``*.tmp-*``) is removed by :func:`remove_stale`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import uuid
from typing import Any

import torch

from mp_memory.checkpoint.errors import CheckpointWriteError
from mp_memory.checkpoint.faults import fault_point
from mp_memory.checkpoint.zipcheck import PartRecord, directory_record

__all__ = [
    "TMP_MARK",
    "PartRecord",
    "fsync_dir",
    "publish_file",
    "remove_stale",
    "replace_dir",
    "tmp_name",
    "write_part",
    "write_text",
]

TMP_MARK = ".tmp-"
"""Every temporary name holds this mark (and nothing mp publishes does)."""


def tmp_name(target: str, rank: int) -> str:
    """A temporary name next to ``target``, private to this writer (global ``rank``)."""
    return f"{target}{TMP_MARK}r{rank}-{uuid.uuid4().hex[:8]}"


def fsync_dir(folder: str) -> None:
    """Make a rename or unlink in ``folder`` durable."""
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What torch's zip writer says when a write fails (it hides the OSError: "basic_ios::clear: iostream
# error", "PytorchStreamWriter failed writing file data/0: file write failed").
_WRITE_FAILED = ("iostream error", "failed writing", "file write failed", "unexpected pos")


def _tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """The bytes of the distinct tensor storages in ``obj`` (nested dicts, lists, tuples)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes())
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def write_error(exc: BaseException, path: str, rank: int, nbytes: int) -> CheckpointWriteError | None:
    """The readable error for a failed write of at least ``nbytes`` to ``path`` (None when ``exc`` is not a
    write failure: an unpicklable object, say): the path, the rank, the bytes and the space left."""
    if not isinstance(exc, OSError) and not (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in _WRITE_FAILED)
    ):
        return None
    folder = os.path.dirname(path) or "."
    try:
        free: int | None = shutil.disk_usage(folder).free
        space = f"{free:,} bytes free"
    except OSError as usage_error:
        free, space = None, f"free space unknown ({usage_error})"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, RuntimeError):  # torch's writer hides the OSError: say what likely caused it
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if free is not None and free < nbytes + (1 << 20):
            reason = f"the filesystem is full (torch: {reason})"
        elif limit != resource.RLIM_INFINITY and limit < nbytes + (1 << 20):
            reason = f"the file size limit (ulimit -f) is {limit:,} bytes (torch: {reason})"
        else:
            reason = f"torch's writer failed ({reason})"
    return CheckpointWriteError(
        f"rank {rank} could not write checkpoint file {path!r}: {reason} (at least {nbytes:,} bytes to "
        f"write; {space} in {folder!r}). Fix: free space there or choose another folder (check the quota "
        "and `ulimit -f` too); the checkpoints saved before this one are untouched."
    )


def write_part(obj: Any, path: str, rank: int, **torch_save_args: Any) -> PartRecord:
    """``torch.save(obj)`` to ``path`` (a temporary or staging name) durably; return its record (size
    and the CRC-32 of the zip directory, whose per-record CRC-32s torch's writer computed). Removes
    ``path`` on failure; a failed write (a full disk) raises CheckpointWriteError."""
    try:
        record = _write_part(obj, path, rank, **torch_save_args)
    except (OSError, RuntimeError) as exc:
        readable = write_error(exc, path, rank, _tensor_bytes(obj))
        if readable is None:
            raise
        raise readable from exc
    fault_point("part-written", rank)
    return record


def _write_part(obj: Any, path: str, rank: int, **torch_save_args: Any) -> PartRecord:
    try:
        torch.save(obj, path, **torch_save_args)
        if os.environ.get("MP_CHECKPOINT_FAULT") == f"part-half:{rank}":
            # The fault hook: die with half of the file written (the test's "kill -9 mid-write").
            os.truncate(path, os.path.getsize(path) // 2)
            fault_point("part-half", rank)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        return directory_record(path)
    except BaseException:
        if os.path.exists(path):
            os.remove(path)
        raise


def publish_file(path: str, target: str) -> None:
    """Rename a durable temporary file to its final name, durably."""
    os.replace(path, target)
    fsync_dir(os.path.dirname(target))


def write_text(target: str, text: str, rank: int) -> None:
    """Write a small text file atomically and durably (``newest``, manifests)."""
    path = tmp_name(target, rank)
    try:
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            readable = write_error(exc, path, rank, len(text.encode()))
            assert readable is not None  # every OSError is a write failure
            raise readable from exc
        os.replace(path, target)
        fsync_dir(os.path.dirname(target))
    finally:
        if os.path.exists(path):
            os.remove(path)


def replace_dir(staging: str, target: str, rank: int) -> None:
    """Publish the folder ``staging`` as ``target``, replacing any folder of that name.

    Two renames (the old folder aside, the new one in place) and a removal; a crash between them leaves
    the old folder under a temporary name, which :func:`remove_stale` removes."""
    parent = os.path.dirname(target)
    aside = None
    if os.path.exists(target):
        aside = tmp_name(target, rank)
        os.replace(target, aside)
    os.replace(staging, target)
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_stale(folder: str, prefix: str = "", rank: int | None = None) -> list[str]:
    """Remove what torn saves left in ``folder``: temporary files and folders of names starting with
    ``prefix`` (any when empty), those of writer ``rank`` only when given (a rank has one save in flight,
    so its own are stale; other ranks' may be in flight). Returns the names removed."""
    removed: list[str] = []
    if not os.path.isdir(folder):
        return removed
    own = None if rank is None else f"{TMP_MARK}r{rank}-"
    for name in os.listdir(folder):
        if TMP_MARK not in name or not name.startswith(prefix) or (own is not None and own not in name):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        removed.append(name)
    return removed
