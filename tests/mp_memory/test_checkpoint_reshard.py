"""mp-memory's resharding of partial checkpoints, as pure functions of the parts: shards concatenated
along the recorded split dimensions, stages merged, optimizer state keyed by parameter name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mp_memory.checkpoint.errors import CheckpointLayoutError
from mp_memory.checkpoint.reshard import (
    full_model_from_parts,
    full_optimizer_from_parts,
    merge_model_parts,
    merge_optimizer_parts,
)

FULL = {
    "a.w": torch.arange(24.0).reshape(4, 6),
    "a.b": torch.arange(4.0),
    "b.w": torch.arange(8.0).reshape(2, 4),
}
SPLIT = {"a.w": 1, "b.w": 0}  # a.w split by columns, b.w by rows, a.b replicated


def _shard(key: str, tp_rank: int) -> torch.Tensor:
    value = FULL[key]
    if key not in SPLIT:
        return value
    return value.chunk(2, dim=SPLIT[key])[tp_rank].clone()


def _model_parts() -> dict[tuple[int, int], dict[str, Any]]:
    stage_keys = {0: ["a.w", "a.b"], 1: ["b.w"]}
    parts = {}
    for pp in (0, 1):
        for tp in (0, 1):
            part: dict[str, Any] = {k: _shard(k, tp) for k in stage_keys[pp]}
            part["_smp_is_partial"] = True
            part["_smp_layout"] = {"pp": 2, "pp_rank": pp, "tp": 2, "tp_rank": tp, "split": SPLIT}
            parts[(pp, tp)] = part
    return parts


def test_full_state_from_tp_and_pp_parts() -> None:
    renamed = full_model_from_parts(_model_parts(), 2, lambda sd: {f"m.{k}": v for k, v in sd.items()})
    assert sorted(renamed) == ["m.a.b", "m.a.w", "m.b.w"]
    for key, value in FULL.items():
        assert torch.equal(renamed[f"m.{key}"], value), key


def test_stages_merge_at_one_tp_rank() -> None:
    parts = _model_parts()
    merged = merge_model_parts([parts[(0, 1)], parts[(1, 1)]])
    assert sorted(k for k in merged if not k.startswith("_smp_")) == ["a.b", "a.w", "b.w"]
    assert torch.equal(merged["b.w"], _shard("b.w", 1)) and merged["_smp_layout"]["tp_rank"] == 1


def _optimizer_part(pp: int, tp: int) -> dict[str, Any]:
    names = [["a.w", "a.b"]] if pp == 0 else [["b.w"]]
    state = {i: {"exp_avg": _shard(n, tp) * 2, "step": torch.tensor(3.0)} for i, n in enumerate(names[0])}
    groups = [{"lr": 0.1, "params": list(range(len(names[0])))}]
    return {"state": state, "param_groups": groups, "_smp_is_partial": True, "_smp_param_names": names}


def test_optimizer_state_by_name() -> None:
    parts = {(pp, tp): _optimizer_part(pp, tp) for pp in (0, 1) for tp in (0, 1)}
    merged = merge_optimizer_parts([parts[(0, 0)], parts[(1, 0)]])
    assert sorted(merged["state"]) == ["a.b", "a.w", "b.w"] and merged["_smp_tp_shards"] is True
    full = full_optimizer_from_parts(parts, _model_parts(), 2, lambda sd: sd)
    for key, value in FULL.items():
        assert torch.equal(full["state"][key]["exp_avg"], value * 2), key
        assert float(full["state"][key]["step"]) == 3.0
    assert full["param_groups"] == [{"lr": 0.1, "params": []}] and full["_smp_keyed_by_name"] is True


def test_optimizer_parts_without_names_are_refused() -> None:
    part = _optimizer_part(0, 0)
    del part["_smp_param_names"]
    with pytest.raises(CheckpointLayoutError, match="_smp_param_names"):
        merge_optimizer_parts([part])
