"""smp's step/model/optimizer API on real worlds: errors reach every rank, the smp idioms work."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp import DistributedModel, DistributedOptimizer, step
from mp.errors import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
    TensorSplitError,
)
from mp_partition import set_partition
from mp_pipeline import StepOutput


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2 and smp.rank() == 1:  # only the first pipeline fails (4 ranks: 2 replicas)
            raise ValueError("boom from the faulty module")
        return self.lin(x)


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = Faulty()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _module_error(world: Any) -> dict[str, Any]:
    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    )
    net = TwoStage()
    set_partition(net.second, 1)
    model = DistributedModel(net)

    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        model.backward(loss)
        return loss

    try:
        train(torch.randn(4, 4))
    except Exception as exc:
        return {"rank": smp.rank(), "type": type(exc).__name__, "message": str(exc)}
    return {"rank": smp.rank(), "type": None, "message": ""}


@pytest.mark.parametrize("n", [2, 4])
def test_a_module_error_reaches_every_rank(worlds: Any, n: int) -> None:
    results = worlds.run(n, _module_error, timeout=120)
    for r in results:
        assert r["type"] is not None, f"rank {r['rank']} did not fail"
        msg = r["message"]
        # the failing rank (global rank 1, pp_rank 1 of the first pipeline) and module are named,
        # with the original traceback
        assert "rank 1" in msg and "'second'" in msg, msg
        assert "boom from the faulty module" in msg and 'raise ValueError("boom' in msg, msg


def _smp_idioms(world: Any) -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    out: dict[str, Any] = {}
    model = DistributedModel(net)
    try:
        DistributedModel(nn.Linear(2, 2))
    except MultipleDistributedModelError:
        out["second_model"] = "raised"
    try:
        model.local_parameters()
    except ModelNotPartitionedError:
        out["local_before"] = "raised"
    try:
        model(torch.randn(2, 6))
    except FwdExecutionNotInStepFnError:
        out["fwd_outside"] = "raised"
    try:
        model.backward(torch.ones(()))
    except BwdExecutionNotInStepFnError:
        out["bwd_outside"] = "raised"
    seen: list[str] = []
    model.register_post_partition_hook(lambda m, o: seen.append(f"partition:{m.partitioned}"))
    model.register_post_step_hook(lambda m, o: seen.append("step"))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    class Trainer:
        @step()
        def train(self, x: torch.Tensor, y: torch.Tensor, tag: str) -> Any:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            model.backward(loss)
            return loss, {"logits": logits, "tag": tag}

    @step(non_split_inputs=["w"], input_split_axes={"z": 1})
    def evaluate(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> Any:
        assert w.shape == (4,) and z.shape == (3, 2)
        return model(x), int(x.shape[0])

    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    loss, extra = Trainer().train(x, y, "t")
    out["loss_type"] = type(loss).__name__
    out["loss_len"] = len(loss.outputs)
    out["logits"] = tuple(extra["logits"].concat().shape)
    out["tag"] = extra["tag"]
    out["requires_grad"] = loss.outputs[0].requires_grad
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        logits, sizes = evaluate(x, torch.ones(4), torch.zeros(3, 4))
    out["eval"] = (tuple(logits.concat().shape), sizes, logits.outputs[0].requires_grad)
    out["optimizer_local"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
    out["local"] = sum(p.numel() for p in model.local_parameters())
    try:
        Trainer().train(torch.randn(7, 6), torch.randint(0, 3, (7,)), "t")
    except TensorSplitError as exc:
        out["split_error"] = str(exc)
    out["hooks"] = seen
    full = model.state_dict()
    out["state_keys"] = sorted(full)
    reloaded = {k: v + 1 for k, v in full.items()}
    model.load_state_dict(reloaded)
    after = model.state_dict()
    out["reload_ok"] = all(torch.equal(after[k], reloaded[k]) for k in full)
    partial = model.local_state_dict()
    out["partial"] = partial.pop("_smp_is_partial")
    out["partition"] = partial.pop("_smp_partition")  # the partition travels with each part
    out["partial_keys"] = sorted(partial)
    return out


def test_smp_idioms_on_two_stages(worlds: Any) -> None:
    r0, r1 = worlds.run(2, _smp_idioms, timeout=120)
    for r in (r0, r1):
        assert r["second_model"] == r["local_before"] == r["fwd_outside"] == r["bwd_outside"] == "raised"
        assert r["loss_type"] == "StepOutput" and r["loss_len"] == 2
        assert r["logits"] == (8, 3) and r["tag"] == ["t", "t"] and r["requires_grad"] is False
        assert r["eval"] == ((8, 3), [4, 4], False)
        assert r["optimizer_local"] == r["local"] > 0
        assert "Batch size must be divisible" in r["split_error"] and "batch size=7" in r["split_error"]
        assert r["hooks"] == ["partition:True", "step"]
        assert r["state_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
        assert r["reload_ok"] and r["partial"] is True
    assert r0["local"] + r1["local"] == 6 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3
    assert set(r0["partial_keys"]).isdisjoint(r1["partial_keys"])
    assert r0["partition"] == r1["partition"] and set(r0["partition"].values()) == {0, 1}, r0["partition"]
    assert sorted(r0["partial_keys"] + r1["partial_keys"]) == r0["state_keys"]


def test_step_output_api() -> None:
    out = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    assert torch.equal(out.reduce_sum(), torch.tensor([4.0, 6.0]))
    assert torch.equal(out.reduce_mean(), torch.tensor([2.0, 3.0]))
    assert out.concat().tolist() == [1.0, 2.0, 3.0, 4.0] and out.stack().shape == (2, 2)
    assert out[1].tolist() == [3.0, 4.0] and len(out) == 2


def _square_loss_step(model: DistributedModel) -> Any:
    """A training step function for `model` (loss: the mean square of its output)."""

    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    return train


def _cpu_gathers(world: Any) -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    try:
        torch.manual_seed(0)
        model = DistributedModel(
            nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))
        )
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        train = _square_loss_step(model)
        train(torch.randn(8, 6))
        opt.step()
        gathered = model.state_dict()
        placeholders_before = sum(
            p.stride() == (0,) * p.dim() and p.numel() > 1 for p in model.module.parameters()
        )
        assert model.cpu() is model
        copy = model.get_module().state_dict()
        same = list(copy) == list(gathered) and all(torch.equal(copy[k], gathered[k]) for k in gathered)
        return {"placeholders_before": placeholders_before, "same": same}
    finally:
        smp.reset()


def test_cpu_gathers_the_whole_model_on_every_rank(worlds: Any) -> None:
    for r in worlds.run(2, _cpu_gathers, timeout=120):
        assert r["placeholders_before"] > 0  # each rank held only its stage before
        assert r["same"]


def _clipped(world: Any, norm_type: float) -> dict[str, Any]:
    from tests.mp_pipeline.models import batch, build, first_difference, loss_of

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    try:
        model = DistributedModel(build("mlp"))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

        @step
        def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_of("mlp", model, (x, y))
            model.backward(loss)
            return loss

        norms = []
        for s in range(2):
            train(*batch("mlp", s, 0))
            norms.append(float(opt.clip_master_grads(0.05, norm_type)))  # type: ignore[attr-defined]
            opt.step()
            opt.zero_grad()
        got = model.state_dict()
    finally:
        smp.reset()
    ref = build("mlp")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_norms = []
    for s in range(2):
        x, y = batch("mlp", s, 0)
        for part in zip(x.chunk(2), y.chunk(2), strict=True):
            (loss_of("mlp", ref, part) / 2).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)))
        ref_opt.step()
        ref_opt.zero_grad()
    return {"norms": norms, "ref_norms": ref_norms, "diff": first_difference(got, ref.state_dict())}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_master_grads_uses_the_whole_models_norm(worlds: Any, norm_type: float) -> None:
    for r in worlds.run(2, _clipped, norm_type, timeout=120):
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert all(n > 0.05 for n in r["ref_norms"])  # the clip really applied
        assert r["diff"] is None, r["diff"]


def _state_dict_on_some_ranks(world: Any, misuse: str) -> dict[str, Any]:
    """smp's most common hang: a gather of the model's state called on some ranks of a pipeline only."""
    os.environ["MP_PIPELINE_TIMEOUT"] = "8"  # read when the pipeline starts (the first step)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    try:
        torch.manual_seed(0)
        model = DistributedModel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        @step
        def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        train(torch.randn(4, 6), torch.randn(4, 3))
        opt.step()
        start = time.monotonic()
        try:
            if misuse == "rank 0 only":
                if smp.rank() == 0:
                    model.state_dict()
                train(torch.randn(4, 6), torch.randn(4, 3))
            elif misuse == "smp.save on rank 0 only":
                if smp.rank() == 0:
                    smp.save(model.local_state_dict(), os.path.join(tempfile.mkdtemp(), "ckpt"))
                train(torch.randn(4, 6), torch.randn(4, 3))
            else:  # the two ranks call different gathers
                model.state_dict() if smp.rank() == 0 else opt.state_dict()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - start}
        return {"error": None, "took": time.monotonic() - start}
    finally:
        os.environ.pop("MP_PIPELINE_TIMEOUT", None)
        smp.reset()


@pytest.mark.parametrize("misuse", ["rank 0 only", "smp.save on rank 0 only", "different gathers"])
def test_a_state_gather_on_some_ranks_only_is_an_error_not_a_hang(worlds: Any, misuse: str) -> None:
    results = worlds.run(2, _state_dict_on_some_ranks, misuse, timeout=120)
    first, second = (r["error"] or "" for r in results)
    if misuse != "different gathers":
        # rank 1, in its next step, hears of rank 0's gather at once; rank 0 waits for rank 1 in vain
        what = "model.state_dict()" if misuse == "rank 0 only" else "smp.save(partial=True)"
        assert f"rank 0 (pp_rank 0) entered {what}, which every rank of pipeline [0, 1]" in second, second
        assert "while rank 1 is in step 2 (of _state_dict_on_some_ranks.<locals>.train)" in second, second
        assert "smp.rdp_rank() == 0" in second
        assert results[1]["took"] < 5, results[1]
        assert f"rank 0 entered {what}" in first and "rank 1 did not within 8 s" in first, first
    else:
        for text in (first, second):
            assert "entered model.state_dict() (its collective number 1" in text or (
                "entered optimizer.state_dict() (its collective number 1" in text
            ), text
            assert "must call the same collectives, in the same order" in text, text


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)  # a buffer on each stage
        self.second = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.norm(self.first(x))))


def _inspection(world: Any) -> dict[str, Any]:
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    smp.init(cfg)
    try:
        net = _Normed()
        set_partition(net.second, 1)
        model = DistributedModel(net)
        _square_loss_step(model)(torch.randn(4, 6))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            model.display_partition()
        names = {model.get_param_name(p): n for n, p in model.local_named_parameters()}
        try:
            model.get_param_name(torch.nn.Parameter(torch.zeros(2)))
            foreign = "no error"
        except smp.SMPValidationError as exc:
            foreign = str(exc)
        return {
            "names_match": all(k == v for k, v in names.items()) and bool(names),
            "local_buffers": sorted(n for n, b in model.named_buffers() if model.is_local_buffer(b)),
            "partition": printed.getvalue(),
            "foreign": foreign,
            "default": sorted(n for n, _ in model.default_reducer_named_parameters()),
            "local": sorted(n for n, _ in model.local_named_parameters()),
            "scaled": list(model.scaled_batch_reducer_named_parameters()),
            "distributed": list(model.distributed_modules()),
        }
    finally:
        smp.reset()


def test_smp_model_inspection_helpers(worlds: Any) -> None:
    r0, r1 = worlds.run(2, _inspection, timeout=120)
    for r in (r0, r1):
        assert r["names_match"]
        assert "not a parameter of this DistributedModel" in r["foreign"]
        assert "second" in r["partition"], r["partition"]
        # without tensor parallelism every local parameter is averaged over the data-parallel group
        assert r["default"] == r["local"] and r["scaled"] == [] and r["distributed"] == []
    assert "second: pp_rank 1" in r1["partition"] and "p1" in r0["partition"], (r0, r1)
    assert r0["local_buffers"] and all(n.startswith("module.norm.") for n in r0["local_buffers"])
    assert r1["local_buffers"] and all(n.startswith("module.second.") for n in r1["local_buffers"])


def _evaluate_on_rank_0_only(world: Any) -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    try:
        torch.manual_seed(0)
        model = DistributedModel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))

        @step
        def train(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            model.backward(loss)
            return loss

        @step
        def evaluate(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model(x).square().mean()

        train(torch.randn(4, 6))
        start = time.monotonic()
        try:
            if smp.rank() == 0:
                evaluate(torch.randn(4, 6))
            train(torch.randn(4, 6))
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - start}
        return {"error": None}
    finally:
        smp.reset()


def test_a_step_function_called_on_some_ranks_only_is_an_error(worlds: Any) -> None:
    """Served, rank 0's evaluation would have run inside rank 1's training step as if it were part of it."""
    r0, r1 = worlds.run(2, _evaluate_on_rank_0_only, timeout=120)
    where = "_evaluate_on_rank_0_only.<locals>"
    assert f"rank 0 runs step function '{where}.evaluate' as step 2 of the model, while rank 1 runs " in (
        r1["error"] or ""
    ), r1
    assert f"rank 1 runs step function '{where}.train' as step 2" in (r0["error"] or ""), r0
    assert "every rank must call the same step functions in the same order" in r0["error"]
    assert r0["took"] < 10 and r1["took"] < 10, (r0, r1)


class _SlowLast(nn.Module):
    """The last stage: 0.1 s per forward, recording (on its rank, on the host's monotonic clock) when
    each microbatch's forward ends and when its backward reaches it. Column 0 of the input carries the
    microbatch's index unchanged through the first stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.events: list[tuple[str, int, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = int(x[0, 0])
        time.sleep(0.1)
        out = self.lin(x)
        out.register_hook(lambda _: self.events.append(("bwd", mb, time.monotonic())))
        self.events.append(("fwd", mb, time.monotonic()))
        return out


class _PassThenSlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.last = _SlowLast()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(x + 0 * self.first(x))  # the index column reaches the last stage as it was


def _last_stage_order(world: Any, pipeline: str) -> dict[str, Any]:
    m = 4
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": m,
            "pipeline": pipeline,
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    try:
        net = _PassThenSlow()
        set_partition(net.last, 1)
        model = DistributedModel(net)

        @step
        def train(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            if int(x[0, 0]) == m - 1:
                time.sleep(0.5)  # pp_rank 0 reaches the last microbatch's backward late
            model.backward(loss)
            return loss

        x = torch.randn(2 * m, 4)
        x[:, 0] = torch.arange(m).repeat_interleave(2).float()
        train(x)  # the first backward also imports what torch loads lazily (0.5-1 s here)
        net.last.events.clear()
        train(x)
        return {"pp_rank": smp.pp_rank(), "events": list(net.last.events)}
    finally:
        smp.reset()


def test_two_stage_simple_pipeline_starts_the_last_stages_backward_right_after_its_last_forward(
    worlds: Any,
) -> None:
    """GPipe on two stages: the last stage runs every forward, then the first backward at once. The
    backward request does not wait for the last forward's output to reach pp_rank 0 and for pp_rank 0
    to get to that microbatch's ``model.backward`` (0.5 s late here): pp_rank 0 sent it while the last
    forwards were still running, behind them on the one ordered channel to the last stage."""
    results = worlds.run(2, _last_stage_order, "simple", timeout=120)
    events = next(r["events"] for r in results if r["pp_rank"] == 1)
    m = 4
    assert [(kind, mb) for kind, mb, _ in events] == [("fwd", i) for i in range(m)] + [
        ("bwd", i) for i in range(m)
    ], events
    last_forward, first_backward = events[m - 1][2], events[m][2]
    assert first_backward - last_forward < 0.25, events  # 0.5 s or more if it waited for pp_rank 0
