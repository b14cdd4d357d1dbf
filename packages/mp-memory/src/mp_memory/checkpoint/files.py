"""``smp.save`` / ``smp.load``: one object per rank (partial) or one for the job (full), published
only when every rank's part is complete, and checked against the manifest when loaded.

A partial save is collective over ``group`` (the ranks whose parts make one checkpoint: the
model-parallel group, or every rank with ``v3``). Its steps: each rank writes its part under a temporary
name; the ranks agree that every part is written; the group's first rank marks the manifest
"writing"; each rank renames its part into place; the ranks agree again; the first rank writes the
manifest "complete". A rank killed anywhere leaves either the previous checkpoint (with its manifest)
untouched, or a manifest saying "writing", which loading refuses: never a silent mix of two saves.
"""

from __future__ import annotations

import os
from typing import Any

from mp_memory.checkpoint.collective import agree
from mp_memory.checkpoint.errors import CheckpointLayoutError, CheckpointMissingError
from mp_memory.checkpoint.faults import fault_point
from mp_memory.checkpoint.layout import Layout, find_parts, manifest_path, part_name
from mp_memory.checkpoint.manifest import WRITING, Manifest, check_present, read_manifest, write_manifest
from mp_memory.checkpoint.publish import PartRecord, publish_file, remove_stale, tmp_name, write_part
from mp_memory.checkpoint.safe_load import check_metadata, load_part

__all__ = ["load_full", "load_partial", "save_full", "save_partial"]


def save_partial(
    obj: Any, path: str, layout: Layout, group: Any, *, group_rank: int, v3: bool, **save_args: Any
) -> str:
    """Write this rank's part of ``path`` (see the module docstring); returns the part's file name."""
    rdp = layout.rdp_rank if v3 else 0
    target = part_name(path, layout.pp_rank, layout.tp_rank, rdp)
    folder = os.path.dirname(path) or "."
    what = f"smp.save({path!r}, partial=True)"
    tmp, record, error = None, None, None
    try:
        remove_stale(folder, os.path.basename(path), layout.rank)  # this rank's torn files of earlier saves
        tmp = tmp_name(target, layout.rank)
        record = write_part(obj, tmp, layout.rank, **save_args)
    except Exception as exc:  # agreed on below, raised on every rank of the group
        error = exc
    try:
        records = agree(error, (os.path.basename(target), record), group, what, layout.rank)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        raise
    fault_point("agreed", layout.rank)
    mpath = manifest_path(path)
    degrees = {"pp": layout.pp, "tp": layout.tp, "rdp": layout.rdp if v3 else 1}
    parts = dict(records)
    manifest = Manifest("partial", degrees, parts, replicated=not v3)
    error = None
    try:
        if group_rank == 0:
            write_manifest(mpath, Manifest("partial", degrees, {}, state=WRITING), layout.rank)
    except Exception as exc:
        error = exc
    agree(error, None, group, what, layout.rank)
    try:
        assert tmp is not None
        publish_file(tmp, target)
        fault_point("published", layout.rank)
    except Exception as exc:
        error = exc
    agree(error, None, group, what, layout.rank)
    if group_rank == 0:
        write_manifest(mpath, manifest, layout.rank)
    return target


def save_full(obj: Any, path: str, rank: int, **save_args: Any) -> None:
    """Write ``obj`` to ``path`` atomically with its manifest (by one rank)."""
    folder = os.path.dirname(path) or "."
    remove_stale(folder, os.path.basename(path), rank)
    mpath = manifest_path(path)
    if os.path.exists(mpath):  # a torn re-save must not pass the old manifest's check
        os.remove(mpath)
    tmp = tmp_name(path, rank)
    record = write_part(obj, tmp, rank, **save_args)
    publish_file(tmp, path)
    manifest = Manifest("full", {"pp": 1, "tp": 1, "rdp": 1}, {os.path.basename(path): record})
    write_manifest(mpath, manifest, rank)


def load_full(path: str, *, trusted: bool, **load_args: Any) -> Any:
    """Load a full checkpoint, checked against its manifest when it has one."""
    manifest = read_manifest(manifest_path(path))
    if manifest is None:  # a full save_checkpoint's model file: its folder's manifest_{tag}.json
        folder, name = os.path.split(path)
        manifest = read_manifest(os.path.join(folder, f"manifest_{name}.json"))
    record = None if manifest is None else manifest.parts.get(os.path.basename(path))
    if not os.path.exists(path):
        hint = " (partial files of it exist: pass partial=True)" if find_parts(path) else ""
        raise CheckpointMissingError(f"full checkpoint {path!r} does not exist{hint}")
    obj = load_part(path, record, trusted=trusted, **load_args)
    check_metadata(obj, path)
    return obj


def load_partial(
    path: str, layout: Layout, *, trusted: bool, back_compat: bool = False, **load_args: Any
) -> Any:
    """Load this rank's part of ``path`` after checking that the saved parts fit this layout and (when
    there is a manifest) that every part is present with its recorded size."""
    manifest = read_manifest(manifest_path(path))
    if manifest is not None:
        target, record = _from_manifest(path, layout, manifest)
    else:
        target, record = _legacy_part(path, layout, back_compat), None
    obj = load_part(target, record, trusted=trusted, **load_args)
    check_metadata(obj, target)
    return obj


def _mismatch(path: str, saved: dict[str, int], running: dict[str, int], nfiles: int, lost: bool) -> None:
    names = {"pp": "pipeline_parallel_degree", "tp": "tensor_parallel_degree", "rdp": "rdp_size"}
    keys = [k for k in ("pp", "tp", "rdp") if k in saved]
    if all(saved[k] == running[k] for k in keys):
        return
    was = ", ".join(f"{names[k]}={saved[k]}" for k in keys)
    now = ", ".join(f"{names[k]}={running[k]}" for k in keys)
    larger = any(saved[k] > running[k] for k in keys)
    hint = " (or the files of its higher ranks are missing)" if lost and not larger else ""
    raise CheckpointLayoutError(
        f"partial checkpoint {path!r} was saved with {was} ({nfiles} files){hint}; this job runs with "
        f"{now}: load it with the layout it was saved with, or save a full checkpoint (model.state_dict() "
        "with smp.save(..., partial=False)), which loads under any layout",
        larger=larger,
    )


def _from_manifest(path: str, layout: Layout, manifest: Manifest) -> tuple[str, PartRecord]:
    saved = {"pp": manifest.layout["pp"], "tp": manifest.layout["tp"]}
    running = {"pp": layout.pp, "tp": layout.tp}
    if not manifest.replicated:
        saved["rdp"], running["rdp"] = manifest.layout["rdp"], layout.rdp
    _mismatch(path, saved, running, len(manifest.parts), lost=False)
    folder = os.path.dirname(path) or "."
    check_present(folder, manifest)
    rdp = 0 if manifest.replicated else layout.rdp_rank
    name = os.path.basename(part_name(path, layout.pp_rank, layout.tp_rank, rdp))
    return os.path.join(folder, name), manifest.parts[name]


def _legacy_part(path: str, layout: Layout, back_compat: bool) -> str:
    """The part of a checkpoint without a manifest (smp's, or mp's before manifests) by its naming."""
    found = find_parts(path)
    order = ["v2", "v2.pt", "v1"] if back_compat else ["v3", "v3.pt", "v2", "v2.pt", "v1"]
    kind = next((k for k in order if k in found), None)
    if kind is None:
        hint = " (a full checkpoint of that name exists: pass partial=False)" if os.path.isfile(path) else ""
        raise CheckpointMissingError(
            f"no partial checkpoint files {path + '_0_0_0'!r}, ... found for {path!r}{hint}"
        )
    parts = found[kind]
    width = len(next(iter(parts)))
    keys = ("pp", "tp", "rdp")[:width]
    saved = {k: max(p[i] for p in parts) + 1 for i, k in enumerate(keys)}
    replicated = width == 3 and saved["rdp"] == 1
    saved.setdefault("tp", 1)  # v1: {f}_{mp_rank}, from smp before tensor parallelism
    running = {"pp": layout.pp, "tp": layout.tp, "rdp": 1 if replicated else layout.rdp}
    _mismatch(path, saved, running, len(parts), lost=True)
    grid: list[tuple[int, ...]] = [(p,) for p in range(saved["pp"])]
    for k in keys[1:]:
        grid = [(*g, i) for g in grid for i in range(saved[k])]
    missing = sorted(set(grid) - set(parts))
    if missing:
        suffix = ".pt" if kind.endswith(".pt") else ""
        files = [path + "".join(f"_{i}" for i in m) + suffix for m in missing[:8]]
        raise CheckpointMissingError(
            f"partial checkpoint {path!r} lacks {len(missing)} of its {len(grid)} files: {files}; was a save "
            "interrupted, or are some files on another host?"
        )
    mine = (layout.pp_rank, layout.tp_rank, 0 if replicated else layout.rdp_rank)[:width]
    return parts[mine]
