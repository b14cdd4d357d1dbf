"""smp's fp16 and bf16 on real worlds: a GPT-2 at pp=2 trains like one process running the same
mixed-precision recipe, overflows skip the step on every rank, and the half optimizer's state round-trips.

The recipe (smp's, after DeepSpeed's FP16 optimizer): parameters in fp16 (bf16), fp32 master weights
stepped by AdamW, the loss multiplied by the loss scale in backward and the gradients divided by it,
steps with an inf/NaN gradient skipped and the dynamic scale lowered. The reference runs it by hand in
one process on the same model, seed and microbatches. Tolerance: the masters agree within rtol 1e-3,
atol 1e-4 (fp16's unit roundoff is 1e-3/2; both runs do the same operations, so in practice they agree to
a few fp16 ulps or exactly) and the losses within 1e-3 relative.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mp as smp
from tests.integration._half_recipe import SCALING, HalfRecipe, _check, _config, _train
from tests.mp_pipeline.models import batch, build


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpt2_pp2_trains_like_one_process_with_the_same_recipe(worlds: Any, precision: str) -> None:
    for r in worlds.run(2, _train, precision, 2, None, timeout=240):
        _check(r, precision)
        if precision == "fp16":
            assert r["skipped"][0] and r["scales"][0] == 2.0**20, r  # the scale found its level...
            assert not all(r["skipped"]), r  # ...and training went on
        assert r["losses"][-1] < r["losses"][0], r


def test_a_forced_overflow_on_one_rank_skips_the_step_on_every_rank(worlds: Any) -> None:
    results = worlds.run(2, _train, "fp16", 2, 4, timeout=240)
    for r in results:
        _check(r, "fp16")
        assert r["skipped"][4] and r["scales"][5] == r["scales"][4] / 2, r


def _session(
    precision: str, seed: int, saved: dict[str, Any] | None, full: bool, partition: str
) -> dict[str, Any]:
    # the resumed session splits the model as the first did (a time-balanced split may differ per run)
    smp.init(_config(precision, 2) | {"partition_file": partition, "load_partition": saved is not None})
    torch.manual_seed(seed)
    model = smp.DistributedModel(build("gpt2", seed=seed, layers=2))
    kwargs = {"dynamic_loss_scale": True, "dynamic_loss_args": SCALING} if precision == "fp16" else {}
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), **kwargs)
    if saved is not None:  # loaded before the first step: kept until partitioning made the masters
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)  # smp's fp16 scripts call the optimizer's backward
        return loss

    out: dict[str, Any] = {}
    for step in range(0 if saved is None else 2, 3):
        if step == 2 and saved is None:
            # state dicts hold the live parameters (as torch's do): copy before training on
            out["model"] = copy.deepcopy(model.state_dict() if full else model.local_state_dict())
            out["opt"] = opt.state_dict() if full else opt.local_state_dict()
            out["scale"] = opt.loss_scale
        (ids,) = batch("gpt2", step, 0)
        opt.zero_grad()
        train_step(ids)
        opt.step()
    names = {id(p): n for n, p in model.module.named_parameters()}
    out["masters"] = {names[id(p)]: m.detach().clone() for p, m in opt.pairs()}
    out["after_scale"] = opt.loss_scale
    smp.reset()
    return out


def _round_trip(world: Any, precision: str, full: bool, partition: str) -> dict[str, Any]:
    first = _session(precision, 0, None, full, partition)
    again = _session(precision, 1, first, full, partition)
    differ = [n for n, m in first["masters"].items() if not torch.equal(m, again["masters"][n])]
    return {
        "differ": differ,
        "scales": (first["after_scale"], again["after_scale"]),
        "n": len(first["masters"]),
    }


@pytest.mark.parametrize("full", [False, True])
def test_the_half_optimizer_state_round_trips(worlds: Any, full: bool, tmp_path: Path) -> None:
    for r in worlds.run(2, _round_trip, "fp16", full, str(tmp_path / "partition.json"), timeout=240):
        assert r["n"] > 0 and r["differ"] == [] and r["scales"][0] == r["scales"][1], r


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


TP_SCALING = {"init_scale": 2.0**8, "scale_window": 2}  # far from fp16's range: the steps are taken


def _tp_fp16(world: Any) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "microbatches": 1, "fp16": True})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = _MLP()
    reference = copy.deepcopy(net).half()
    model = smp.DistributedModel(net)
    assert type(net.fc1).__name__ == "DistributedLinear", type(net.fc1)
    opt = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, dynamic_loss_args=TP_SCALING
    )

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    # the same recipe in one process, on the unsplit model
    recipe = HalfRecipe(reference.parameters(), "fp16", lambda ms: torch.optim.SGD(ms, lr=0.1), TP_SCALING)
    skipped = []
    for s in range(4):
        x, y = _mlp_data(s)
        opt.zero_grad()
        train_step(x, y)
        opt.step()
        skipped.append(opt.overflow)
        reference.zero_grad()
        (torch.nn.functional.mse_loss(reference(x.half()).float(), y) * recipe.scale).backward()
        recipe.step([p.grad.float() for p in recipe.params], None)  # type: ignore[union-attr]
    got = model.state_dict()  # the TP shards gathered
    want = dict(zip([n for n, _ in reference.named_parameters()], recipe.masters, strict=True))
    far = {n: (got[n].float() - want[n]).abs().max().item() for n in want}
    # the full half state would hold each TP rank's own shards: refused both ways, the partial one works
    refused = []
    local = opt.local_state_dict()
    for call in (opt.state_dict, lambda: opt.load_state_dict({**local, "_smp_is_partial": False})):
        try:
            call()
        except smp.SMPCheckpointError as exc:
            refused.append(str(exc))
    opt.load_state_dict(local)
    return {
        "skipped": skipped,
        "ref_skipped": recipe.skipped,
        "far": far,
        "dtype": str(got["fc1.weight"].dtype),
        "refused": refused,
    }


def test_fp16_with_tensor_parallelism_trains_like_one_process(worlds: Any) -> None:
    for r in worlds.run(2, _tp_fp16, timeout=240):
        assert r["dtype"] == "torch.float16" and r["skipped"] == r["ref_skipped"], r
        assert not any(r["skipped"]), r
        # fp16 parameters against fp32 masters of the same recipe: within two fp16 ulps of O(1) values
        assert max(r["far"].values()) < 2e-3, r
        assert len(r["refused"]) == 2, r["refused"]
        assert all("tensor_parallel_degree 2" in m and "partial=True" in m for m in r["refused"]), r


IGNORED_IN_FP32: list[dict[str, Any]] = [
    {"dynamic_loss_scale": True},
    {"static_loss_scale": 128.0},
    {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**16}},
    {"scale_window": 500},
]


def _loss_scaling(world: Any) -> dict[str, Any]:
    """fp32 with each set of loss-scaling arguments: a warning, and the same training as without them."""
    import warnings

    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Linear(2, 2))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 2)

    @smp.step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    messages, after = [], []
    for kwargs in [{}, *IGNORED_IN_FP32]:
        model.load_state_dict(start)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        messages.append([str(w.message) for w in caught if issubclass(w.category, UserWarning)])
        train_step(x)
        opt.step()
        opt.zero_grad()
        after.append({k: v.clone() for k, v in model.state_dict().items()})
    same = [all(torch.equal(a[k], after[0][k]) for k in a) for a in after[1:]]
    return {"messages": messages, "same": same}


def test_loss_scaling_arguments_take_effect_only_with_fp16(worlds: Any) -> None:
    """smp's docs: the loss-scale arguments only take effect with fp16 (and smp's GPT-2 example passes
    dynamic_loss_scale=True in fp32 runs). In fp32 mp accepts them, warns, and trains unscaled."""
    for r in worlds.run(2, _loss_scaling, timeout=120):
        assert r["messages"][0] == [], r["messages"][0]  # the defaults: no warning
        for kwargs, message in zip(IGNORED_IN_FP32, r["messages"][1:], strict=True):
            assert len(message) == 1, message
            assert "fp16 loss scaling" in message[0] and "'fp16': true" in message[0], message
            for key, value in kwargs.items():
                if key != "dynamic_loss_args" and value is not None:  # None: smp's "no static scale"
                    assert key in message[0], (key, message)
        assert all(r["same"]), r["same"]
