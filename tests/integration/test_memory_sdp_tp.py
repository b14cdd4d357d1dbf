"""sharded_data_parallel_degree with tensor parallelism on real worlds: tp=2 x sdp=2 on 4 ranks.

Every layer of the model is tensor-parallel (smp.tensor_parallelism()); each TP rank shards its own TP
shards with FSDP2 over the ranks holding the same ones (the reduced data-parallel group). Against plain
single-process PyTorch on all four ranks' batches (TP across DP: every rank trains on its own batch):
every loss, and every parameter after 4 AdamW steps with the global-norm clipping of
sdp_gradient_clipping, gathered in the original model's names by model.state_dict(), within 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mp as smp
from mp_memory.sharded import state_bytes
from tests.integration.test_memory_sdp import STEPS, Stack, _batch, _close, _config, _optimizer, _reference
from tests.mp_pipeline.models import first_difference


def _train(world: Any, extra: dict[str, Any]) -> dict[str, Any]:
    smp.init(_config(2, tensor_parallel_degree=2, sdp_param_persistence_threshold=100, **extra))
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = Stack()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    # prescaled_batch: the TP group's ranks share one batch, so the replicas are the RDP ranks
    prescaled = bool(extra.get("prescaled_batch"))
    replica, replicas = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    losses = []
    for step in range(STEPS):
        losses.append(train_step(*_batch(step, replica)).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    ref = _reference(replicas, 1.0)
    sharded = {n: type(p).__name__ for n, p in model.module.named_parameters()}
    return {
        "loss_ok": all(_close(g, w[replica]) for g, w in zip(losses, ref["losses"], strict=True)),
        "params": first_difference(model.state_dict(), ref["params"]),
        "types": sorted(set(sharded.values())),
        "layer": type(model.module.blocks[0].inner).__name__,
        "bytes": sum(state_bytes(model.module, opt).values()),
    }


@pytest.mark.parametrize(
    "extra",
    [{}, {"optimize": "speed"}, {"optimize": "speed", "prescaled_batch": True}],
    ids=["memory", "speed", "prescaled"],
)
def test_tp2_sdp2_trains_like_one_process(worlds: Any, extra: dict[str, Any]) -> None:
    for r in worlds.run(4, _train, extra, timeout=400):
        assert r["layer"] == "DistributedLinear", r
        assert r["loss_ok"] and r["params"] is None, r
        assert "DTensor" in r["types"], r


def _setup_tp(seed: int) -> tuple[Any, Any, Any]:
    smp.init(_config(2, tensor_parallel_degree=2, sdp_param_persistence_threshold=100))
    torch.manual_seed(seed)
    with smp.tensor_parallelism():
        net = Stack()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def _round_trip(world: Any, path: str) -> dict[str, Any]:
    """A partial checkpoint (one file per shard and TP rank) resumes bitwise (full states:
    test_memory_sdp_tp_state.py)."""

    def run(opt: Any, train_step: Any, steps: range) -> None:
        for step in steps:
            train_step(*_batch(step, smp.dp_rank()))
            opt.step()
            opt.zero_grad()

    model, opt, train_step = _setup_tp(0)
    run(opt, train_step, range(2))
    smp.save_checkpoint(path, "s2", partial=True, model=model, optimizer=opt)
    run(opt, train_step, range(2, STEPS))
    straight = model.state_dict()
    smp.reset()
    model, opt, train_step = _setup_tp(7)  # other weights: the checkpoint must replace them
    smp.resume_from_checkpoint(path, "s2", partial=True)
    run(opt, train_step, range(2, STEPS))
    return {"diff": first_difference(model.state_dict(), straight, rtol=0, atol=0)}


def test_partial_checkpoint_round_trip(worlds: Any, tmp_path: Any) -> None:
    for r in worlds.run(4, _round_trip, str(tmp_path), timeout=400):
        assert r["diff"] is None, r


def _gpt2(world: Any) -> dict[str, Any]:
    """A Hugging Face GPT-2 made whole-stack tensor-parallel (GPT2DistributedLMHead) at tp=2 x sdp=2."""
    from tests.mp_pipeline.models import batch, loss_of, make_optimizer, reference

    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "microbatches": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_gradient_clipping": 0.0,
        }
    )
    from tests.mp_pipeline.models import build

    with smp.tensor_parallelism():
        net = build("gpt2")
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(make_optimizer("gpt2", model.parameters()))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of("gpt2", model, (ids,))
        model.backward(loss)
        return loss

    losses = []
    for step in range(3):
        losses.append(train_step(*batch("gpt2", step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    want_losses, want = reference("gpt2", microbatches=2, replicas=smp.dp_size(), steps=3)
    return {
        "blocks": len(model._sharded.blocks),
        "model": type(model.module).__name__,
        "loss_ok": all(_close(g, w[smp.dp_rank()]) for g, w in zip(losses, want_losses, strict=True)),
        # the distributed head gives its translated entries in its own order (as without sharding)
        "params": first_difference(dict(sorted(model.state_dict().items())), dict(sorted(want.items()))),
    }


def test_whole_stack_gpt2_trains_like_one_process(worlds: Any) -> None:
    for r in worlds.run(4, _gpt2, timeout=500):
        assert r["model"].endswith("GPT2DistributedLMHead"), r  # FSDP2 prefixes the class name
        assert r["blocks"] == 2, r  # each DistributedTransformerLayer is sharded on its own
        assert r["loss_ok"] and r["params"] is None, r
