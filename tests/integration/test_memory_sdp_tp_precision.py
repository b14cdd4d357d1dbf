"""sharded_data_parallel_degree with tensor parallelism and fp16/bf16: tp=2 x sdp=2 on 4 ranks, against
one process running the same mixed-precision recipe on all four ranks' batches
(tests/integration/test_memory_sdp_precision.py's reference).

Each TP rank shards its own TP shards; the sharded ones stay fp32 (their own masters) and are gathered in
the half dtype for forward and backward, the small ones (below sdp_param_persistence_threshold: the
biases and the output layer's weight shards) are half with separate fp32 masters. The overflow verdict
is the world's (an inf in one rank's shard skips the step on all four), and clipping uses the whole
model's norm: shards summed over the sharding group, TP shards over the TP group, TP-replicated
parameters counted once. Tolerances as for sdp without TP (that file's docstring): the TP layers' sums in
the half dtype add roundings of the same order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import mp as smp
from tests.integration.test_memory_sdp import Stack, _batch
from tests.integration.test_memory_sdp_precision import (
    HALF_TOL,
    OVERFLOW_PARAM,
    SCALING,
    STEPS,
    THRESHOLD,
    TOL,
    _optimizer,
    _reference,
)
from tests.mp_pipeline.models import first_difference

CLIP = 1.0


class Smooth(Stack):
    """The sdp tests' model with tanh for the input layer's relu: a pre-activation near 0 that the TP
    layer's half-precision sums round to the other side of the kink would change a gradient row by
    that sample's whole contribution (seen: 20% of inp.weight's gradient at one step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)  # type: ignore[no-any-return]


def _smooth() -> Smooth:
    torch.manual_seed(0)
    return Smooth()


def _setup(precision: str, clip: float, seed: int = 0) -> tuple[Any, Any, Any]:
    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "microbatches": 2,
            "sdp_param_persistence_threshold": THRESHOLD,
            "sdp_gradient_clipping": clip,
            precision: True,
        }
    )
    torch.manual_seed(seed)
    with smp.tensor_parallelism():
        net = Smooth()
    model = smp.DistributedModel(net)
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
    """overflow_step: that step's gradient gets an inf in rank 3's shard only; the script then clips by
    clip_master_grads (sdp_gradient_clipping off), else sdp_gradient_clipping clips in step()."""
    model, opt, train_step = _setup(precision, 0.0 if overflow_step is not None else CLIP)
    assert type(model.module.blocks[0].inner).__name__ == "DistributedLinear"
    losses, scales, skipped, norms = [], [], [], []
    for step in range(STEPS):
        scales.append(opt.loss_scale)
        out = train_step(*_batch(step, smp.dp_rank()))
        if step == overflow_step and smp.rank() == 3:
            grad = dict(model.module.named_parameters())[OVERFLOW_PARAM].grad
            assert isinstance(grad, DTensor)
            grad.to_local().view(-1)[-1] = float("inf")
        if overflow_step is not None:
            norm = float(opt.clip_master_grads(CLIP))
        opt.step()
        if overflow_step is not None and not opt.overflow:
            norms.append(norm)
        opt.zero_grad()
        losses.append(out.reduce_mean().item())
        skipped.append(opt.overflow)
    kinds = {n: (type(p).__name__, str(p.dtype)) for n, p in model.module.named_parameters()}
    whole = frozenset(n for n, (kind, _) in kinds.items() if kind != "DTensor")
    ref = _reference(precision, smp.dp_size(), CLIP, overflow_step, whole_names=whole, build=_smooth)
    sharding = model._sharded
    with sharding.gathered():  # the sharded parameters whole: fp32, their own masters
        gathered = sharding.gather_tp_state()
    masters = {n: v for n, v in gathered.items() if n not in whole}
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
        "masters": first_difference(masters, {n: ref["masters"][n] for n in masters}, rtol=rtol, atol=atol),
        "master_dtypes": sorted({str(v.dtype) for v in masters.values()}),
        "worst": max(((m - ref["masters"][n]).abs().max().item(), n) for n, m in masters.items()),
        "params": first_difference(params, ref["params"], rtol=hrtol, atol=hatol),
        "dtypes": sorted({str(v.dtype) for v in params.values()}),
        "kinds": kinds,
        "whole": sorted(whole),
    }


def _check(r: dict[str, Any], precision: str) -> None:
    assert r["masters"] is None and r["params"] is None, r
    assert r["master_dtypes"] == ["torch.float32"], r
    assert max(r["losses"]) <= (1e-3 if precision == "fp16" else 1e-2), r
    assert r["scales"][0] == r["scales"][1] and r["skipped"][0] == r["skipped"][1], r
    half = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}[precision]
    assert r["dtypes"] == [half], r  # the model's state in the half dtype, as smp's
    assert r["kinds"]["blocks.0.inner.weight"] == ("DTensor", "torch.float32"), r
    assert r["kinds"]["blocks.0.inner.bias"] == ("Parameter", half), r
    got, want = r["norms"]
    assert len(got) == len(want) and all(abs(g - w) <= 1e-3 * w for g, w in zip(got, want, strict=True)), r


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_tp2_sdp2_half_precision_trains_like_the_one_process_recipe(worlds: Any, precision: str) -> None:
    """sdp_gradient_clipping 1.0 inside optimizer.step()."""
    for r in worlds.run(4, _train, precision, None, timeout=400):
        _check(r, precision)


def test_tp2_sdp2_forced_overflow_and_clip_master_grads(worlds: Any) -> None:
    """An inf in one rank's shard skips the step on all four ranks and halves the scale; the norms
    clip_master_grads returns are the one-process recipe's (TP-replicated parameters counted once)."""
    for r in worlds.run(4, _train, "fp16", 2, timeout=400):
        _check(r, "fp16")
        scales, skipped = r["scales"][0], r["skipped"][0]
        assert skipped[2] and not any(skipped[:2] + skipped[3:]), r
        assert scales[3] == scales[2] / 2, r
        assert len(r["norms"][0]) == STEPS - 1, r


def _round_trip(world: Any, path: str) -> dict[str, Any]:
    """fp16: a partial checkpoint (this rank's shards of its TP shards' masters and AdamW state, the
    scaler) resumes bitwise; the full optimizer state is refused by name."""

    def run(opt: Any, train_step: Any, steps: range) -> None:
        for step in steps:
            train_step(*_batch(step, smp.dp_rank()))
            opt.step()
            opt.zero_grad()

    model, opt, train_step = _setup("fp16", CLIP)
    run(opt, train_step, range(2))
    smp.save_checkpoint(path, "s2", partial=True, model=model, optimizer=opt)
    run(opt, train_step, range(2, 4))
    straight, straight_opt = model.state_dict(), opt.local_state_dict()
    refused = ""
    try:
        opt.state_dict()
    except smp.SMPUnsupportedError as exc:
        refused = str(exc)
    smp.reset()
    model, opt, train_step = _setup("fp16", CLIP, seed=7)  # other weights: the checkpoint must replace them
    smp.resume_from_checkpoint(path, "s2", partial=True)
    run(opt, train_step, range(2, 4))
    resumed_opt = opt.local_state_dict()
    return {
        "params": first_difference(model.state_dict(), straight, rtol=0, atol=0),
        "masters": first_difference(
            resumed_opt["fp32_master_params"], straight_opt["fp32_master_params"], rtol=0, atol=0
        ),
        "scaler": resumed_opt["loss_scaler"] == straight_opt["loss_scaler"],
        "refused": refused,
    }


def test_tp2_sdp2_fp16_partial_checkpoint_round_trip(worlds: Any, tmp_path: Any) -> None:
    for r in worlds.run(4, _round_trip, str(tmp_path), timeout=400):
        assert r["params"] is None and r["masters"] is None and r["scaler"], r
        assert "optimizer.local_state_dict()" in r["refused"], r
