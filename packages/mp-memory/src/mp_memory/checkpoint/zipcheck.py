"""Integrity of a part through the checksums torch already writes.

``torch.save`` writes a zip archive (stored, not compressed) whose central directory holds the CRC-32
of every record, computed by torch's writer as it goes. So a save needs no checksum pass of its own:
the manifest records the part's size and the CRC-32 of its central directory (a few kB at the end of
the file). Loading checks the size, the directory's CRC-32, then every record's bytes against the
CRC-32 the directory lists (through a memory map: no copy). A flipped bit anywhere in the file fails one
of these; truncation fails the size.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from mp_memory.checkpoint.errors import CheckpointCorruptError

__all__ = ["PartRecord", "check_records", "directory_record"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


@dataclass(frozen=True)
class PartRecord:
    """What a published part must be: its size in bytes and the CRC-32 of its zip central directory."""

    size: int
    crc32: int


def _damaged(path: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint part {path!r} is corrupted: {why} (bytes changed after the save: disk, copy or edit). "
        "Restore it, or load an older checkpoint"
    )


def _directory(path: str, fh: BinaryIO) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise _damaged(path, f"its zip directory cannot be read ({exc})") from exc


def directory_record(path: str) -> PartRecord:
    """The record of a part just written by ``torch.save`` (reads only its directory)."""
    with open(path, "rb") as fh:
        start: int = _directory(path, fh).start_dir
        fh.seek(start)
        crc = zlib.crc32(fh.read())
    return PartRecord(os.path.getsize(path), crc)


def check_records(path: str, record: PartRecord) -> None:
    """Check the directory's CRC-32 against ``record`` and every record's bytes against the directory
    (the size is checked by the caller)."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
        archive = _directory(path, fh)
        start: int = archive.start_dir
        crc = zlib.crc32(view[start:])
        if crc != record.crc32:
            raise _damaged(
                path, f"its zip directory's CRC-32 is {crc:#010x}, the manifest says {record.crc32:#010x}"
            )
        for info in archive.infolist():
            header = _LOCAL_HEADER.unpack_from(view, info.header_offset)
            if header[0] != _LOCAL_MAGIC or info.compress_type != zipfile.ZIP_STORED:
                raise _damaged(path, f"the header of record {info.filename!r} is damaged")
            begin = info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
            with memoryview(view)[begin : begin + info.compress_size] as data:
                got = zlib.crc32(data)
            if got != info.CRC:
                raise _damaged(
                    path,
                    f"its CRC-32 is {got:#010x} in record {info.filename!r}, whose directory entry says "
                    f"{info.CRC:#010x}",
                )
