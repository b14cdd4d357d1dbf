"""The manifest: the last file a save writes, listing every part with its size and CRC-32.

A checkpoint is complete exactly when its manifest says ``"state": "complete"``. Loading checks each part
against it before unpickling anything, so a missing, empty, truncated or altered part is named with
what is wrong instead of surfacing as ``EOFError`` or silently wrong weights. The manifest is JSON: it is
read without running code, and only the fields below are accepted.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from mp_memory.checkpoint.errors import CheckpointCorruptError, CheckpointMissingError
from mp_memory.checkpoint.publish import PartRecord, write_text
from mp_memory.checkpoint.zipcheck import check_records

__all__ = ["FORMAT", "Manifest", "check_present", "read_manifest", "verify_file", "write_manifest"]

FORMAT = "mp-checkpoint"
VERSION = 1
COMPLETE, WRITING = "complete", "writing"


@dataclass
class Manifest:
    """``parts`` maps file names (relative to the manifest's folder) to their records; ``layout`` is
    the (pp, tp, rdp) degrees the checkpoint was saved with; ``replicated``: parts are the same for
    every rdp_rank (saved once, by rdp_rank 0)."""

    kind: str
    layout: dict[str, int]
    parts: dict[str, PartRecord]
    state: str = COMPLETE
    replicated: bool = True
    created: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "state": self.state,
                "kind": self.kind,
                "layout": self.layout,
                "replicated": self.replicated,
                "created": self.created,
                "parts": {n: {"size": r.size, "crc32": r.crc32} for n, r in sorted(self.parts.items())},
            },
            indent=1,
        )


def write_manifest(path: str, manifest: Manifest, rank: int) -> None:
    write_text(path, manifest.to_json(), rank)


def _bad(path: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint manifest {path!r} {why}; it was damaged or written by something else: restore it "
        "from a backup, or load an older checkpoint"
    )


def read_manifest(path: str) -> Manifest | None:
    """The manifest at ``path``, None if there is none; raises CheckpointCorruptError if it is not one
    of mp's manifests, and CheckpointMissingError if its save never completed."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise _bad(path, f"cannot be read as JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise _bad(path, f"is not an {FORMAT} manifest of version {VERSION}")
    state = raw.get("state")
    if state == WRITING:
        raise CheckpointMissingError(
            f"the save of the checkpoint described by {path!r} did not complete (its manifest says "
            "'writing': a rank failed or was killed mid-save, so its parts may mix two saves); save it "
            "again, or load an older checkpoint"
        )
    try:
        layout = {str(k): int(v) for k, v in raw["layout"].items()}
        parts = {str(n): PartRecord(int(r["size"]), int(r["crc32"])) for n, r in dict(raw["parts"]).items()}
        kind, replicated, created = str(raw["kind"]), bool(raw["replicated"]), float(raw["created"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _bad(path, f"lacks or mistypes a field ({type(exc).__name__}: {exc})") from exc
    if state != COMPLETE or any("/" in n or n.startswith(".") for n in parts):
        raise _bad(path, f"has state {state!r} or part names outside its folder")
    return Manifest(kind, layout, parts, state, replicated, created)


def check_present(folder: str, manifest: Manifest, names: Any = None) -> None:
    """Check that the parts (all, or ``names``) exist with their recorded sizes: cheap (``stat`` only),
    so every rank can check every part before any rank changes a parameter."""
    for name in sorted(manifest.parts if names is None else names):
        _check_size(os.path.join(folder, name), _record(manifest, name, folder))


def _record(manifest: Manifest, name: str, folder: str) -> PartRecord:
    record = manifest.parts.get(name)
    if record is None:
        raise CheckpointMissingError(
            f"{os.path.join(folder, name)!r} is not among the parts the manifest lists "
            f"({sorted(manifest.parts)[:6]}...): the checkpoint was saved with another layout or naming"
        )
    return record


def _check_size(path: str, record: PartRecord) -> int:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointMissingError(
            f"checkpoint part {path!r} is missing (the manifest lists it with {record.size} bytes): was "
            "it deleted, or is it on another host? Restore it, or load an older checkpoint"
        ) from None
    if size != record.size:
        what = "is empty" if size == 0 else f"has {size} bytes"
        cut = " (truncated)" if size < record.size else ""
        raise CheckpointCorruptError(
            f"checkpoint part {path!r} {what}{cut}; the manifest says {record.size} bytes: the file was "
            "cut short or overwritten after the save. Restore it, or load an older checkpoint"
        )
    return size


def verify_file(path: str, record: PartRecord) -> None:
    """Check the part at ``path`` against ``record``: its size, then its checksums
    (:mod:`mp_memory.checkpoint.zipcheck`)."""
    _check_size(path, record)
    check_records(path, record)
