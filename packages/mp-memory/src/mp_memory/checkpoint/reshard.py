"""Resharding partial checkpoints: every rank's local state dicts made into one state for a new layout.

Another pipeline degree at the same tensor-parallel degree: :func:`merge_model_parts` and
:func:`merge_optimizer_parts` join every stage's part of one tp_rank (names stay; optimizer state is
keyed by the parameter names each part records). Another tensor-parallel degree:
:func:`full_model_from_parts` and :func:`full_optimizer_from_parts` concatenate each tp_rank's shards
along the split dimensions the parts record (their ``schema.TPLayout``) into full tensors, then
``translate`` (passed in by the caller, which knows the model's tensor-parallel blocks) renames them
for the loading model. Pure functions of the parts: no process groups, no model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from mp_memory.checkpoint.errors import CheckpointLayoutError
from mp_memory.checkpoint.schema import KEYS, Header, read_header, write_header

__all__ = ["full_model_from_parts", "full_optimizer_from_parts", "merge_model_parts", "merge_optimizer_parts"]

Parts = dict[tuple[int, int], dict[str, Any]]
"""Local state dicts by (pp_rank, tp_rank) of the saving job."""
Translate = Callable[[dict[str, Any]], dict[str, Any]]


def merge_model_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state of the whole model from every stage's local state (same tp_rank), with the first
    part's TP layout (the split dimensions of every stage's shards)."""
    merged: dict[str, Any] = {}
    layout = None
    for part in parts:
        header, state = read_header(part)
        merged.update(state)
        layout = layout or header.tp_layout
    if layout is not None:
        layout = replace(layout, split={k: d for p in parts for k, d in _split_of(p).items()})
    return write_header(merged, Header(tp_layout=layout))


def merge_optimizer_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every stage's local optimizer state, keyed by parameter name (this rank's TP shards)."""
    named: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for raw in parts:
        header, part = read_header(raw)
        names = header.param_names
        if names is None:
            raise CheckpointLayoutError(
                f"a partial optimizer state without its parameter names ({KEYS['param_names']!r}) cannot "
                "move to another pipeline_parallel_degree; resume it with the layout it was saved with"
            )
        for gi, (group, listed) in enumerate(zip(part["param_groups"], names, strict=True)):
            for index, name in zip(group["params"], listed, strict=True):
                if index in part["state"] and name is not None:
                    named[name] = part["state"][index]
            if gi >= len(groups):
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": []})
            groups[gi]["params"] += [n for n in listed if n is not None]
    state = {"state": named, "param_groups": groups}
    return write_header(state, Header(keyed_by_name=True, tp_shards=True))


def _split_of(part: dict[str, Any]) -> dict[str, int]:
    layout = read_header(part)[0].tp_layout
    return {} if layout is None else dict(layout.split)


def _split(parts: Parts) -> dict[str, int]:
    split: dict[str, int] = {}
    for part in parts.values():
        split.update(_split_of(part))
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


def full_model_from_parts(parts: Parts, tp: int, translate: Translate) -> dict[str, Any]:
    """The full state of the saved model; ``translate`` renames it for the loading model."""
    stages = sorted({p for p, _ in parts})
    per_tp = [read_header(merge_model_parts([parts[(p, t)] for p in stages]))[1] for t in range(tp)]
    return translate(_concat(per_tp, _split(parts)))


def full_optimizer_from_parts(
    parts: Parts, model_parts: Parts, tp: int, translate: Translate
) -> dict[str, Any]:
    """A name-keyed full optimizer state from every rank's local one (optimizer.load_state_dict takes
    it under any layout)."""
    stages = sorted({p for p, _ in parts})
    per_tp = [read_header(merge_optimizer_parts([parts[(p, t)] for p in stages]))[1] for t in range(tp)]
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
            for name, value in translate(_concat(tensors, split)).items():
                state.setdefault(name, {})[key] = value
        else:  # per-parameter scalars (Adam's step): the same for every parameter
            scalars[key] = next(iter(shards[0].values()))
    for entry in state.values():
        for key, value in scalars.items():
            entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in per_tp[0]["param_groups"]
    ]
    return write_header({"state": state, "param_groups": groups}, Header(keyed_by_name=True))
