"""Atomic, durable files: write under a temporary name, fsync, rename, fsync the folder.

A crash at any point leaves either the old file or the new one under the final name, never a torn one;
what it leaves under a temporary name (``*.tmp-*``) is removed by :func:`remove_stale`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch

from mp_memory.checkpoint.faults import fault_point

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


@dataclass(frozen=True)
class PartRecord:
    """What a published part must be: its size in bytes and the CRC-32 of its bytes."""

    size: int
    crc32: int


class _CrcWriter(io.RawIOBase):
    """A write-only stream that checksums and counts what passes through it to ``fh``."""

    def __init__(self, fh: IO[bytes], on_half: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.fh, self.crc, self.size = fh, 0, 0
        self._on_half = on_half

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._on_half is not None and self.size > 0:
            # The fault hook: die with part of the file written (the test's "kill -9 mid-write").
            self.fh.write(view[: len(view) // 2])
            self.fh.flush()
            self._on_half()
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return self.fh.write(view)

    def flush(self) -> None:
        self.fh.flush()


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
    """``torch.save(obj)`` to ``path`` (a temporary or staging name) durably; return its size and
    checksum, computed on the bytes as they are written (one pass). Removes ``path`` on failure."""
    try:
        with open(path, "wb") as fh:
            writer = _CrcWriter(fh, _half_fault(rank))
            torch.save(obj, writer, **torch_save_args)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        if os.path.exists(path):
            os.remove(path)
        raise
    fault_point("part-written", rank)
    return PartRecord(writer.size, writer.crc)


def publish_file(path: str, target: str) -> None:
    """Rename a durable temporary file to its final name, durably."""
    os.replace(path, target)
    fsync_dir(os.path.dirname(target))


def _half_fault(rank: int) -> Callable[[], None] | None:
    if os.environ.get("MP_CHECKPOINT_FAULT") != f"part-half:{rank}":
        return None
    return lambda: fault_point("part-half", rank)


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
