"""sharded_data_parallel_degree with fp16/bf16 on real worlds, against one process running the same
mixed-precision recipe (tests/integration/test_memory_precision.py's, with every replica's batches).

Under sharding the sharded parameters stay fp32 and are their own masters; FSDP2 gathers them in the half
dtype for forward and backward and reduce-scatters the gradients in fp32. The small parameters below
sdp_param_persistence_threshold (here the biases) are half with separate fp32 masters, as without
sharding. The reference keeps every parameter half with fp32 masters and accumulates the half gradients
of all replicas' microbatches in the half dtype; the sharded run sums each microbatch's half gradient in
fp32. Tolerance: the masters within rtol 1e-3, atol 1e-4 for fp16 (its unit roundoff is 5e-4) and rtol
1e-2, atol 1e-3 for bf16 (unit roundoff 4e-3); the half parameters (model.state_dict(), full) within one
more rounding of the half dtype; losses within 1e-3 (fp16) and 1e-2 (bf16) relative.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import mp as smp
from mp_memory.loss_scaler import DynamicLossScaler
from tests.integration.test_memory_sdp import MICROBATCHES, _batch, _build
from tests.mp_pipeline.models import first_difference

STEPS = 5
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALING = {"init_scale": 2.0**12, "scale_window": 2}
TOL = {"fp16": (1e-3, 1e-4), "bf16": (1e-2, 1e-3)}
HALF_TOL = {"fp16": (3e-3, 1e-4), "bf16": (2e-2, 1e-3)}
THRESHOLD = 100  # sdp_param_persistence_threshold: the biases are kept whole, the weights sharded
OVERFLOW_PARAM = "blocks.1.inner.weight"  # sharded


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # eps 1e-4 bounds Adam's sensitivity to a near-zero gradient (its first step is lr * g / (|g| + eps)):
    # with torch's 1e-8 a gradient element one half-ulp apart can move its parameter by a whole lr
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.01)


def _config(precision: str, clip: float) -> dict[str, Any]:
    return {
        "sharded_data_parallel_degree": 2,
        "microbatches": MICROBATCHES,
        "sdp_param_persistence_threshold": THRESHOLD,
        "sdp_gradient_clipping": clip,
        precision: True,
    }


def _reference(
    precision: str,
    replicas: int,
    clip: float,
    overflow_step: int | None,
    *,
    whole_names: frozenset[str] | None = None,
    build: Callable[[], nn.Module] = _build,
) -> dict[str, Any]:
    """One process, the sharded run's recipe: half parameters and fp32 masters, the same scaler; each
    microbatch's half gradient of a sharded parameter summed in fp32 (FSDP2's reduce dtype), a whole
    (small) parameter's summed in half over a replica's microbatches, then averaged over the replicas in
    fp32 and rounded to half (mp_memory.sharded.reduce_persistent_grads). ``whole_names``: the
    parameters kept whole (default: those below THRESHOLD elements); ``build``: the model (seeded)."""
    dtype = DTYPES[precision]
    model = build().to(dtype)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    if whole_names is not None:
        assert whole_names <= set(names), whole_names
    whole = [
        (n in whole_names) if whole_names is not None else p.numel() < THRESHOLD
        for n, p in zip(names, params, strict=True)
    ]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = _optimizer(masters)
    scaler = DynamicLossScaler(**SCALING) if precision == "fp16" else None
    losses, scales, skipped, norms = [], [], [], []
    last: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        scale = scaler.loss_scale if scaler is not None else 1.0
        sums = [torch.zeros_like(m) for m in masters]
        per_replica = []
        for r in range(replicas):
            model.zero_grad()
            x, y = _batch(step, r)
            total = 0.0
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                loss = F.mse_loss(model(xm.to(dtype)).float(), ym)
                (loss * (scale / MICROBATCHES)).backward()
                total += loss.item() / MICROBATCHES
                for i, p in enumerate(params):
                    if not whole[i]:
                        sums[i] += p.grad.float()  # type: ignore[union-attr]
                        p.grad = None
            for i, p in enumerate(params):
                if whole[i]:
                    sums[i] += p.grad.float()  # type: ignore[union-attr]
            per_replica.append(total)
        grads = [
            (s / replicas).to(dtype).float() if w else s / replicas for s, w in zip(sums, whole, strict=True)
        ]
        if step == overflow_step:
            grads[names.index(OVERFLOW_PARAM)].view(-1)[-1] = float("inf")
        overflow = scaler is not None and any(not torch.isfinite(g).all() for g in grads)
        if not overflow:
            for m, g in zip(masters, grads, strict=True):
                m.grad = g / scale
            last = {n: m.grad.clone() for n, m in zip(names, masters, strict=True)}
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip)))
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
        if scaler is not None:
            scaler.update(overflow)
        losses.append(per_replica)
        scales.append(scale)
        skipped.append(overflow)
    return {
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "norms": norms,
        "masters": dict(zip(names, [m.detach() for m in masters], strict=True)),
        "params": model.state_dict(),
        "grads": last,
    }


def _setup(precision: str, clip: float) -> tuple[Any, Any, Any]:
    smp.init(_config(precision, clip))
    model = smp.DistributedModel(_build())
    kwargs: dict[str, Any] = {}
    if precision == "fp16":
        kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": SCALING}
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()), **kwargs)

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def _train(world: Any, precision: str, overflow_step: int | None) -> dict[str, Any]:
    """overflow_step: that step's gradient gets an inf in rank 1's shard only; sdp_gradient_clipping is
    then off and the script clips by clip_master_grads instead (smp's two ways to clip)."""
    clip = 1.0
    model, opt, train_step = _setup(precision, 0.0 if overflow_step is not None else clip)
    losses, scales, skipped, norms = [], [], [], []
    for step in range(STEPS):
        scales.append(opt.loss_scale)
        out = train_step(*_batch(step, smp.dp_rank()))
        if step == overflow_step and smp.rank() == 1:
            grad = dict(model.module.named_parameters())[OVERFLOW_PARAM].grad
            assert isinstance(grad, DTensor)
            grad.to_local().view(-1)[-1] = float("inf")  # the last row: rank 1's shard
        if overflow_step is not None:
            norm = float(opt.clip_master_grads(clip))
        opt.step()
        if overflow_step is not None and not opt.overflow:
            norms.append(norm)
        opt.zero_grad()
        losses.append(out.reduce_mean().item())
        skipped.append(opt.overflow)
    ref = _reference(precision, smp.dp_size(), clip, overflow_step)
    names = {id(p): n for n, p in model.module.named_parameters()}
    masters = {
        names[id(p)]: (m.full_tensor() if isinstance(m, DTensor) else m).detach() for p, m in opt.pairs()
    }
    rtol, atol = TOL[precision]
    hrtol, hatol = HALF_TOL[precision]
    params = model.state_dict()
    return {
        "losses": [
            abs(g - w[smp.dp_rank()]) / abs(w[smp.dp_rank()])
            for g, w in zip(losses, ref["losses"], strict=True)
        ],
        "scales": (scales, ref["scales"]),
        "skipped": (skipped, ref["skipped"]),
        "norms": (norms, ref["norms"] if overflow_step is not None else []),
        "masters": first_difference(masters, ref["masters"], rtol=rtol, atol=atol),
        "worst": max(((m - ref["masters"][n]).abs().max().item(), n) for n, m in masters.items()),
        "params": first_difference(params, ref["params"], rtol=hrtol, atol=hatol),
        "dtypes": sorted({str(v.dtype) for v in params.values()}),
        "kinds": {
            n: (type(p).__name__, str(p.dtype))
            for n, p in model.module.named_parameters()
            if n.startswith("blocks.0")
        },
    }


def _check(r: dict[str, Any], precision: str) -> None:
    assert r["masters"] is None and r["params"] is None, r
    assert max(r["losses"]) <= (1e-3 if precision == "fp16" else 1e-2), r
    assert r["scales"][0] == r["scales"][1] and r["skipped"][0] == r["skipped"][1], r
    assert r["dtypes"] == [str(DTYPES[precision])], r  # the model's state is in the half dtype, as smp's
    half = str(DTYPES[precision])
    assert r["kinds"]["blocks.0.inner.weight"] == ("DTensor", "torch.float32"), r  # fp32 shards = masters
    assert r["kinds"]["blocks.0.inner.bias"] == ("Parameter", half), r  # kept whole, half
    got, want = r["norms"]
    assert len(got) == len(want) and all(abs(g - w) <= 1e-3 * w for g, w in zip(got, want, strict=True)), r


@pytest.mark.parametrize(("precision", "ranks"), [("fp16", 2), ("bf16", 2), ("fp16", 4)])
def test_half_precision_sharded_trains_like_the_one_process_recipe(
    worlds: Any, precision: str, ranks: int
) -> None:
    """sdp=2 (2 ranks) and sdp=2 x dp=2 (4 ranks, HSDP), sdp_gradient_clipping 1.0."""
    for r in worlds.run(ranks, _train, precision, None, timeout=300):
        _check(r, precision)


def test_a_forced_overflow_in_one_shard_skips_the_step_on_every_rank(worlds: Any) -> None:
    for r in worlds.run(2, _train, "fp16", 2, timeout=300):
        _check(r, "fp16")
        scales, skipped = r["scales"][0], r["skipped"][0]
        assert skipped[2] and not any(skipped[:2] + skipped[3:]), r
        assert scales[3] == scales[2] / 2, r


def _round_trip(world: Any, path: str, partial: bool) -> dict[str, Any]:
    """Save after 2 steps, train 2 more; a fresh job (other weights) resumes and trains the same 2."""

    def run(opt: Any, train_step: Any, steps: range) -> None:
        for step in steps:
            train_step(*_batch(step, smp.dp_rank()))
            opt.step()
            opt.zero_grad()

    model, opt, train_step = _setup("fp16", 1.0)
    run(opt, train_step, range(2))
    smp.save_checkpoint(path, "s2", partial=partial, model=model, optimizer=opt, user_content={"step": 2})
    run(opt, train_step, range(2, 4))
    straight = model.state_dict()
    straight_opt = opt.state_dict()
    smp.reset()
    torch.manual_seed(7)
    model, opt, train_step = _setup("fp16", 1.0)
    with torch.no_grad():  # other weights: the checkpoint must replace them
        for p in model.parameters():
            p.mul_(0.5)
    user = smp.resume_from_checkpoint(path, "s2", partial=partial)
    run(opt, train_step, range(2, 4))
    resumed_opt = opt.state_dict()
    return {
        "user": user,
        "params": first_difference(model.state_dict(), straight, rtol=0, atol=0),
        "masters": first_difference(
            resumed_opt["fp32_master_params"], straight_opt["fp32_master_params"], rtol=0, atol=0
        ),
        "scaler": (resumed_opt["loss_scaler"], straight_opt["loss_scaler"]),
    }


@pytest.mark.parametrize("partial", [True, False])
def test_the_sharded_half_optimizer_state_round_trips(worlds: Any, tmp_path: Any, partial: bool) -> None:
    """Partial (this rank's shards of the fp32 masters and of AdamW's state) and full (gathered) states."""
    for r in worlds.run(2, _round_trip, str(tmp_path), partial, timeout=300):
        assert r["user"] == {"step": 2} and r["params"] is None and r["masters"] is None, r
        assert r["scaler"][0] == r["scaler"][1], r
