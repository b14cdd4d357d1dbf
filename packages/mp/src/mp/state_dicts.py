"""The model's state dicts in smp's two forms, for `DistributedModel`.

- Full (``state_dict``): the whole model with the original module's key names and full tensors:
  tensor-parallel shards all-gathered over the TP group and translated back by their replacement's
  ``to_original`` (a Hugging Face model's own names), pipeline stages all-gathered over the PP group.
  It loads into the unwrapped model with ``load_state_dict(strict=True)``, and into a
  ``DistributedModel`` of any layout, each rank keeping its own shards.
  A distributed module that the pipeline split over stages (smp's whole GPT-2, whose layers are
  partitioned) is gathered stage by stage in its own layout and translated once all stages are in.
- Local (``local_state_dict``): this rank's stage, TP shards as they are, with a partial header and the
  TP layout (``mp_memory.checkpoint.schema``: the pp/tp degrees and ranks and each shard's split
  dimension), so that loading it on another rank or layout is refused instead of silently taking another
  rank's shard.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mp.errors import IncompatibleCheckpointFoundError
from mp.state import state
from mp_comm import GroupKind
from mp_memory import TPLayout
from mp_partition import Placement
from mp_tensor import (
    ORIGINAL_ATTR,
    DistributedModule,
    Replacement,
    distributed_roots,
    gather_state_dict,
    load_original_state_dict,
    param_spec,
)

__all__ = ["full_state_dict", "layout_of", "load_full_state_dict", "local_layout_check"]


def _cpu(v: Any, cast_to_cpu: bool) -> Any:
    return v.detach().cpu() if cast_to_cpu and isinstance(v, torch.Tensor) else v


def _roots(module: nn.Module) -> list[tuple[str, DistributedModule]]:
    return list(distributed_roots(module))


_RAW = "\x00mp-untranslated:"
"""Key prefix of a stage's part (own layout) of a distributed module split over stages."""


def _split_roots(module: nn.Module, placement: Placement) -> set[str]:
    """Prefixes of the distributed modules whose entries lie on several pipeline stages."""
    if not placement.pipelined:
        return set()
    return {
        prefix
        for prefix, root in _roots(module)
        if len({placement.owner(prefix + k) for k in root.state_dict(keep_vars=True)}) > 1
    }


def _replacement(root: DistributedModule) -> Replacement | None:
    found = root.__dict__.get(ORIGINAL_ATTR)
    return found if isinstance(found, Replacement) else None


def _stage_state(module: nn.Module, placement: Placement, cast_to_cpu: bool) -> OrderedDict[str, Any]:
    """This stage's part of the full state (every stage's when not partitioned), original names; a
    distributed module split over stages gives its part under ``_RAW + prefix``, untranslated."""
    roots = _roots(module)
    split = _split_roots(module, placement)
    out: OrderedDict[str, Any] = OrderedDict()
    done: set[str] = set()
    for key, value in module.state_dict().items():
        if not placement.holds(key):
            continue
        root = next(((p, m) for p, m in roots if key.startswith(p)), None)
        if root is None:
            out[key] = _cpu(value, cast_to_cpu)
        elif root[0] in split and root[0] not in done:
            done.add(root[0])
            mine = {k for k in root[1].state_dict(keep_vars=True) if placement.holds(root[0] + k)}
            part = root[1].full_state_dict(keep=mine.__contains__)
            out[_RAW + root[0]] = {k: _cpu(v, cast_to_cpu) for k, v in part.items()}
        elif root[0] not in done:
            done.add(root[0])
            # Collective over the TP group: its ranks hold the same stage and walk the same keys.
            for k, v in gather_state_dict(root[1]).items():
                out[root[0] + k] = _cpu(v, cast_to_cpu)
    return out


def full_state_dict(module: nn.Module, placement: Placement, cast_to_cpu: bool) -> OrderedDict[str, Any]:
    """The full, gathered state of ``module`` placed by ``placement`` (see the module docstring);
    collective over the TP and PP groups."""
    stage = _stage_state(module, placement, cast_to_cpu)
    if not placement.pipelined:
        return stage
    placement.enter("model.state_dict()")
    parts: list[Any] = [None] * placement.pp_size
    dist.all_gather_object(parts, stage, group=placement.pp_group)
    items, raw = [], dict[str, dict[str, Any]]()
    for key, value in (item for part in parts for item in part.items()):
        if key.startswith(_RAW):
            raw.setdefault(key[len(_RAW) :], {}).update(value)
        else:
            items.append((key, value))
    roots = dict(_roots(module))
    for prefix, own in raw.items():
        replacement = _replacement(roots[prefix])
        original = own if replacement is None else replacement.to_original(own)
        items += [(prefix + k, v) for k, v in original.items()]
    return _in_model_order(module, items)


def _in_model_order(module: nn.Module, items: list[tuple[str, Any]]) -> OrderedDict[str, Any]:
    """The stages' entries in the order of the model's own ``state_dict()``, as plain PyTorch gives them
    (stages interleave in that order when a model calls its children out of definition order). A
    tensor-parallel module's translated keys take its place, in the order it gave them."""
    order = {k: i for i, k in enumerate(module.state_dict(keep_vars=True))}
    root_at = {
        p: min((i for k, i in order.items() if k.startswith(p)), default=len(order))
        for p, _ in _roots(module)
    }

    def position(entry: tuple[int, tuple[str, Any]]) -> tuple[int, int]:
        n, (key, _) = entry
        if key in order:
            return order[key], 0
        root = next((p for p in root_at if key.startswith(p)), None)
        return (root_at[root] if root is not None else len(order)), n

    return OrderedDict(item for _, item in sorted(enumerate(items), key=position))


def load_full_state_dict(module: nn.Module, placement: Placement, sd: dict[str, Any], strict: bool) -> Any:
    """Load a full state (original names, full tensors) into ``module``: every rank keeps its own TP
    shards and, once partitioned, only its stage. Returns torch's ``(missing_keys, unexpected_keys)``
    for the rest."""
    roots = _roots(module)
    split = _split_roots(module, placement)
    rest = {k: v for k, v in sd.items() if not any(k.startswith(p) for p, _ in roots)}
    for prefix, root in roots:
        part = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        if prefix in split:
            _load_stage_part(placement, prefix, root, part, strict)
            continue
        if placement.pipelined and placement.module_owner(prefix[:-1]) != placement.pp_rank:
            continue
        if not part and not strict:
            continue
        own = set(root.state_dict(keep_vars=True))
        if part and set(part) <= own:  # full tensors under the distributed module's own names
            root.load_full_state_dict(part, strict=strict)
        else:
            load_original_state_dict(root, part, strict=strict)
    expected = {
        k
        for k in module.state_dict(keep_vars=True)
        if not any(k.startswith(p) for p, _ in roots) and placement.holds(k)
    }
    every = {k for k in module.state_dict(keep_vars=True) if not any(k.startswith(p) for p, _ in roots)}
    local = {k: v for k, v in rest.items() if k in expected}
    if strict:
        missing = sorted(expected - set(rest))
        unexpected = sorted(set(rest) - every)
        if missing or unexpected:
            raise RuntimeError(
                f"load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; expected "
                "the keys of model.state_dict() (the original module's names; pass strict=False to ignore)"
            )
    return module.load_state_dict(local, strict=False)


def _load_stage_part(
    placement: Placement, prefix: str, root: DistributedModule, part: dict[str, Any], strict: bool
) -> None:
    """This stage's entries of a distributed module split over stages, from its full state (original or
    own names)."""
    own = set(root.state_dict(keep_vars=True))
    replacement = _replacement(root)
    if part and not set(part) <= own and replacement is not None:
        part = replacement.from_original(part)
    mine = {k for k in own if placement.owner(prefix + k) == placement.pp_rank}
    if strict and not mine <= set(part):
        raise RuntimeError(
            f"load_state_dict: missing keys {sorted(prefix + k for k in mine - set(part))[:10]}; expected "
            "the keys of model.state_dict() (the original module's names; pass strict=False to ignore)"
        )
    root.load_full_state_dict({k: v for k, v in part.items() if k in mine}, strict=False)


def layout_of(module: nn.Module, placement: Placement) -> TPLayout:
    """The TP layout of a local state dict: degrees, ranks, and each TP shard's split dimension."""
    tp = state.process_groups.get(GroupKind.TP) if state.initialized else None
    tp_size = dist.get_world_size(tp) if tp is not None else 1
    tp_rank = dist.get_rank(tp) if tp is not None else 0
    split: dict[str, int] = {}
    for prefix, root in _roots(module):
        for name, p in root.named_parameters():
            spec = param_spec(p)
            if spec is not None and spec.split_dim is not None:
                split[prefix + name] = spec.split_dim % max(p.dim(), 1)
    return TPLayout(placement.pp_size, placement.pp_rank, tp_size, tp_rank, split)


def local_layout_check(module: nn.Module, placement: Placement, saved: TPLayout | None) -> None:
    """Refuse a local state saved by another TP rank or degree when it holds TP shards."""
    if saved is None or not saved.split:
        return
    mine = layout_of(module, placement)
    if (saved.tp, saved.tp_rank) != (mine.tp, mine.tp_rank):
        raise IncompatibleCheckpointFoundError(
            f"this partial state dict holds the tensor-parallel shards of tp_rank {saved.tp_rank} of "
            f"{saved.tp}; this rank is tp_rank {mine.tp_rank} of {mine.tp}: load each rank's "
            "own part (smp.load(..., partial=True) picks it), or load the full model.state_dict(), which "
            "loads under any layout"
        )
