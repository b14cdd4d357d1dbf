"""`smp.save` / `smp.load` and `smp.save_checkpoint` / `smp.resume_from_checkpoint`.

The machinery (atomic publication, manifests with checksums, loading that runs no code, smp's file
names) is mp-memory's (:mod:`mp_memory.checkpoint`); this module passes it the layout, the process
groups and the model's and optimizer's state dicts, and raises smp's exception classes.

Files written (see docs/checkpoint.md): a partial ``smp.save(obj, f)`` writes ``f"{f}_{pp}_{tp}_{rdp}"``
(rdp is 0 unless ``v3=True``) and ``f"{f}.mp-manifest.json"``; ``smp.load`` also reads smp's older
``f"{f}_{pp}_{tp}"`` and ``f"{f}_{mp_rank}"`` names and mp's earlier ``.pt``-suffixed ones. A partial save is
collective over the model-parallel group (every rank with ``v3``); a full save is written by global
rank 0 alone and is not collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from mp.checkpoint_layout import load_merged_model, original_names
from mp.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointFoundError,
    IncompatibleCheckpointRankFoundError,
    MissingCheckpointFilesError,
    SMPCheckpointError,
    UntrustedCheckpointFileError,
)
from mp.sharded import partial_file_names, sharding_of
from mp.state import state
from mp_comm import GroupKind
from mp_memory import (
    TMP_MARK,
    BackgroundSave,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFolder,
    CheckpointLayoutError,
    CheckpointMissingError,
    Layout,
    UntrustedCheckpointError,
    agree,
    full_model_from_parts,
    full_optimizer_from_parts,
    is_trusted,
    load_full,
    load_partial,
    merge_model_parts,
    merge_optimizer_parts,
    publish_file,
    read_header,
    read_newest,
    save_folder,
    save_full,
    save_partial,
    tmp_name,
)

if TYPE_CHECKING:
    from mp.model import DistributedModel
    from mp_memory import ShardedDataParallel

__all__ = [
    "CorruptCheckpointError",
    "UntrustedCheckpointFileError",
    "atomic_write",
    "load",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "wait_checkpoint",
]

log = logging.getLogger(__name__)

_background = BackgroundSave()
"""The ``save_checkpoint(async_save=True)`` in flight, if any, and the host buffers its copies reuse."""


def _smp_error(exc: CheckpointError) -> SMPCheckpointError:
    kind: type[SMPCheckpointError] = SMPCheckpointError
    if isinstance(exc, CheckpointMissingError):
        kind = MissingCheckpointFilesError
    elif isinstance(exc, CheckpointLayoutError):
        kind = IncompatibleCheckpointRankFoundError if exc.larger else IncompatibleCheckpointFoundError
    elif isinstance(exc, CheckpointCorruptError):
        kind = CorruptCheckpointError
    elif isinstance(exc, UntrustedCheckpointError):
        kind = UntrustedCheckpointFileError
    return kind(str(exc))


@contextlib.contextmanager
def _smp_errors() -> Iterator[None]:
    """Raise mp-memory's errors as smp's exception classes (scripts catch those)."""
    try:
        yield
    except SMPCheckpointError:
        raise
    except CheckpointError as exc:
        raise _smp_error(exc) from exc


def _layout() -> Layout:
    """This rank's place in the layout (a single process when smp is not initialized)."""
    if not state.initialized:
        return Layout()
    _, world, topo = state.require()
    r = world.rank
    return Layout(
        r,
        topo.rank_in_group(GroupKind.PP, r),
        topo.rank_in_group(GroupKind.TP, r),
        topo.rank_in_group(GroupKind.RDP, r),
        topo.size(GroupKind.PP),
        topo.size(GroupKind.TP),
        topo.size(GroupKind.RDP),
    )


def _group(kind: GroupKind) -> Any:
    return state.process_groups.get(kind) if state.initialized else None


def atomic_write(target: str, write: Callable[[str], object], writer: int) -> None:
    """``write`` a file at a temporary name private to ``writer``, then publish it as ``target``
    durably: writers of the same file never interleave, and a crash leaves no torn file."""
    tmp = tmp_name(target, writer)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        publish_file(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _check_path(f: object) -> str:
    if not isinstance(f, str | os.PathLike):
        raise SMPCheckpointError(
            f"smp.save/smp.load take a file path (str); got {type(f).__name__}. File objects are not "
            "supported because partial checkpoints are several files named after the path"
        )
    return os.fspath(f)


def save(  # noqa: PLR0917 - smp's positional signature
    obj: Any,
    f: str,
    partial: bool = True,
    pickle_module: ModuleType = pickle,
    pickle_protocol: int = 2,
    v3: bool = False,
) -> None:
    """``torch.save`` for model-parallel jobs (see the module docstring for names and collectivity).

    ``partial=True``: every rank of the model-parallel group writes its own part; call it on all of
    them (typically under ``if smp.rdp_rank() == 0``, or on every rank). ``v3=True`` keeps a part per
    rdp_rank, for state that differs between replicas; call it on every rank.
    ``partial=False``: global rank 0 writes ``f``; other callers return at once.
    """
    path = _check_path(f)
    c = _layout()
    args = {"pickle_module": pickle_module, "pickle_protocol": pickle_protocol}
    with _smp_errors():
        if not partial:
            if c.rank == 0:
                save_full(obj, path, c.rank, **args)
            return
        model = state.model if state.initialized else None
        if model is not None:  # not the path: ranks may name files apart
            model.placement.enter("smp.save(partial=True)")
        kind = GroupKind.WORLD if v3 else GroupKind.MP
        group = _group(kind)
        group_rank = dist.get_rank(group) if group is not None else 0
        save_partial(obj, path, c, group, group_rank=group_rank, v3=v3, **args)


def load(  # noqa: PLR0917 - smp's positional signature
    f: str,
    map_location: Any = None,
    pickle_module: ModuleType = pickle,
    pickle_load_args: dict[str, Any] | None = None,
    partial: bool = True,
    back_compat: bool = False,
    *,
    weights_only: bool | None = None,
) -> Any:
    """``torch.load`` for model-parallel jobs; every rank may call it.

    ``partial=True`` reads this rank's part after checking that the saved parts fit this job's layout
    and match the manifest (sizes, and the CRC-32 of the part read). ``back_compat=True`` reads a
    checkpoint of smp < 1.10 (two-index names). Loading runs no code from the file: only tensors,
    numbers, strings and containers load, unless ``weights_only=False`` (also accepted inside
    ``pickle_load_args``) or ``MP_CHECKPOINT_TRUST=1`` says the file is trusted.
    """
    path = _check_path(f)
    args = dict(pickle_load_args or {})
    if weights_only is None:
        weights_only = args.pop("weights_only", None)
    args.pop("weights_only", None)
    trusted = is_trusted(None if weights_only is None else not weights_only)
    with _smp_errors():
        if not partial:
            return load_full(
                path, trusted=trusted, map_location=map_location, pickle_module=pickle_module, **args
            )
        return load_partial(
            path,
            _layout(),
            trusted=trusted,
            back_compat=back_compat,
            map_location=map_location,
            pickle_module=pickle_module,
            **args,
        )


# --------------------------------------------------------------------------- save_checkpoint / resume
def _check_tag(tag: object, partial: object = True, async_save: object = False) -> str:
    if not isinstance(tag, str) or not tag or os.sep in tag or TMP_MARK in tag:
        raise SMPCheckpointError(f"checkpoint tag={tag!r}; expected a non-empty str without {os.sep!r}")
    if not isinstance(async_save, bool):
        raise SMPCheckpointError(f"save_checkpoint(async_save={async_save!r}); expected True or False")
    if state.initialized and state.require()[1].size > 1:
        calls: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(calls, (tag, bool(partial), async_save))
        if len({t for t, _, _ in calls}) > 1:
            raise SMPCheckpointError(
                f"save_checkpoint tags differ between ranks: {[t for t, _, _ in calls]}; pass the same tag"
            )
        if len(set(calls)) > 1:
            raise SMPCheckpointError(
                f"save_checkpoint's (partial, async_save) differ between ranks: {[c[1:] for c in calls]}; "
                "pass the same on every rank"
            )
    return tag


def _checkpoint_group() -> Any:
    """The group background saves agree over: every rank, gloo, used by nothing else (so a background
    agreement never meets training's collectives on their communicator). Made, collectively, by the
    first async save; destroyed by smp.reset."""
    if not state.initialized or state.require()[1].size == 1:
        return None
    if state.checkpoint_group is None:
        pg = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        state.checkpoint_group = pg
        state.created_groups.append(pg)
    return state.checkpoint_group


def _previous_failure(what: str) -> Exception | None:
    """Wait for the background save in flight; its failure, named as the previous save's."""
    try:
        with _smp_errors():
            _background.wait()
    except Exception as exc:
        kind = type(exc) if isinstance(exc, SMPCheckpointError) else SMPCheckpointError
        return kind(
            f"the background save before {what} failed, so this one was not started: {exc}\n"
            "The checkpoints saved before the failed one are untouched (newest names the last complete one)"
        )
    return None


def wait_checkpoint() -> None:
    """Wait until the ``smp.save_checkpoint(..., async_save=True)`` in flight (if any) is published;
    raise its failure as the synchronous save would have (the same error on every rank: the ranks agree
    on the outcome in the background). Not collective; returns at once when no save is in flight.
    ``save_checkpoint``, ``resume_from_checkpoint``, ``smp.reset`` and the end of the process wait too."""
    with _smp_errors():
        _background.wait()


def finish_background() -> Exception | None:
    """Wait for the background save in flight and drop its host buffers (smp.reset, exit); return its
    failure as smp's exception, None if it succeeded or none was in flight."""
    try:
        wait_checkpoint()
    except Exception as exc:
        return exc
    finally:
        _background.release()
    return None


def _zero() -> bool:
    """Whether the optimizer state is sharded over the rdp group (``shard_optimizer_state``, ZeRO-1):
    each rdp rank holds its own share, so each writes and reads its own optimizer file."""
    return state.initialized and state.require()[0].shard_optimizer_state


def _partial_names(c: Layout) -> tuple[str, str]:
    """(model file, optimizer file) of this rank in a partial checkpoint: smp's
    ``{kind}_{pp}_{tp}_{rdp}.pt``, whose rdp index is 0 except for a ZeRO optimizer share."""
    share = c.rdp_rank if _zero() else 0
    return f"model_{c.pp_rank}_{c.tp_rank}_0.pt", f"optimizer_{c.pp_rank}_{c.tp_rank}_{share}.pt"


def save_checkpoint(  # noqa: PLR0917 - smp's positional signature
    path: str,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
    *,
    async_save: bool = False,
) -> None:
    """Write smp's checkpoint folder; call it on every rank with the same ``tag``.

    Partial: ``path/{tag}_partial/`` holds ``model_{pp}_{tp}_0.pt``, ``optimizer_{pp}_{tp}_0.pt``
    (written by the rdp_rank 0 replicas; under ``shard_optimizer_state`` every rdp rank writes its share
    of the optimizer state, ``optimizer_{pp}_{tp}_{rdp}.pt``), ``user_content.pt`` and ``manifest.json``.
    Full: ``path/{tag}`` holds the gathered model state (the original module's key names: it loads
    into the unwrapped model), ``path/optimizer_{tag}`` the gathered optimizer state (smp dropped it),
    ``path/user_content_{tag}`` and ``path/manifest_{tag}.json``. ``path/newest`` names the tag once
    every part is on disk.
    ``num_kept_partial_checkpoints`` removes the oldest complete partial checkpoints beyond that many.
    ``translate_if_full``: the full state already has the original (e.g. Hugging Face) key names, so
    there is nothing left to translate; ``False`` (smp's own distributed names) is refused.

    ``async_save=True`` (mp's addition): return once the state is copied into host memory; the files,
    the ranks' agreement, the manifest and ``newest`` are written in the background, with the same
    guarantees. A failure there is raised by the next ``save_checkpoint``, by ``smp.wait_checkpoint()``
    or ``smp.reset()``, and at exit (logged, exit status 1). Pass the same value on every rank.
    """
    tag = _check_tag(tag, partial, async_save)
    what = f"smp.save_checkpoint({path!r}, tag={tag!r})"
    previous = _previous_failure(what)
    if previous is not None:  # the ranks agreed on the background save's outcome: every rank raises
        raise previous
    if not partial and translate_if_full is not True:
        raise SMPCheckpointError(
            f"save_checkpoint(translate_if_full={translate_if_full!r}): mp writes a full checkpoint with the "
            "original module's key names only (smp's False kept its own distributed names, which mp's "
            "modules do not use); leave translate_if_full at True"
        )
    if num_kept_partial_checkpoints is not None and (
        not isinstance(num_kept_partial_checkpoints, int) or num_kept_partial_checkpoints < 1
    ):
        raise SMPCheckpointError(
            f"num_kept_partial_checkpoints={num_kept_partial_checkpoints!r}; expected an int >= 1 or None"
        )
    c = _layout()
    model = model if model is not None else state.model
    files: dict[str, Any] = {}
    shares = False
    sharded = partial_file_names(sharding_of(model))  # sharded data parallelism: one part per shard index
    if partial:
        model_name, opt_name = _partial_names(c)
        writes = c.rdp_rank == 0
        shares = sharded is None and _zero()  # ZeRO-1: the rdp ranks' optimizer states differ
        if sharded is not None:
            model_name, opt_name, writes = sharded
        if writes and model is not None:
            files[model_name] = model.local_state_dict()
        if (writes or shares) and optimizer is not None:
            files[opt_name] = optimizer.local_state_dict()
        if c.rank == 0:
            files["user_content.pt"] = user_content
    else:
        # Gathering is collective over each pipeline and TP group: every rank takes part, rank 0 writes.
        full = model.state_dict() if model is not None else None
        opt_full = optimizer.state_dict() if optimizer is not None else None
        if c.rank == 0:
            if full is not None:
                files[tag] = full
            if opt_full is not None:
                files[f"optimizer_{tag}"] = opt_full
            files[f"user_content_{tag}"] = user_content
    if not async_save:
        with _smp_errors():
            save_folder(
                path,
                tag,
                c,
                _group(GroupKind.WORLD),
                files,
                partial=partial,
                keep=num_kept_partial_checkpoints,
                replicated=not (partial and shares),
            )
        return
    group = _checkpoint_group()
    error: Exception | None = None
    staged: dict[str, Any] = {}
    try:
        staged = _background.stage(files)  # the copy: what later steps cannot change
    except Exception as exc:  # agreed on in the background (no collective while the loop blocks)
        error = exc

    def write() -> None:
        # Every rank learns whether every copy was made before any file is written.
        agree(error, None, group, what, c.rank)
        save_folder(
            path,
            tag,
            c,
            group,
            staged,
            partial=partial,
            keep=num_kept_partial_checkpoints,
            replicated=not (partial and shares),
        )

    _background.start(write, what)


def resume_from_checkpoint(  # noqa: PLR0917 - smp's positional signature
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    *,
    trust_file: bool | None = None,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into smp's model and optimizer and return
    its ``user_content``. ``tag=None`` reads the tag named in ``path/newest``. Call it on every rank
    after creating the ``DistributedModel`` (the optimizer may come later: its state is loaded once the
    model is partitioned, in the first step).

    Every rank checks every part it needs against the manifest (present, full size, CRC-32 of what it
    reads) and the ranks agree before any parameter changes. Nothing in the files runs as code;
    ``user_content`` holding objects other than tensors, numbers, strings and containers needs
    ``trust_file=True`` (or ``MP_CHECKPOINT_TRUST=1``). ``load_sharded_optimizer_state=False`` leaves
    a sharded optimizer state (sharded data parallelism, ``shard_optimizer_state``) unloaded; without
    sharding it has no effect, as in smp.
    """
    model = state.model
    if model is None:
        raise SMPCheckpointError("resume_from_checkpoint needs a smp.DistributedModel; create it first")
    wait_checkpoint()  # a background save in flight is published (or has failed) first
    trusted = is_trusted(trust_file)
    c = _layout()
    what = f"smp.resume_from_checkpoint({path!r}, tag={tag!r})"
    cfg = state.require()[0]
    if partial and not load_sharded_optimizer_state and (cfg.sdp > 1 or cfg.shard_optimizer_state):
        # smp: the sharded optimizer state (sharded data parallelism, ZeRO-1) stays unloaded
        log.info("resume_from_checkpoint: load_sharded_optimizer_state=False, the optimizer starts afresh")
        load_optimizer = False
    loaded: tuple[Any, Any, Any, bool] | None = None
    error: BaseException | None = None
    try:
        with _smp_errors():
            loaded = _read(
                path,
                tag,
                partial,
                c,
                module=model.module,
                sharding=model.sharding,
                load_optimizer=load_optimizer,
                trusted=trusted,
            )
    except Exception as exc:  # agreed on below: no rank loads anything unless every rank read its parts
        error = exc
    with _smp_errors():
        agree(error, None, _group(GroupKind.WORLD), what, c.rank)
    assert loaded is not None
    sd, opt_sd, user, moved = loaded
    if translate_function is not None:
        sd = translate_function(sd)
    if moved:
        load_merged_model(model.module, model.placement, sd, strict)
    else:
        model.load_state_dict(sd, strict=strict)
    if opt_sd is not None:
        _load_optimizer_when_ready(model, opt_sd)
    return user


def _read(
    path: str,
    tag: str | None,
    partial: bool,
    c: Layout,
    *,
    module: nn.Module,
    sharding: ShardedDataParallel | None,
    load_optimizer: bool,
    trusted: bool,
) -> Any:
    """(model state, optimizer state or None, user content, whether the partial checkpoint moves to
    another pipeline degree) of the checkpoint, every file checked, for the model ``module`` (sharded
    by ``sharding``, if any)."""
    tag = tag if tag is not None else read_newest(path)
    ckpt = CheckpointFolder(path, tag, partial)
    ckpt.check()
    if partial and load_optimizer and _zero():
        _check_zero_layout(ckpt, c)
    change = _partial_layout_change(ckpt, c) if partial else None
    if change is not None:
        # Another layout: see mp.checkpoint_layout.
        assert ckpt.manifest is not None
        stages, tps = range(ckpt.manifest.layout["pp"]), range(ckpt.manifest.layout["tp"])
        user = ckpt.load("user_content.pt", trusted=trusted)
        if change == "pp":  # every stage's part of this tp_rank
            sd = merge_model_parts([ckpt.load(f"model_{p}_{c.tp_rank}_0.pt") for p in stages])
            opt_sd = None
            if load_optimizer:
                stage_parts = [ckpt.load(f"optimizer_{p}_{c.tp_rank}_0.pt") for p in stages]
                _refuse_shares(ckpt, stage_parts, c)
                opt_sd = merge_optimizer_parts(stage_parts)
            return sd, opt_sd, user, True
        model_parts = {(p, t): ckpt.load(f"model_{p}_{t}_0.pt") for p in stages for t in tps}

        def translate(full: dict[str, Any]) -> dict[str, Any]:
            return original_names(module, full)

        sd = full_model_from_parts(model_parts, len(tps), translate)
        opt_sd = None
        if load_optimizer:
            opt_parts = {(p, t): ckpt.load(f"optimizer_{p}_{t}_0.pt") for p in stages for t in tps}
            _refuse_shares(ckpt, list(opt_parts.values()), c)
            opt_sd = full_optimizer_from_parts(opt_parts, model_parts, len(tps), translate)
        return sd, opt_sd, user, False
    if partial:
        model_name, opt_name = _partial_names(c)
        sharded = partial_file_names(sharding)
        if sharded is not None:
            model_name, opt_name, _ = sharded
            if not ckpt.has(model_name):
                raise CheckpointLayoutError(
                    f"partial checkpoint {ckpt.folder!r} has no {model_name!r}: it was not saved with this "
                    "sharded_data_parallel_degree. Load it with the degree it was saved with, or save a "
                    "full checkpoint (partial=False), which loads under any degree"
                )
        elif not ckpt.has(model_name):  # mp before manifests: model_{pp}_{tp}.pt
            model_name, opt_name = model_name.replace("_0.pt", ".pt"), opt_name.replace("_0.pt", ".pt")
        sd = ckpt.load(model_name)
        opt_sd = ckpt.load(opt_name) if load_optimizer and ckpt.has(opt_name) else None
        if load_optimizer and opt_sd is None:
            raise CheckpointMissingError(f"partial checkpoint {ckpt.folder!r} has no {opt_name!r}")
        if opt_sd is not None and not _zero():
            _refuse_shares(ckpt, [opt_sd], c)
        user = ckpt.load("user_content.pt", trusted=trusted)
        return sd, opt_sd, user, False
    sd = ckpt.load(tag)
    opt_name = f"optimizer_{tag}"
    opt_sd = ckpt.load(opt_name) if load_optimizer and ckpt.has(opt_name) else None
    user = ckpt.load(f"user_content_{tag}", trusted=trusted) if ckpt.has(f"user_content_{tag}") else None
    return sd, opt_sd, user, False


def _check_zero_layout(ckpt: CheckpointFolder, c: Layout) -> None:
    """Under shard_optimizer_state each rdp rank loads its own share: the checkpoint must hold one per
    rdp rank of this job (saved with shard_optimizer_state and the same data-parallel size)."""
    saved = ckpt.manifest.layout if ckpt.manifest is not None else None
    if saved is not None and saved["rdp"] != c.rdp:
        raise CheckpointLayoutError(
            f"partial checkpoint {ckpt.folder!r} was saved with a reduced-data-parallel size of "
            f"{saved['rdp']}, this job has {c.rdp}; under shard_optimizer_state each rdp rank holds its own "
            "share of the optimizer state, which loads only under the size it was saved with. Resume with "
            f"the same data-parallel size (rdp {saved['rdp']}), or pass load_sharded_optimizer_state=False "
            "to load the model and start the optimizer afresh"
        )
    name = _partial_names(c)[1]
    if not ckpt.has(name) and ckpt.has(f"optimizer_{c.pp_rank}_{c.tp_rank}_0.pt"):
        raise CheckpointLayoutError(
            f"partial checkpoint {ckpt.folder!r} has no {name!r}, the optimizer share of rdp_rank "
            f"{c.rdp_rank} under shard_optimizer_state: it was saved without shard_optimizer_state, or by "
            "an mp that kept rdp_rank 0's share only. Resume it as it was saved (without "
            "shard_optimizer_state), or pass load_sharded_optimizer_state=False to start the optimizer afresh"
        )


def _refuse_shares(ckpt: CheckpointFolder, parts: list[dict[str, Any]], c: Layout) -> None:
    """A ZeRO share (one rdp rank's part of the optimizer state) loads only into the same share: refuse
    it where a whole optimizer state is needed (no shard_optimizer_state, or another pp/tp degree)."""
    if any(read_header(p)[0].zero_param_names is not None for p in parts):
        saved = ckpt.manifest.layout if ckpt.manifest is not None else None
        raise CheckpointLayoutError(
            f"partial checkpoint {ckpt.folder!r} holds the optimizer state sharded over the rdp ranks "
            f"(shard_optimizer_state, saved under {saved}); this job (pp {c.pp}, tp {c.tp}, rdp {c.rdp}, "
            f"shard_optimizer_state {_zero()}) needs a whole one. Resume with shard_optimizer_state and the "
            "layout it was saved with, or pass load_sharded_optimizer_state=False (load_optimizer=False) to "
            "start the optimizer afresh"
        )


def _partial_layout_change(ckpt: CheckpointFolder, c: Layout) -> str | None:
    """None when the partial checkpoint was saved under this job's pp and tp degrees; "pp" when only the
    pipeline degree differs (stages merge at this tp_rank), "tp" when the tensor-parallel degree does
    (every part is read and resharded through the full state)."""
    if ckpt.manifest is None:
        return None
    saved = ckpt.manifest.layout
    if saved["tp"] != c.tp:
        return "tp"
    return "pp" if saved["pp"] != c.pp else None


def _load_optimizer_when_ready(model: DistributedModel, opt_sd: dict[str, Any]) -> None:
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
