"""The partition_file and load_partition config keys on a real 2-rank pipeline: one run writes its
partition, a later run that would partition differently reads it and trains exactly like the first;
a missing or unfitting file fails the first step on every rank, before any training."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import mp as smp
from mp_partition import set_partition
from tests.integration._pp2_net import PP2, Net

BASE = dict(PP2)  # manual partitioning, default partition 0: unmarked modules stay on pp_rank 0


@smp.step
def _train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _run(config: dict[str, Any], mark: bool) -> dict[str, Any]:
    """Two training steps from seed 0; the losses and what this rank holds."""
    smp.init(config)
    try:
        torch.manual_seed(0)
        net = Net()
        if mark:
            set_partition(net.b, 1)
            set_partition(net.c, 1)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        losses = []
        for i in range(2):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            opt.zero_grad()
            losses.append(_train_step(model, x, y).reduce_mean().item())
            opt.step()
        owned = sorted(name for name, _ in model.local_named_parameters())
        return {"losses": losses, "owned": owned}
    finally:
        smp.reset()


def _first_step_error(config: dict[str, Any]) -> str:
    try:
        _run(config, mark=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _write_and_read(world: Any, folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "partition.json")
    out: dict[str, Any] = {"written": _run({**BASE, "partition_file": path}, mark=True)}
    out["file"] = json.loads(Path(path).read_text()) if world.rank == 0 else None
    # Nothing marked: without the file, everything would stay on pp_rank 0.
    out["unmarked"] = _run(dict(BASE), mark=False)
    out["read"] = _run({**BASE, "partition_file": path, "load_partition": True}, mark=False)
    missing = os.path.join(folder, "missing.json")
    out["missing"] = _first_step_error({**BASE, "partition_file": missing, "load_partition": True})
    wrong = os.path.join(folder, "wrong.json")
    if world.rank == 0:
        data = json.loads(Path(path).read_text())
        with open(wrong, "w") as f:
            json.dump({**data, "partition": {**data["partition"], "d": 1}}, f)
    out["unfit"] = _first_step_error({**BASE, "partition_file": wrong, "load_partition": True})
    return out


def test_a_partition_file_fixes_the_partition_across_runs(worlds: Any, tmp_path: Any) -> None:
    r0, r1 = worlds.run(2, _write_and_read, str(tmp_path), timeout=120)
    written = r0["file"]
    assert written["format"] == "mp-partition/1" and written["pipeline_parallel_degree"] == 2
    assert written["partition"]["b"] == written["partition"]["c"] == 1, written
    assert written["partition"].get("a", 0) == 0, written
    # The unmarked run puts everything on pp_rank 0; reading the file restores the written split, and
    # the run trains exactly like the one that wrote it.
    assert r1["unmarked"]["owned"] == []
    for r in (r0, r1):
        assert r["read"] == r["written"], (r["read"], r["written"])
    assert r0["read"]["owned"] == ["module.a.bias", "module.a.weight"]
    assert r1["read"]["owned"] == ["module.b.bias", "module.b.weight", "module.c.bias", "module.c.weight"]
    # A missing file is refused by smp.init before any work: on rank 0 (which reads it) by its own
    # check, on rank 1 by rank 0's refusal, which it carries.
    assert r0["missing"].startswith("ConfigError: config key 'partition_file'"), r0["missing"]
    assert r1["missing"].startswith("WorldError: rank 0 of 2 refused to start"), r1["missing"]
    for r in (r0, r1):
        assert "missing.json" in r["missing"] and "no readable file there" in r["missing"], r["missing"]
    # A file that does not fit the model: on rank 0 the file's own error at the first step, on rank 1
    # the same text carried by SMPRuntimeError.
    key, words = "unfit", "modules ['d'] are not in this model"
    assert r0[key].startswith("PartitionFileError: "), r0[key]
    assert r1[key].startswith("SMPRuntimeError: partitioning the model failed on rank 0"), r1[key]
    for r in (r0, r1):
        assert words in r[key] and "partition_file" in r[key], r[key]
