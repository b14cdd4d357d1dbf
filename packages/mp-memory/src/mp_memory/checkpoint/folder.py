"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``'s folder: staged, agreed, then published.

Partial (``path/{tag}_partial/``): every rank writes its files into a private staging folder
(``{tag}_partial.tmp-*``); once every rank has reported its parts complete, rank 0 writes the manifest
into it, renames it to ``{tag}_partial``, then rewrites ``newest`` (atomically, fsynced), then prunes
old checkpoints. Full (``path/{tag}`` and its siblings): rank 0 writes every file under a temporary
name, publishes them, writes ``manifest_{tag}.json`` last, then ``newest``. So ``newest`` only ever
names a checkpoint whose every part is on disk, and pruning (which counts only complete checkpoints and
never removes the one ``newest`` names) cannot delete the last good one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

from mp_memory.checkpoint.collective import agree
from mp_memory.checkpoint.errors import CheckpointError, CheckpointMissingError
from mp_memory.checkpoint.faults import fault_point
from mp_memory.checkpoint.layout import Layout
from mp_memory.checkpoint.manifest import Manifest, check_present, read_manifest, write_manifest
from mp_memory.checkpoint.publish import (
    TMP_MARK,
    PartRecord,
    publish_file,
    remove_stale,
    replace_dir,
    tmp_name,
    write_part,
    write_text,
)
from mp_memory.checkpoint.safe_load import check_metadata, load_part

__all__ = ["NEWEST", "CheckpointFolder", "full_manifest_name", "prune", "read_newest", "save_folder"]

NEWEST = "newest"
MANIFEST = "manifest.json"


def full_manifest_name(tag: str) -> str:
    return f"manifest_{tag}.json"


def save_folder(
    path: str,
    tag: str,
    layout: Layout,
    group: Any,
    files: dict[str, Any],
    *,
    partial: bool,
    keep: int | None,
    replicated: bool = True,
) -> None:
    """Write ``files`` (name -> object; each rank passes its own) as checkpoint ``tag`` of ``path``; the
    manifest lists every rank's. ``replicated=False``: some parts differ between rdp ranks (each wrote
    its own, e.g. ZeRO optimizer shares)."""
    what = f"smp.save_checkpoint({path!r}, tag={tag!r})"
    token, error = None, None
    if layout.rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            remove_stale(path)  # staging folders and files of saves that were killed
            token = uuid.uuid4().hex[:8]
            if partial:
                os.makedirs(_staging(path, tag, token))
        except Exception as exc:
            error = exc
    token = agree(error, token, group, what, layout.rank)[0]
    records: dict[str, PartRecord] = {}
    written: dict[str, str] = {}
    error = None
    try:
        for name, obj in files.items():
            if partial:
                records[name] = write_part(obj, os.path.join(_staging(path, tag, token), name), layout.rank)
            else:
                written[name] = tmp_name(os.path.join(path, name), layout.rank)
                records[name] = write_part(obj, written[name], layout.rank)
    except Exception as exc:
        error = exc
    try:
        gathered = agree(error, records, group, what, layout.rank)
    except BaseException:  # a rank failed (full disk, unpicklable object): leave nothing behind
        for tmp in written.values():
            if os.path.exists(tmp):
                os.remove(tmp)
        if partial and layout.rank == 0:
            shutil.rmtree(_staging(path, tag, token), ignore_errors=True)
        raise
    fault_point("agreed", layout.rank)
    error = None
    try:
        if layout.rank == 0:
            parts = {n: r for rs in gathered for n, r in rs.items()}
            manifest = Manifest(
                "partial" if partial else "full", layout.degrees(), parts, replicated=replicated
            )
            if partial:
                staging = _staging(path, tag, token)
                write_manifest(os.path.join(staging, MANIFEST), manifest, layout.rank)
                replace_dir(staging, os.path.join(path, f"{tag}_partial"), layout.rank)
            else:
                mpath = os.path.join(path, full_manifest_name(tag))
                if os.path.exists(mpath):  # a torn re-save of this tag must not pass the old check
                    os.remove(mpath)
                for name, tmp in written.items():
                    publish_file(tmp, os.path.join(path, name))
                write_manifest(mpath, manifest, layout.rank)
            fault_point("published", layout.rank)
            write_text(os.path.join(path, NEWEST), tag, layout.rank)
            fault_point("newest", layout.rank)
            if keep is not None and partial:
                prune(path, keep, tag)
    except Exception as exc:
        error = exc
    agree(error, None, group, what, layout.rank)


def _staging(path: str, tag: str, token: str) -> str:
    return os.path.join(path, f"{tag}_partial{TMP_MARK}{token}")


def prune(path: str, keep_count: int, newest: str) -> list[str]:
    """Remove the oldest complete partial checkpoints beyond ``keep_count``; never ``newest``'s, never
    one without a complete manifest (not mp's, or not finished: not counted, not touched)."""
    complete: list[tuple[float, str]] = []
    for name in os.listdir(path):
        folder = os.path.join(path, name)
        if not name.endswith("_partial") or TMP_MARK in name or not os.path.isdir(folder):
            continue
        try:
            manifest = read_manifest(os.path.join(folder, MANIFEST))
        except CheckpointError:
            continue
        if manifest is not None:
            complete.append((manifest.created, name))
    complete.sort()
    removed = []
    for _, name in complete[: max(0, len(complete) - keep_count)]:
        if name != f"{newest}_partial":
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
            removed.append(name)
    return removed


def read_newest(path: str) -> str:
    """The tag ``path/newest`` names."""
    newest = os.path.join(path, NEWEST)
    try:
        with open(newest, encoding="utf-8") as fh:
            tag = fh.read().strip()
    except FileNotFoundError:
        raise CheckpointMissingError(
            f"no {newest!r}: pass tag= or point path at a checkpoint folder"
        ) from None
    if not tag or os.sep in tag or TMP_MARK in tag:
        raise CheckpointMissingError(f"{newest!r} names {tag!r}, which is not a checkpoint tag")
    return tag


class CheckpointFolder:
    """One saved checkpoint (``partial`` or full) of ``path``: its files, checked before any is read."""

    def __init__(self, path: str, tag: str, partial: bool) -> None:
        self.partial = partial
        if partial:
            self.folder = os.path.join(path, f"{tag}_partial")
            if not os.path.isdir(self.folder):
                raise CheckpointMissingError(f"no partial checkpoint {self.folder!r}")
            self.manifest = read_manifest(os.path.join(self.folder, MANIFEST))
        else:
            self.folder = path
            self.manifest = read_manifest(os.path.join(path, full_manifest_name(tag)))
            if not os.path.isfile(os.path.join(path, tag)):
                raise CheckpointMissingError(f"no full checkpoint {os.path.join(path, tag)!r}")

    def check(self, names: Any = None) -> None:
        """Check that ``names`` (every part when None) exist with their recorded sizes."""
        if self.manifest is not None:
            check_present(self.folder, self.manifest, names)

    def has(self, name: str) -> bool:
        if self.manifest is not None:
            return name in self.manifest.parts
        return os.path.isfile(os.path.join(self.folder, name))

    def load(self, name: str, *, trusted: bool = False, map_location: Any = None) -> Any:
        path = os.path.join(self.folder, name)
        record = None
        if self.manifest is not None:
            record = self.manifest.parts.get(name)
            if record is None:
                raise CheckpointMissingError(
                    f"{path!r} is not among the parts of this checkpoint ({sorted(self.manifest.parts)[:8]})"
                )
        obj = load_part(path, record, trusted=trusted, map_location=map_location)
        check_metadata(obj, path)
        return obj
