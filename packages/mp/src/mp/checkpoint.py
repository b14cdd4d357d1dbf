"""`smp.save` / `smp.load` and `smp.save_checkpoint` / `smp.resume_from_checkpoint`.

Partial files carry smp's rank suffixes: ``f"{f}_{pp_rank}_{tp_rank}.pt"``, and with ``v3=True``
``f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}.pt"``. Their contents are plain ``torch.save`` output, so scripts
that ``torch.load`` a part directly keep working. The layout a partial checkpoint was saved with is read
back from the names of its files, so loading it under another layout fails with an error naming both.

A partial save is collective over the model-parallel group (the ranks sharing this rank's rdp_rank):
every rank writes its part, then the group agrees on success, so a failure on one rank raises on every
rank of the group instead of leaving the others to hang in the next collective. A full save
(``partial=False``) is written by global rank 0 alone and is not collective, so any subset of ranks may
call it.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from mp.errors import (
    IncompatibleCheckpointFoundError,
    IncompatibleCheckpointRankFoundError,
    MissingCheckpointFilesError,
    SMPCheckpointError,
)
from mp.state import state
from mp_comm import GroupKind

__all__ = ["load", "resume_from_checkpoint", "save", "save_checkpoint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Coords:
    rank: int
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    pp: int
    tp: int
    rdp: int


def _coords() -> _Coords:
    """This rank's place in the layout (a single process when smp is not initialized)."""
    if not state.initialized:
        return _Coords(0, 0, 0, 0, 1, 1, 1)
    _, world, topo = state.require()
    r = world.rank
    return _Coords(
        r,
        topo.rank_in_group(GroupKind.PP, r),
        topo.rank_in_group(GroupKind.TP, r),
        topo.rank_in_group(GroupKind.RDP, r),
        topo.size(GroupKind.PP),
        topo.size(GroupKind.TP),
        topo.size(GroupKind.RDP),
    )


def partial_name(f: str, pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """The file a partial save of ``f`` writes for these ranks (smp's naming)."""
    return f"{f}_{pp_rank}_{tp_rank}.pt" if rdp_rank is None else f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}.pt"


def _check_path(f: object) -> str:
    if not isinstance(f, str | os.PathLike):
        raise SMPCheckpointError(
            f"smp.save/smp.load take a file path (str); got {type(f).__name__}. File objects are not "
            "supported because partial checkpoints are several files named after the path"
        )
    return os.fspath(f)


def atomic_write(target: str, write: Callable[[str], object], writer: object) -> None:
    """``write`` a file at a temporary name private to ``writer``, then rename it to ``target``: writers
    of the same file never interleave, and a crash leaves no torn file."""
    tmp = f"{target}.tmp{writer}"
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _atomic_save(obj: Any, target: str, pickle_module: ModuleType, pickle_protocol: int, rank: int) -> None:
    """``torch.save`` atomically (replicas writing the same part: all rdp ranks calling a non-v3 partial
    save)."""

    def write(tmp: str) -> None:
        torch.save(obj, tmp, pickle_module=pickle_module, pickle_protocol=pickle_protocol)

    atomic_write(target, write, rank)


def _agree(error: BaseException | None, group_kind: GroupKind, what: str) -> None:
    """Raise on every rank of the group if any failed, naming the ranks and their errors."""
    group = state.process_groups.get(group_kind) if state.initialized else None
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    text = None
    if error is not None:
        text = f"rank {_coords().rank}: {type(error).__name__}: {error}\n" + "".join(
            traceback.format_exception(type(error), error, error.__traceback__)
        )
    texts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, text, group=group)
    failed = [t for t in texts if t is not None]
    if not failed:
        return
    message = f"{what} failed on {len(failed)} rank(s):\n" + "\n".join(failed)
    if error is not None:
        raise SMPCheckpointError(message) from error
    raise SMPCheckpointError(message)


def save(  # noqa: PLR0917 - smp's positional signature
    obj: Any,
    f: str,
    partial: bool = True,
    pickle_module: ModuleType = pickle,
    pickle_protocol: int = 2,
    v3: bool = False,
) -> None:
    """``torch.save`` for model-parallel jobs (see the module docstring for naming and collectivity).

    ``partial=True``: every rank of the model-parallel group writes its own part; call it on all of
    them (typically under ``if smp.rdp_rank() == 0``, or on every rank). ``v3=True`` adds the rdp_rank
    to the name, for state that differs between replicas (sharded optimizer state).
    ``partial=False``: global rank 0 writes ``f``; other callers return at once.
    """
    path = _check_path(f)
    c = _coords()
    if not partial:
        if c.rank == 0:
            _atomic_save(obj, path, pickle_module, pickle_protocol, c.rank)
        return
    if state.initialized and state.model is not None:
        state.model._enter_collective("smp.save(partial=True)")  # not the path: ranks may name files apart
    target = partial_name(path, c.pp_rank, c.tp_rank, c.rdp_rank if v3 else None)
    error: BaseException | None = None
    try:
        _atomic_save(obj, target, pickle_module, pickle_protocol, c.rank)
    except Exception as exc:  # agreed on below, then raised on every rank of the group
        error = exc
    _agree(error, GroupKind.MP, f"smp.save({path!r}, partial=True)")


_SUFFIX = re.compile(r"_(\d+)_(\d+)(?:_(\d+))?\.pt$")


def _saved_parts(path: str) -> tuple[set[tuple[int, int]], set[tuple[int, int, int]]]:
    """The (pp_rank, tp_rank) parts and the (pp_rank, tp_rank, rdp_rank) v3 parts saved for ``path``."""
    folder = os.path.dirname(path) or "."
    base = os.path.basename(path)
    v2: set[tuple[int, int]] = set()
    v3: set[tuple[int, int, int]] = set()
    if not os.path.isdir(folder):
        return v2, v3
    for name in os.listdir(folder):
        if not name.startswith(base + "_"):
            continue
        m = _SUFFIX.fullmatch(name[len(base) :])
        if m is None:
            continue
        pp, tp, rdp = m.groups()
        if rdp is None:
            v2.add((int(pp), int(tp)))
        else:
            v3.add((int(pp), int(tp), int(rdp)))
    return v2, v3


def _check_layout(path: str, c: _Coords, parts: set[tuple[int, ...]], v3: bool) -> str:
    """The file this rank loads, after checking that the saved parts are exactly this layout's."""
    sizes = (c.pp, c.tp, c.rdp) if v3 else (c.pp, c.tp)
    names = ("pipeline_parallel_degree", "tensor_parallel_degree", "rdp_size")[: len(sizes)]
    saved = tuple(max(p[i] for p in parts) + 1 for i in range(len(sizes)))
    running = ", ".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    was = ", ".join(f"{n}={s}" for n, s in zip(names, saved, strict=True))
    change = (
        "load it with the layout it was saved with, or save a full checkpoint (model.state_dict() with "
        "smp.save(..., partial=False)), which loads under any layout"
    )
    if saved != sizes:
        larger = any(s > r for s, r in zip(saved, sizes, strict=True))
        error = IncompatibleCheckpointRankFoundError if larger else IncompatibleCheckpointFoundError
        # Fewer parts than this layout needs can also be the last parts missing: say so.
        lost = "" if larger else " (or the files of its higher ranks are missing)"
        raise error(
            f"partial checkpoint {path!r} was saved with {was} ({len(parts)} files){lost}; this job runs "
            f"with {running}: {change}"
        )
    mine = (c.pp_rank, c.tp_rank, c.rdp_rank) if v3 else (c.pp_rank, c.tp_rank)
    expected = {tuple(x) for x in _grid(sizes)}
    missing = sorted(expected - parts)
    if missing:
        files = [partial_name(path, *m) for m in missing[:8]]
        raise MissingCheckpointFilesError(
            f"partial checkpoint {path!r} ({running}) lacks {len(missing)} of its {len(expected)} "
            f"files: {files}; was a save interrupted, or are some files on another host?"
        )
    return partial_name(path, *mine)


def _grid(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for s in sizes:
        out = [(*p, i) for p in out for i in range(s)]
    return out


def load(  # noqa: PLR0917 - smp's positional signature
    f: str,
    map_location: Any = None,
    pickle_module: ModuleType = pickle,
    pickle_load_args: dict[str, Any] | None = None,
    partial: bool = True,
    back_compat: bool = False,
) -> Any:
    """``torch.load`` for model-parallel jobs; every rank may call it.

    ``partial=True`` reads this rank's part (v3 naming with the rdp_rank when such files exist, else
    ``{f}_{pp_rank}_{tp_rank}.pt``) after checking the saved parts fit this job's layout.
    ``back_compat=True`` reads a checkpoint of smp < 1.10, which only had the two-index naming.
    """
    path = _check_path(f)
    args = dict(pickle_load_args or {})
    args.setdefault("weights_only", False)  # smp checkpoints hold optimizer state, user objects
    if not partial:
        if not os.path.exists(path):
            v2, v3 = _saved_parts(path)
            hint = " (partial files of it exist: pass partial=True)" if v2 or v3 else ""
            raise MissingCheckpointFilesError(f"full checkpoint {path!r} does not exist{hint}")
        return torch.load(path, map_location=map_location, pickle_module=pickle_module, **args)
    c = _coords()
    v2, v3 = _saved_parts(path)
    if v3 and not back_compat:
        target = _check_layout(path, c, set(v3), v3=True)
    elif v2:
        target = _check_layout(path, c, set(v2), v3=False)
    else:
        hint = " (a full checkpoint of that name exists: pass partial=False)" if os.path.isfile(path) else ""
        raise MissingCheckpointFilesError(
            f"no partial checkpoint files {partial_name(path, 0, 0)!r}, ... found for {path!r}{hint}"
        )
    return torch.load(target, map_location=map_location, pickle_module=pickle_module, **args)


# --------------------------------------------------------------------------- save_checkpoint / resume
_NEWEST = "newest"


def _check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag or os.sep in tag:
        raise SMPCheckpointError(f"checkpoint tag={tag!r}; expected a non-empty str without {os.sep!r}")
    if state.initialized and state.require()[1].size > 1:
        tags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(tags, tag)
        if len(set(tags)) > 1:
            raise SMPCheckpointError(f"save_checkpoint tags differ between ranks: {tags}; pass the same tag")
    return tag


def save_checkpoint(  # noqa: PLR0917 - smp's positional signature
    path: str,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """Write smp's checkpoint folder (reference §1.5); call it on every rank with the same ``tag``.

    Partial: ``path/{tag}_partial/`` holds ``model_{pp}_{tp}.pt``, ``optimizer_{pp}_{tp}.pt`` (written by
    the rdp_rank 0 replicas) and ``user_content.pt``. Full: ``path/{tag}`` holds the gathered model state
    and ``path/user_content_{tag}`` the user content; the optimizer is not saved (as in smp).
    ``path/newest`` names the tag. ``num_kept_partial_checkpoints`` deletes the oldest partial folders
    beyond that many. ``translate_if_full`` is accepted for compatibility (no HF translation here).
    """
    tag = _check_tag(tag)
    c = _coords()
    model = model if model is not None else state.model
    error: BaseException | None = None
    try:
        os.makedirs(path, exist_ok=True)
        if partial:
            folder = os.path.join(path, f"{tag}_partial")
            os.makedirs(folder, exist_ok=True)
            if c.rdp_rank == 0:
                for name, owner in (("model", model), ("optimizer", optimizer)):
                    if owner is not None:
                        target = partial_name(os.path.join(folder, name), c.pp_rank, c.tp_rank)
                        _atomic_save(owner.local_state_dict(), target, pickle, 2, c.rank)
            if c.rank == 0:
                _atomic_save(user_content, os.path.join(folder, "user_content.pt"), pickle, 2, c.rank)
        else:
            # Gathering is collective over each pipeline: every rank takes part, rank 0 writes.
            full = model.state_dict() if model is not None else None
            if c.rank == 0:
                if full is not None:
                    _atomic_save(full, os.path.join(path, tag), pickle, 2, c.rank)
                _atomic_save(user_content, os.path.join(path, f"user_content_{tag}"), pickle, 2, c.rank)
        if c.rank == 0:
            with open(os.path.join(path, _NEWEST), "w") as fh:
                fh.write(tag)
            if partial and num_kept_partial_checkpoints is not None:
                _prune(path, num_kept_partial_checkpoints, keep=f"{tag}_partial")
    except Exception as exc:
        error = exc
    _agree(error, GroupKind.WORLD, f"smp.save_checkpoint({path!r}, tag={tag!r})")


def _prune(path: str, keep_count: int, keep: str) -> None:
    """Delete the oldest ``*_partial`` folders so that ``keep_count`` remain (never ``keep``)."""
    if keep_count < 1:
        raise SMPCheckpointError(f"num_kept_partial_checkpoints={keep_count}; expected an int >= 1 or None")
    folders = [
        os.path.join(path, n)
        for n in os.listdir(path)
        if n.endswith("_partial") and os.path.isdir(os.path.join(path, n))
    ]
    folders.sort(key=os.path.getmtime)
    for old in folders[: max(0, len(folders) - keep_count)]:
        if os.path.basename(old) != keep:
            shutil.rmtree(old, ignore_errors=True)


def resume_from_checkpoint(  # noqa: PLR0917 - smp's positional signature
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into ``smp``'s model and optimizer and return
    its ``user_content``. ``tag=None`` reads the tag named in ``path/newest``. Call it on every rank
    after creating the ``DistributedModel`` (the optimizer may come later: its state is loaded once the
    model is partitioned, in the first step)."""
    if tag is None:
        newest = os.path.join(path, _NEWEST)
        if not os.path.isfile(newest):
            raise MissingCheckpointFilesError(
                f"no {newest!r}: pass tag= or point path at a checkpoint folder"
            )
        with open(newest) as fh:
            tag = fh.read().strip()
    model = state.model
    if model is None:
        raise SMPCheckpointError("resume_from_checkpoint needs a smp.DistributedModel; create it first")
    if partial:
        folder = os.path.join(path, f"{tag}_partial")
        sd = load(os.path.join(folder, "model"), partial=True)
        if translate_function is not None:
            sd = translate_function(sd)
        model.load_state_dict(sd, strict=strict)
        if load_optimizer:
            opt_sd = load(os.path.join(folder, "optimizer"), partial=True)
            _load_optimizer_when_ready(model, opt_sd)
        return load(os.path.join(folder, "user_content.pt"), partial=False)
    sd = load(os.path.join(path, tag), partial=False)
    if translate_function is not None:
        sd = translate_function(sd)
    model.load_state_dict(sd, strict=strict)
    return load(os.path.join(path, f"user_content_{tag}"), partial=False)


def _load_optimizer_when_ready(model: Any, opt_sd: dict[str, Any]) -> None:
    """Load now if the optimizer exists, else once the model is partitioned (smp's deferred load)."""
    if state.optimizer is not None:
        state.optimizer.load_state_dict(opt_sd)
        return
    if model.partitioned:
        raise SMPCheckpointError(
            "resume_from_checkpoint(load_optimizer=True) found no smp.DistributedOptimizer; create it "
            "before resuming, or pass load_optimizer=False"
        )

    def hook(_model: Any, optimizer: Any) -> None:
        if optimizer is None:
            raise SMPCheckpointError(
                "resume_from_checkpoint(load_optimizer=True) found no smp.DistributedOptimizer by the first "
                "step; create it before the first step, or pass load_optimizer=False"
            )
        optimizer.load_state_dict(opt_sd)

    model.register_post_partition_hook(hook)
