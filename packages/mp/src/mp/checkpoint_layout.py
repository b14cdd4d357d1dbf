"""Resuming a partial checkpoint under another pipeline degree (same tensor-parallel degree).

Each rank reads every stage's part of its own tp_rank: together they are the whole model at this
rank's TP shards, under mp's names, so no translation is needed. The model keeps what its own
partition assigns it; the optimizer state is matched to parameters by name (each local optimizer part
carries its parameters' names), so the new partition may group parameters differently.
"""

from __future__ import annotations

from typing import Any

from mp.errors import IncompatibleCheckpointFoundError
from mp.state_dicts import local_layout_check

__all__ = ["load_merged_model", "merge_model_parts", "merge_optimizer_parts"]


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
