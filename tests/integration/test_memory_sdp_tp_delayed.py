"""sharded_data_parallel_degree with tensor parallelism and delayed parameter initialization: tp=2 x sdp=2
on 4 ranks.

The model is built on the meta device inside smp.tensor_parallelism(); smp.DistributedModel replaces the
marked modules on meta and materializes the model block by block, each block sharded as soon as it is
initialized. Each TP shard is drawn as its distributed module's constructor draws it (mp_tensor's
ParamInit), so the values equal those of delayed initialization under TP without sharding (tp=2 x dp=2,
same seed) bitwise; training then equals plain single-process PyTorch started from those values (all
four ranks' batches) within 1e-5. In fp16 likewise, against the one-process fp16 recipe (half parameters
within test_memory_sdp_precision's HALF_TOL).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import mp as smp
from tests.integration.test_memory_sdp import (
    STEPS,
    Stack,
    _batch,
    _close,
    _config,
    _optimizer,
    _reference,
)
from tests.mp_pipeline.models import first_difference

# this TP rank's shards: the root's inp and out, every block's biases (kept whole), one block's weights
ROOT = 32 * 5 + 32 + 16 * 4 + 4
BIASES = 4 * 2 * 32
BLOCK_WEIGHTS = 2 * 32 * 16


def _build(
    sdp: int, optimizer: Any, net_class: type[Stack] = Stack, **extra: Any
) -> tuple[Any, Any, Any, bool]:
    smp.init(_config(sdp, tensor_parallel_degree=2, sdp_param_persistence_threshold=100, **extra))
    torch.manual_seed(0)  # every rank: a TP shard's draw is its full tensor's, sliced
    with smp.delay_param_initialization(), smp.tensor_parallelism():
        net = net_class()
    on_meta = all(p.is_meta for p in net.parameters())
    model = smp.DistributedModel(net)
    kwargs: dict[str, Any] = {}
    if extra.get("fp16"):
        from tests.integration.test_memory_sdp_precision import SCALING

        kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": SCALING}
    opt = smp.DistributedOptimizer(optimizer(model.parameters()), **kwargs)

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step, on_meta


def _delayed(world: Any) -> dict[str, Any]:
    # TP without sharding: its delayed values, read after a step that changes nothing (SGD, lr 0)
    model, opt, train_step, _ = _build(1, lambda ps: torch.optim.SGD(ps, lr=0.0))
    train_step(*_batch(0, smp.dp_rank()))
    opt.step()
    want = model.state_dict()
    smp.reset()

    model, opt, train_step, on_meta = _build(2, _optimizer)
    kinds = sorted({type(p).__name__ for p in model.module.parameters()})
    meta_left = any(p.is_meta for p in model.module.parameters())
    peak = model._sharded.peak_unsharded
    initial = model.state_dict()
    losses = []
    for step in range(STEPS):
        losses.append(train_step(*_batch(step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    ref = _reference(smp.dp_size(), 1.0, initial=initial)
    return {
        "on_meta": on_meta,
        "meta_left": meta_left,
        "kinds": kinds,
        "peak": peak,
        "init": first_difference(initial, want, rtol=0, atol=0),
        "moved": float(sum((initial[k] - v).abs().sum() for k, v in _reference(1, 0.0, 0)["params"].items())),
        "loss_ok": all(_close(g, w[smp.dp_rank()]) for g, w in zip(losses, ref["losses"], strict=True)),
        "params": first_difference(model.state_dict(), ref["params"]),
    }


def test_tp2_sdp2_delayed_init_draws_tp_shards_and_trains_like_one_process(worlds: Any) -> None:
    for r in worlds.run(4, _delayed, timeout=400):
        assert r["on_meta"] and not r["meta_left"] and "DTensor" in r["kinds"], r
        assert r["init"] is None, r  # the TP path's own draws, bitwise
        assert r["moved"] > 0, r  # not the eager values: the distributed modules' own init (docs/memory.md)
        assert r["peak"] <= ROOT + BIASES + BLOCK_WEIGHTS, r  # never two blocks whole at once
        assert r["loss_ok"] and r["params"] is None, r


def _delayed_fp16(world: Any) -> dict[str, Any]:
    """fp16: the values (rounded to half as an eager model cast to fp16) are those of delayed init under
    TP alone in fp16, bitwise; training equals the one-process fp16 recipe started from them
    (test_memory_sdp_tp_precision's model, reference and tolerances)."""
    from tests.integration.test_memory_sdp_precision import HALF_TOL
    from tests.integration.test_memory_sdp_precision import STEPS as HALF_STEPS
    from tests.integration.test_memory_sdp_precision import _optimizer as half_optimizer
    from tests.integration.test_memory_sdp_precision import _reference as half_reference
    from tests.integration.test_memory_sdp_tp_precision import CLIP, Smooth

    model, opt, train_step, _ = _build(1, lambda ps: torch.optim.SGD(ps, lr=0.0), Smooth, fp16=True)
    train_step(*_batch(0, smp.dp_rank()))
    opt.step()
    want = model.state_dict()
    smp.reset()

    model, opt, train_step, on_meta = _build(2, half_optimizer, Smooth, fp16=True, sdp_gradient_clipping=CLIP)
    initial = model.state_dict()
    losses = []
    for step in range(HALF_STEPS):
        losses.append(train_step(*_batch(step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    whole = frozenset(n for n, p in model.module.named_parameters() if type(p).__name__ != "DTensor")

    def start() -> Smooth:
        net = Smooth()
        net.load_state_dict({k: v.float() for k, v in initial.items()})
        return net

    ref = half_reference("fp16", smp.dp_size(), CLIP, None, whole_names=whole, build=start)
    rtol, atol = HALF_TOL["fp16"]
    return {
        "on_meta": on_meta,
        "dtypes": sorted({str(v.dtype) for v in initial.values()}),
        "init": first_difference(initial, want, rtol=0, atol=0),
        "losses": max(
            abs(g - w[smp.dp_rank()]) / abs(w[smp.dp_rank()])
            for g, w in zip(losses, ref["losses"], strict=True)
        ),
        "params": first_difference(model.state_dict(), ref["params"], rtol=rtol, atol=atol),
    }


def test_tp2_sdp2_delayed_init_in_fp16(worlds: Any) -> None:
    for r in worlds.run(4, _delayed_fp16, timeout=400):
        assert r["on_meta"] and r["dtypes"] == ["torch.float16"], r
        assert r["init"] is None, r
        assert r["losses"] <= 1e-3 and r["params"] is None, r
