"""Resuming a partial checkpoint under another layout.

Another pipeline degree, same tensor-parallel degree: each rank reads every stage's part of its own
tp_rank. Together they are the whole model at this rank's TP shards, under mp's names, so no translation
is needed. The model keeps what its own partition assigns it; the optimizer state is matched to
parameters by name (each local optimizer part carries its parameters' names).

Another tensor-parallel degree: each rank reads every part, concatenates the TP shards along the split
dimension each part records (``_smp_layout``), and, where this model has the original module instead of
the saving job's TP block, translates the block back with its registration's ``to_original``. The
result is a full state (and a name-keyed full optimizer state) that loads under any layout.
"""

from __future__ import annotations

from typing import Any

import torch

from mp.errors import IncompatibleCheckpointFoundError
from mp.state_dicts import local_layout_check
from mp_tensor.registry import default_registry

__all__ = [
    "full_model_from_parts",
    "full_optimizer_from_parts",
    "load_merged_model",
    "merge_model_parts",
    "merge_optimizer_parts",
]

Parts = dict[tuple[int, int], dict[str, Any]]
"""Local state dicts by (pp_rank, tp_rank) of the saving job."""


def merge_model_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state of the whole model from every stage's local state (same tp_rank)."""
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update({k: v for k, v in part.items() if not k.startswith("_smp_")})
    layouts = [p["_smp_layout"] for p in parts if "_smp_layout" in p]
    if layouts:
        merged["_smp_layout"] = layouts[0]
    return merged


def load_merged_model(model: Any, merged: dict[str, Any], strict: bool) -> None:
    """Load the whole-model state at this rank's TP shards: all of it before partitioning (pp > 1: the
    partition then frees what other stages own), this rank's stage after."""
    layout = merged.get("_smp_layout")
    if isinstance(layout, dict):
        local_layout_check(model, layout)
    sd = {k: v for k, v in merged.items() if not k.startswith("_smp_")}
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    keys = list(model.module.state_dict(keep_vars=True))
    if model.partitioned and model._pp > 1:
        keys = [k for k in keys if model._owner(k) == model._pp_rank]
        sd = {k: v for k, v in sd.items() if k in set(keys)}
    missing = sorted(set(keys) - set(sd))
    if strict and missing:
        raise IncompatibleCheckpointFoundError(
            f"the partial checkpoint's parts lack {len(missing)} keys of this model {missing[:6]}: it was "
            "saved from another model; load the model it was saved from (or pass strict=False)"
        )
    model.module.load_state_dict(sd, strict=False)


def merge_optimizer_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every stage's local optimizer state, keyed by parameter name (this rank's TP shards)."""
    named: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        names = part.get("_smp_param_names")
        if names is None:
            raise IncompatibleCheckpointFoundError(
                "a partial optimizer state without '_smp_param_names' cannot move to another "
                "pipeline_parallel_degree; resume it with the layout it was saved with"
            )
        for gi, (group, listed) in enumerate(zip(part["param_groups"], names, strict=True)):
            for index, name in zip(group["params"], listed, strict=True):
                if index in part["state"] and name is not None:
                    named[name] = part["state"][index]
            if gi >= len(groups):
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": []})
            groups[gi]["params"] += [n for n in listed if n is not None]
    return {"state": named, "param_groups": groups, "_smp_keyed_by_name": True, "_smp_tp_shards": True}


def _split(parts: Parts) -> dict[str, int]:
    split: dict[str, int] = {}
    for part in parts.values():
        layout = part.get("_smp_layout")
        if isinstance(layout, dict):
            split.update(layout.get("split", {}))
    return split


def _concat(per_tp: list[dict[str, Any]], split: dict[str, int]) -> dict[str, Any]:
    """Full tensors from each tp_rank's shards (tp_rank order), shared entries from tp_rank 0."""
    out: dict[str, Any] = {}
    for key, value in per_tp[0].items():
        if key in split and isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = torch.cat([p[key] for p in per_tp], dim=split[key])
        else:
            out[key] = value
    return out


def _original_names(model: Any, full: dict[str, Any]) -> dict[str, Any]:
    """``full`` with the saving job's TP blocks translated back where this model has the original
    module (a tp = 1 job); unchanged where this model has the same TP blocks."""
    if set(full) <= set(model.module.state_dict(keep_vars=True)):
        return full
    out = dict(full)
    for path, module in model.module.named_modules():
        registration = default_registry.lookup(module)
        if registration is None or not path:
            continue
        prefix = path + "."
        part = {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
        if not part or set(part) <= set(module.state_dict(keep_vars=True)):
            continue
        for key in part:
            out.pop(prefix + key, None)
        translated = part if registration.to_original is None else registration.to_original(part)
        out.update({prefix + k: v for k, v in translated.items()})
    return out


def full_model_from_parts(model: Any, parts: Parts, tp: int) -> dict[str, Any]:
    """The full state of the saved model, in names this model loads (see the module docstring)."""
    stages = sorted({p for p, _ in parts})
    per_tp = [merge_model_parts([parts[(p, t)] for p in stages]) for t in range(tp)]
    for merged in per_tp:
        merged.pop("_smp_layout", None)
    return _original_names(model, _concat(per_tp, _split(parts)))


def full_optimizer_from_parts(model: Any, parts: Parts, model_parts: Parts, tp: int) -> dict[str, Any]:
    """A name-keyed full optimizer state from every rank's local one (optimizer.load_state_dict takes
    it under any layout)."""
    stages = sorted({p for p, _ in parts})
    per_tp = [merge_optimizer_parts([parts[(p, t)] for p in stages]) for t in range(tp)]
    split = _split(model_parts)
    keys = sorted({k for st in per_tp[0]["state"].values() for k in st})
    state: dict[str, dict[str, Any]] = {}
    scalars: dict[str, Any] = {}
    for key in keys:
        shards = [{n: st[key] for n, st in m["state"].items() if key in st} for m in per_tp]
        tensors = [
            {n: v for n, v in sh.items() if isinstance(v, torch.Tensor) and v.dim() > 0} for sh in shards
        ]
        if tensors[0]:  # per-element state: concatenated and translated like the weights
            for name, value in _original_names(model, _concat(tensors, split)).items():
                state.setdefault(name, {})[key] = value
        else:  # per-parameter scalars (Adam's step): the same for every parameter
            scalars[key] = next(iter(shards[0].values()))
    for entry in state.values():
        for key, value in scalars.items():
            entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in per_tp[0]["param_groups"]
    ]
    return {"state": state, "param_groups": groups, "_smp_keyed_by_name": True}
