"""smp's checkpoint idioms on real worlds: smp.save/smp.load (partial and full), the gathered optimizer
state, save_checkpoint/resume_from_checkpoint, and set_activation_checkpointing.

The round trips train 2 steps, save, train a third step and record the parameters; then start over
(smp.reset, a fresh model and optimizer with another seed), load, train the third step again: the
parameters must be exactly equal."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp.errors import (
    CheckpointingConfigError,
    DistributedModelNotWrappedError,
    IncompatibleCheckpointFoundError,
    IncompatibleCheckpointRankFoundError,
    MissingCheckpointFilesError,
    SMPCheckpointError,
)
from mp_partition import set_partition
from tests.integration._pp2_net import PP2, Net


def _build(config: dict[str, Any], seed: int) -> tuple[smp.DistributedModel, torch.optim.Optimizer, Any]:
    smp.init(config)
    torch.manual_seed(seed)
    net = Net()
    if config.get("pipeline_parallel_degree", 1) > 1:
        set_partition(net.b, 1)
        set_partition(net.c, 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


@smp.step
def _train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _train(model: smp.DistributedModel, opt: torch.optim.Optimizer, sched: Any, i: int) -> None:
    g = torch.Generator().manual_seed(1000 * i + smp.dp_rank())
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    opt.zero_grad()
    _train_step(model, x, y)
    opt.step()
    sched.step()


def _params(model: smp.DistributedModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}  # collective over each pipeline


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    if a.keys() != b.keys():
        return f"keys differ: {sorted(a.keys() ^ b.keys())}"
    for k, value in a.items():
        if not torch.equal(value, b[k]):
            return f"{k}: max |diff| {(value - b[k]).abs().max().item()}"
    return None


def _save_load_round_trip(world: Any, config: dict[str, Any], folder: str, partial: bool) -> str | None:
    path = os.path.join(folder, "ckpt.pt")
    model, opt, sched = _build(config, seed=0)
    for i in range(2):
        _train(model, opt, sched, i)
    if smp.dp_rank() == 0:  # the smp idiom: one replica saves, every rank loads
        if partial:
            content = {"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}
        else:
            content = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        content["scheduler"] = sched.state_dict()
        smp.save(content, path, partial=partial)
    smp.barrier()
    _train(model, opt, sched, 2)
    expected = _params(model)
    smp.reset()

    model, opt, sched = _build(config, seed=1)  # another init: only the load can make them equal
    loaded = smp.load(path, partial=partial)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["scheduler"])
    _train(model, opt, sched, 2)
    return _first_difference(expected, _params(model))


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "full"])
def test_save_load_round_trip_pp2(worlds: Any, tmp_path: Any, partial: bool) -> None:
    results = worlds.run(2, _save_load_round_trip, PP2, str(tmp_path), partial, timeout=120)
    assert results == [None, None], results
    names = sorted(os.listdir(tmp_path))
    parts = ["ckpt.pt_0_0_0", "ckpt.pt_1_0_0"] if partial else ["ckpt.pt"]  # smp >= 1.10's names
    assert names == sorted(["ckpt.pt.mp-manifest.json", *parts]), names


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "full"])
def test_save_on_dp_rank_0_round_trip_pp2_dp2(worlds: Any, tmp_path: Any, partial: bool) -> None:
    results = worlds.run(4, _save_load_round_trip, PP2, str(tmp_path), partial, timeout=180)
    assert results == [None] * 4, results


def _optimizer_state_forms(world: Any) -> dict[str, Any]:
    model, opt, sched = _build(PP2, seed=0)
    _train(model, opt, sched, 0)
    full = opt.state_dict()
    local = opt.local_state_dict()
    # the full form numbers the 6 parameters as the unpartitioned optimizer does
    return {
        "full_params": full["param_groups"][0]["params"],
        "full_state": sorted(full["state"]),
        "local_params": local["param_groups"][0]["params"],
        "local_names": local["_smp_param_names"],
    }


def test_optimizer_state_dict_is_gathered_over_the_pipeline(worlds: Any) -> None:
    r0, r1 = worlds.run(2, _optimizer_state_forms, timeout=120)
    for r in (r0, r1):
        assert r["full_params"] == list(range(6)) and r["full_state"] == list(range(6)), r
    assert r0["local_params"] == [0, 1] and r1["local_params"] == [0, 1, 2, 3], (r0, r1)
    assert r0["local_names"] == [["a.weight", "a.bias"]]
    assert r1["local_names"] == [["b.weight", "b.bias", "c.weight", "c.bias"]]


def _wrong_layout(world: Any, folder: str) -> dict[str, str]:
    path = os.path.join(folder, "ckpt.pt")
    model, opt, sched = _build(PP2, seed=0)
    _train(model, opt, sched, 0)
    smp.save(model.local_state_dict(), path, partial=True)
    smp.reset()
    out: dict[str, str] = {}
    # the same world with pp=1 (dp=2): the files say pp=2
    smp.init({"microbatches": 2})
    try:
        smp.load(path, partial=True)
    except IncompatibleCheckpointRankFoundError as exc:  # the files name pp_rank 1, absent at pp=1
        out["load"] = str(exc)
    part0 = torch.load(os.path.join(folder, "ckpt.pt_0_0_0"), weights_only=True)
    smp.barrier()
    if smp.rank() == 0:  # a missing part
        os.remove(os.path.join(folder, "ckpt.pt_0_0_0"))
    smp.barrier()
    smp.reset()
    smp.init(PP2)
    try:
        smp.load(path, partial=True)
    except MissingCheckpointFilesError as exc:
        out["missing"] = str(exc)
    smp.reset()
    # a partial state dict of pp_rank 0 loaded into a pp=1 model
    model, _, _ = _build({"microbatches": 2}, seed=0)
    try:
        model.load_state_dict(part0)
    except IncompatibleCheckpointFoundError as exc:
        out["model"] = str(exc)
    return out


def test_loading_a_partial_checkpoint_under_another_layout_names_both(worlds: Any, tmp_path: Any) -> None:
    for r in worlds.run(2, _wrong_layout, str(tmp_path), timeout=120):
        assert "saved with pipeline_parallel_degree=2" in r["load"], r
        assert "this job runs with pipeline_parallel_degree=1" in r["load"], r
        assert "ckpt.pt_0_0_0' is missing (the manifest lists it" in r["missing"], r
        assert "lacks 4 of this rank's keys" in r["model"] and "b.weight" in r["model"], r


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle this on purpose")


def _failing_save(world: Any, folder: str) -> str:
    smp.init(PP2)
    obj: Any = {"x": torch.ones(2)}
    if smp.rank() == 1:
        obj["bad"] = Unpicklable()
    try:
        smp.save(obj, os.path.join(folder, "f.pt"), partial=True)
    except SMPCheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_failed_save_on_one_rank_raises_on_every_rank(worlds: Any, tmp_path: Any) -> None:
    for msg in worlds.run(2, _failing_save, str(tmp_path), timeout=60):
        assert "rank 1" in msg and "cannot pickle this on purpose" in msg, msg
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]  # no torn temporary file left


def test_translate_if_full_false_is_refused_before_anything_is_written(tmp_path: Any) -> None:
    """smp's False kept its own distributed key names, which mp's modules do not have: refused by name."""
    with pytest.raises(SMPCheckpointError, match=r"translate_if_full=False"):
        smp.save_checkpoint(str(tmp_path), "full", partial=False, model=None, translate_if_full=False)
    assert os.listdir(tmp_path) == []


def _checkpoint_round_trip(world: Any, folder: str) -> str | None:
    model, opt, sched = _build(PP2, seed=0)
    for i in range(2):
        _train(model, opt, sched, i)
        smp.save_checkpoint(
            folder,
            f"step{i}",
            model=model,
            optimizer=opt,
            user_content={"scheduler": sched.state_dict(), "step": i},
            num_kept_partial_checkpoints=1,
        )
    _train(model, opt, sched, 2)
    expected = _params(model)
    smp.reset()

    model, opt, sched = _build(PP2, seed=1)
    user = smp.resume_from_checkpoint(folder)  # tag from `newest`; loads once partitioned
    sched.load_state_dict(user["scheduler"])
    assert user["step"] == 1, user
    _train(model, opt, sched, 2)
    return _first_difference(expected, _params(model))


def test_save_checkpoint_resume_round_trip(worlds: Any, tmp_path: Any) -> None:
    assert worlds.run(2, _checkpoint_round_trip, str(tmp_path), timeout=120) == [None, None]
    # the older partial checkpoint was pruned
    assert sorted(os.listdir(tmp_path)) == ["newest", "step1_partial"]
    assert sorted(os.listdir(tmp_path / "step1_partial")) == [
        "manifest.json",
        "model_0_0_0.pt",
        "model_1_0_0.pt",
        "optimizer_0_0_0.pt",
        "optimizer_1_0_0.pt",
        "user_content.pt",
    ]


def _resume_under_another_partition(world: Any, folder: str) -> dict[str, Any]:
    model, opt, sched = _build(PP2, seed=0)  # b and c on pp_rank 1
    for i in range(2):
        _train(model, opt, sched, i)
    smp.save_checkpoint(folder, "step1", model=model, optimizer=opt, user_content=sched.state_dict())
    _train(model, opt, sched, 2)
    expected = _params(model)
    smp.reset()

    # The resumed job's own partitioning would put everything on pp_rank 0 (nothing marked, manual
    # partitioning, default partition 0); the checkpoint's partition wins, so its parts fit.
    smp.init(PP2)
    torch.manual_seed(1)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.load_state_dict(smp.resume_from_checkpoint(folder))
    _train(model, opt, sched, 2)
    owned = sorted(name for name, _ in model.local_named_parameters())
    out: dict[str, Any] = {"difference": _first_difference(expected, _params(model)), "owned": owned}
    smp.reset()

    # A partition that does not fit the model is refused before anything runs.
    smp.init(PP2)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 4)))
    part = {"_smp_is_partial": True, "_smp_partition": {"a": 0, "b": 1}, "0.weight": torch.zeros(4, 8)}
    try:
        model.load_state_dict(part)
    except IncompatibleCheckpointFoundError as exc:
        out["error"] = str(exc)
    return out


def test_a_partial_checkpoint_brings_its_partition(worlds: Any, tmp_path: Any) -> None:
    """Resuming from a partial checkpoint uses the partition it was saved with (not the one the resumed
    job would compute), and training goes on exactly as without the restart."""
    results = worlds.run(2, _resume_under_another_partition, str(tmp_path), timeout=120)
    assert [r["difference"] for r in results] == [None, None], results
    assert results[0]["owned"] == ["module.a.bias", "module.a.weight"], results
    assert results[1]["owned"] == ["module.b.bias", "module.b.weight", "module.c.bias", "module.c.weight"]
    for r in results:
        assert "modules ['a', 'b'] are not in this model" in r["error"], r


# ---------------------------------------------------------------------------------- activation ckpt
class Block(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.down(self.drop(torch.tanh(self.up(x))))


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(Block(), Block(), Block(), Block())
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _ac_run(config: dict[str, Any], strategy: str | None, dropout: bool) -> dict[str, Any]:
    smp.init(config)
    torch.manual_seed(0)
    net = Deep()
    if not dropout:
        for m in net.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    if config.get("pipeline_parallel_degree", 1) > 1:
        set_partition(net.blocks[2], 1)
        set_partition(net.blocks[3], 1)
        set_partition(net.out, 1)
    model = smp.DistributedModel(net)
    if strategy is not None:
        smp.set_activation_checkpointing(net.blocks, strategy=strategy)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    saved_bytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved_bytes
        saved_bytes += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    Block.calls = 0
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _train_step(model, x, y)
        opt.step()
    calls = Block.calls
    params = _params(model)
    smp.reset()
    return {"params": params, "saved_bytes": saved_bytes, "calls": calls}


def _activation_checkpointing(world: Any, config: dict[str, Any], strategy: str, dropout: bool) -> Any:
    plain = _ac_run(config, None, dropout)
    ckpt = _ac_run(config, strategy, dropout)
    return {
        "difference": _first_difference(plain["params"], ckpt["params"]),
        "saved": (plain["saved_bytes"], ckpt["saved_bytes"]),
        "calls": (plain["calls"], ckpt["calls"]),
    }


@pytest.mark.parametrize("strategy", ["each", "group_2", "contiguous"])
def test_activation_checkpointing_pp1_same_result_less_saved(worlds: Any, strategy: str) -> None:
    (r,) = worlds.run(1, _activation_checkpointing, {"microbatches": 2}, strategy, True, timeout=60)
    assert r["difference"] is None, r  # dropout included: the RNG state is replayed
    plain, ckpt = r["saved"]
    assert ckpt < plain / 2, r  # the blocks' activations are recomputed, not kept
    assert r["calls"][1] == 2 * r["calls"][0], r  # every block forward ran again in backward


def test_activation_checkpointing_pp2_same_result_recomputed_on_the_owner(worlds: Any) -> None:
    r0, r1 = worlds.run(2, _activation_checkpointing, PP2, "each", False, timeout=120)
    for r in (r0, r1):
        assert r["difference"] is None, r
        # each rank owns 2 blocks: 2 steps x 2 microbatches x 2 blocks forwards, then as many again
        assert r["calls"] == (8, 16), r


def _ac_errors(world: Any) -> list[str]:
    smp.init({"microbatches": 1})
    net = Deep()
    out = []
    try:
        smp.set_activation_checkpointing(net.blocks)
    except DistributedModelNotWrappedError:
        out.append("not wrapped")
    smp.DistributedModel(net)
    try:
        smp.set_activation_checkpointing(net.inp, strategy="group_2")
    except CheckpointingConfigError as exc:
        out.append(str(exc))
    try:
        smp.set_activation_checkpointing(net.blocks, strategy="pairs")
    except CheckpointingConfigError as exc:
        out.append(str(exc))
    return out


def test_activation_checkpointing_argument_errors(worlds: Any) -> None:
    (out,) = worlds.run(1, _ac_errors, timeout=60)
    assert out[0] == "not wrapped"
    assert "nn.Sequential only" in out[1] and "Linear" in out[1]
    assert "'pairs'" in out[2] and "group_<k>" in out[2]


def _v3_round_trip(world: Any, folder: str) -> Any:
    smp.init({"microbatches": 1, "ddp": True})  # pp=1, tp=1: rdp_size 2
    path = os.path.join(folder, "opt")
    smp.save(
        {"replica": smp.rdp_rank(), "t": torch.full((3,), float(smp.rank()))}, path, partial=True, v3=True
    )
    smp.barrier()
    loaded = smp.load(path, partial=True)
    smp.reset()
    return loaded["replica"], float(loaded["t"][0])


def test_v3_parts_are_per_replica(worlds: Any, tmp_path: Any) -> None:
    """v3 (state that differs between replicas): one part per rdp_rank, each replica loads its own."""
    assert worlds.run(2, _v3_round_trip, str(tmp_path), timeout=60) == [(0, 0.0), (1, 1.0)]
    assert sorted(os.listdir(tmp_path)) == ["opt.mp-manifest.json", "opt_0_0_0", "opt_0_0_1"]
