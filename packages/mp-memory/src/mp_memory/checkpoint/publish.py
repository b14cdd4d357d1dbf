"""Atomic, durable files: write under a temporary name, fsync, rename, fsync the folder.

A crash at any point leaves either the old file or the new one under the final name, never a torn one;
what it leaves under a temporary name (``*.tmp-*``) is removed by :func:`remove_stale`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Any

import torch

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


def write_part(obj: Any, path: str, rank: int, **torch_save_args: Any) -> PartRecord:
    """``torch.save(obj)`` to ``path`` (a temporary or staging name) durably; return its record (size
    and the CRC-32 of the zip directory, whose per-record CRC-32s torch's writer computed). Removes
    ``path`` on failure."""
    try:
        torch.save(obj, path, **torch_save_args)
        if os.environ.get("MP_CHECKPOINT_FAULT") == f"part-half:{rank}":
            # The fault hook: die with half of the file written (the test's "kill -9 mid-write").
            os.truncate(path, os.path.getsize(path) // 2)
            fault_point("part-half", rank)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        record = directory_record(path)
    except BaseException:
        if os.path.exists(path):
            os.remove(path)
        raise
    fault_point("part-written", rank)
    return record


def publish_file(path: str, target: str) -> None:
    """Rename a durable temporary file to its final name, durably."""
    os.replace(path, target)
    fsync_dir(os.path.dirname(target))


def write_text(target: str, text: str, rank: int) -> None:
    """Write a small text file atomically and durably (``newest``, manifests)."""
    path = tmp_name(target, rank)
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
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
