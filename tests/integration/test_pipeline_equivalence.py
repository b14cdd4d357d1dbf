"""The core check: pipelined (and data-parallel) training equals plain single-process PyTorch.

Same model, seed and data: the loss of every step and every parameter after 3 optimizer steps agree
(fp32, rtol 1e-5, atol 1e-6; the first tensor that differs is named). The reference is plain PyTorch
running the step once per microbatch (tests/mp_pipeline/models.py). The larger grid lives in
benchmarks/pipeline_grid.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mp as smp
from mp import DistributedModel, DistributedOptimizer, step
from tests.mp_pipeline.models import (
    STEPS,
    batch,
    build,
    first_difference,
    loss_of,
    make_optimizer,
    manual_marks,
    reference,
)


def train_and_compare(
    world: Any,
    name: str,
    pp: int,
    microbatches: int,
    pipeline: str,
    *,
    optimizer_first: bool = True,
    layers: int = 2,
    deterministic: bool = False,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "pipeline_parallel_degree": pp,
        "microbatches": microbatches,
        "pipeline": pipeline,
        "deterministic_server": deterministic,
    }
    if name == "reuse":
        cfg.update(auto_partition=False, default_partition=0)
    smp.init(cfg)
    model = build(name, layers=layers)
    manual_marks(name, model, pp)
    opt = make_optimizer(name, model.parameters()) if optimizer_first else None
    model = DistributedModel(model)
    opt = DistributedOptimizer(opt if opt is not None else make_optimizer(name, model.parameters()))

    @step
    def train_step(*data: torch.Tensor) -> torch.Tensor:
        loss = loss_of(name, model, data)
        model.backward(loss)
        return loss

    losses = []
    for s in range(STEPS):
        out = train_step(*batch(name, s, smp.dp_rank()))
        assert len(out.outputs) == microbatches
        losses.append(out.reduce_mean().item())
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    ref_losses, ref_state = reference(name, microbatches=microbatches, replicas=smp.dp_size(), layers=layers)
    loss_error = None
    for s, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        if abs(got - want[smp.dp_rank()]) > 1e-6 + 1e-5 * abs(want[smp.dp_rank()]):
            loss_error = f"step {s}: loss {got} != reference {want[smp.dp_rank()]}"
            break
    local = sum(p.numel() for p in model.local_parameters())
    return {
        "rank": smp.rank(),
        "loss": loss_error,
        "params": first_difference(state, ref_state),
        "local_params": local,
        "total_params": sum(v.numel() for v in ref_state.values()),
    }


CASES = [
    # (ranks, model, pp, microbatches, schedule)
    (2, "mlp", 2, 2, "interleaved"),
    (2, "mlp", 1, 4, "simple"),  # pp=1: pure data parallelism over 2 replicas
    (2, "cnn", 2, 4, "simple"),
    (2, "reuse", 2, 4, "interleaved"),
    (2, "reuse", 2, 4, "deterministic"),  # interleaved with deterministic_server
    (2, "reuse", 2, 1, "simple"),
    (2, "gpt2", 2, 2, "interleaved"),
    (4, "reuse", 2, 2, "simple"),  # pp=2 with 2 data-parallel replicas
    (4, "gpt2", 2, 2, "simple"),  # GPT-2 on pp=2 with 2 data-parallel replicas
    (4, "gpt2", 4, 4, "interleaved"),
]


@pytest.mark.parametrize(("n", "name", "pp", "microbatches", "pipeline"), CASES)
def test_pipeline_equals_plain_pytorch(  # noqa: PLR0917 - pytest parameters
    worlds: Any, n: int, name: str, pp: int, microbatches: int, pipeline: str
) -> None:
    layers = 4 if pp == 4 else 2
    deterministic = pipeline == "deterministic"
    results = worlds.run(
        n,
        train_and_compare,
        name,
        pp,
        microbatches,
        "interleaved" if deterministic else pipeline,
        optimizer_first=microbatches != 2,
        layers=layers,
        deterministic=deterministic,
        timeout=180,
    )
    for r in results:
        assert r["loss"] is None, f"rank {r['rank']}: {r['loss']}"
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
    if pp > 1:
        # each rank keeps only its partition's parameters
        assert all(r["local_params"] < r["total_params"] for r in results), results
