"""save_checkpoint / resume_from_checkpoint under shard_optimizer_state (ZeRO-1) on real worlds.

Every rdp rank holds its own share of the optimizer state, so every one writes it
(``optimizer_{pp}_{tp}_{rdp}.pt``) and the manifest lists them all. A job trains 2 Adam steps, saves a
partial checkpoint (synchronously, in the background, or under bf16 with its fp32 masters) and trains 2
more; a fresh job (another seed) resumes from it and trains the same 2 steps: its losses, parameters and
every rank's optimizer share equal the uninterrupted run's (1e-6). Resuming the shares under another
data-parallel size, or without shard_optimizer_state, is refused naming both layouts and the fix.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import mp as smp
from mp.errors import IncompatibleCheckpointFoundError
from tests.mp_pipeline.models import batch, build, first_difference, loss_of, make_optimizer

TOL = 1e-6


def _flat_state(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of an optimizer's state dict, by ``state.<index>.<key>`` (numbers as tensors)."""
    out = {}
    for i, entry in sorted(sd["state"].items()):
        for k, v in sorted(entry.items()):
            out[f"state.{i}.{k}"] = torch.as_tensor(v).detach().clone().double()
    for g, group in enumerate(sd["param_groups"]):
        out[f"group.{g}.lr"] = torch.tensor(float(group["lr"]))
    for name, master in sorted(sd.get("fp32_master_params", {}).items()):  # bf16: the fp32 masters
        out[f"master.{name}"] = master.detach().clone().double()
    return out


def _session(
    config: dict[str, Any], folder: str, seed: int, resume: bool, async_save: bool
) -> dict[str, Any]:
    smp.init(config)
    model = smp.DistributedModel(build("mlp", seed=seed))
    opt = smp.DistributedOptimizer(make_optimizer("mlp", model.parameters()))
    if resume:
        smp.resume_from_checkpoint(folder)

    @smp.step
    def train_step(*data: torch.Tensor) -> torch.Tensor:
        loss = loss_of("mlp", model, data)
        model.backward(loss)
        return loss

    losses = []
    for s in range(2 if resume else 0, 4):
        if s == 2 and not resume:
            smp.save_checkpoint(
                folder, "step2", partial=True, model=model, optimizer=opt, async_save=async_save
            )
        losses.append(train_step(*batch("mlp", s, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    out = {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "opt": _flat_state(opt.local_state_dict()),
        "shares": len(opt.local_state_dict()["state"]),
    }
    smp.reset()
    return out


def _resume_equals_uninterrupted(
    world: Any, pp: int, folder: str, async_save: bool, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    config = {
        "pipeline_parallel_degree": pp,
        "microbatches": 2,
        "shard_optimizer_state": True,
        **(extra or {}),
    }
    first = _session(config, folder, 0, False, async_save)
    again = _session(config, folder, 1, True, async_save)
    return {
        "losses": max(abs(a - b) for a, b in zip(first["losses"][2:], again["losses"], strict=True)),
        "params": first_difference(again["params"], first["params"], rtol=0, atol=TOL),
        "opt": first_difference(again["opt"], first["opt"], rtol=0, atol=TOL),
        "shares": first["shares"],
    }


@pytest.mark.parametrize(
    ("ranks", "pp", "async_save", "extra"),
    [(2, 1, False, {}), (2, 1, True, {}), (4, 2, False, {}), (2, 1, False, {"bf16": True})],
    ids=["dp2", "dp2-async", "pp2xdp2", "dp2-bf16"],
)
def test_resume_under_zero_equals_the_uninterrupted_run(  # noqa: PLR0917
    worlds: Any, tmp_path: Any, ranks: int, pp: int, async_save: bool, extra: dict[str, Any]
) -> None:
    results = worlds.run(
        ranks, _resume_equals_uninterrupted, pp, str(tmp_path), async_save, extra, timeout=400
    )
    for r in results:
        assert r["losses"] <= TOL and r["params"] is None and r["opt"] is None, r
        assert r["shares"] > 0, r  # every rank holds some of the state (what it saved and compared)
    manifest = json.loads((tmp_path / "step2_partial" / "manifest.json").read_text())
    rdp = ranks // pp
    want = {f"optimizer_{p}_0_{d}.pt" for p in range(pp) for d in range(rdp)}
    want |= {f"model_{p}_0_0.pt" for p in range(pp)} | {"user_content.pt"}
    assert set(manifest["parts"]) == want
    assert manifest["replicated"] is False
    assert set(os.listdir(tmp_path / "step2_partial")) == want | {"manifest.json"}


def _resume_elsewhere(world: Any, folder: str, config: dict[str, Any]) -> str:
    smp.init(config)
    model = smp.DistributedModel(build("mlp", seed=1))
    smp.DistributedOptimizer(make_optimizer("mlp", model.parameters()))
    try:
        with pytest.raises(IncompatibleCheckpointFoundError) as caught:
            smp.resume_from_checkpoint(folder)
    finally:
        smp.reset()
    return str(caught.value)


def test_zero_shares_are_refused_under_another_layout(worlds: Any, tmp_path: Any) -> None:
    worlds.run(2, _resume_equals_uninterrupted, 1, str(tmp_path), False, timeout=400)
    (other_size,) = worlds.run(
        1, _resume_elsewhere, str(tmp_path), {"shard_optimizer_state": True}, timeout=120
    )
    assert "reduced-data-parallel size of 2, this job has 1" in other_size, other_size
    assert "same data-parallel size" in other_size, other_size
    for msg in worlds.run(2, _resume_elsewhere, str(tmp_path), {"microbatches": 2}, timeout=120):
        assert "sharded over the rdp ranks" in msg and "shard_optimizer_state False" in msg, msg
