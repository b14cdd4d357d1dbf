"""The equivalence check's training run, shared by the pipeline equivalence tests: train a model of
tests/mp_pipeline/models.py under mp and compare every step's loss and the final parameters with plain
single-process PyTorch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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

__all__ = ["train_and_compare"]


def _reference_from_rank_0(name: str, **kwargs: Any) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The plain PyTorch reference, run once (on rank 0) and sent to every rank: it is the same
    everywhere, and 4 ranks on a 2-core machine would otherwise run it 4 times over (~3 s each for T5)."""
    box = [reference(name, **kwargs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


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
    mode: str = "dynamic",
    steps: int = STEPS,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "pipeline_parallel_degree": pp,
        "microbatches": microbatches,
        "pipeline": pipeline,
        "deterministic_server": deterministic,
    }
    if mode != "default":  # "default": static_mode and fast_mode unset, as users run it
        cfg.update(static_mode=mode == "static", fast_mode=mode == "fast")
    if name in {"reuse", "reuse_static"}:
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
    compact = shortcuts = handoffs = posted = replayed = 0
    for s in range(steps):
        out = train_step(*batch(name, s, smp.dp_rank()))
        assert len(out.outputs) == microbatches
        losses.append(out.reduce_mean().item())
        opt.step()
        opt.zero_grad()
        if model._runtime is not None:
            compact += model._runtime.last_stats["compact_sent"]
            shortcuts += model._runtime.last_stats["shortcuts"]
            handoffs += model._runtime.last_stats["handoffs"]
            posted += model._runtime.last_stats["posted"]
            replayed += model._runtime.last_stats["replayed"]
    state = model.state_dict()
    ref_losses, ref_state = _reference_from_rank_0(
        name, microbatches=microbatches, replicas=smp.dp_size(), layers=layers, steps=steps
    )
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
        "compact_sent": compact,
        "shortcuts": shortcuts,
        "handoffs": handoffs,
        "posted": posted,
        "replayed": replayed,
        "relearned": model._runtime.relearned if model._runtime is not None else 0,
    }
