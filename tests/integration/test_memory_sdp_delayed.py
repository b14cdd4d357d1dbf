"""sharded_data_parallel_degree with delayed parameter initialization on real worlds.

The model is built on the meta device (smp.delay_param_initialization(), or smp.model_creation under the
config key). smp.DistributedModel materializes its parameters in module order and shards each block as
soon as it is initialized, so at most the root's parameters and one block are ever whole. The values
equal eager initialization under the same seed for a model whose modules draw their random numbers in
module order (this one: nn.Linear's reset_parameters), so training equals plain PyTorch built eagerly
(test_memory_sdp's reference) within 1e-5: losses, gradients, parameters and AdamW state. A Hugging Face
GPT-2 (reset_parameters, then _init_weights, per module) trains like one process started from the values
it materialized.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import mp as smp
from tests.integration.test_memory_sdp import Stack, _build, _config, _full, _train
from tests.mp_pipeline.models import first_difference

BLOCK = 2 * (32 * 32 + 32)  # one Block of the Stack model
ROOT = 10 * 32 + 32 + 32 * 4 + 4  # inp and out
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _initial(world: Any, how: str, precision: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"delayed_parameter_initialization": how == "model_creation"}
    if precision is not None:
        extra[precision] = True
    smp.init(_config(2, sdp_param_persistence_threshold=0, **extra))
    torch.manual_seed(0)  # as _build() before building eagerly
    with smp.model_creation() if how == "model_creation" else smp.delay_param_initialization():
        net = Stack()
    on_meta = all(p.is_meta for p in net.parameters())
    model = smp.DistributedModel(net)
    eager = _build()
    if precision is not None:
        eager = eager.to(HALF[precision])
    return {
        "on_meta": on_meta,
        "kinds": sorted({type(p).__name__ for p in model.module.parameters()}),
        "meta_left": any(_local(p).is_meta for p in model.module.parameters()),
        "peak": model._sharded.peak_unsharded,
        "init": first_difference(model.state_dict(), eager.state_dict(), rtol=0, atol=0),
    }


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@pytest.mark.parametrize(
    ("how", "precision"),
    [("delay_param_initialization", None), ("model_creation", None), ("model_creation", "fp16")],
)
def test_materialized_block_by_block_equal_to_eager_init(
    worlds: Any, how: str, precision: str | None
) -> None:
    for r in worlds.run(2, _initial, how, precision, timeout=300):
        assert r["on_meta"] and not r["meta_left"] and r["kinds"] == ["DTensor"], r
        assert r["init"] is None, r  # bitwise the eager values (fp16: eager fp32 init, then cast)
        assert r["peak"] <= ROOT + BLOCK, r  # never more than the root and one block whole (of 4)


@pytest.mark.parametrize("ranks", [2, 4])
def test_delayed_sharded_training_equals_one_process(worlds: Any, ranks: int) -> None:
    """sdp=2 (2 ranks) and sdp=2 x dp=2 (4 ranks, HSDP) from delayed init equal one process built eagerly."""
    for r in worlds.run(ranks, _train, _config(2), True, timeout=300):
        assert r["loss_ok"] and r["grads"] is None and r["params"] is None and r["opt"] is None, r
        assert r["kinds"]["blocks.0.inner.weight"] == "DTensor", r


def _gpt2(world: Any) -> dict[str, Any]:
    """A Hugging Face GPT-2 built on meta at sdp=2: trains like one process from its materialized values."""
    from tests.mp_pipeline.models import batch, build, loss_of, make_optimizer

    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "microbatches": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_gradient_clipping": 0.0,
        }
    )
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        net = build("gpt2")
    model = smp.DistributedModel(net)
    initial = model.state_dict()
    opt = smp.DistributedOptimizer(make_optimizer("gpt2", model.parameters()))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of("gpt2", model, (ids,))
        model.backward(loss)
        return loss

    for step in range(3):
        train_step(*batch("gpt2", step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()
    ref = build("gpt2")
    ref.load_state_dict(initial)
    ref_opt = make_optimizer("gpt2", ref.parameters())
    for step in range(3):
        for r in range(2):
            for part in batch("gpt2", step, r)[0].chunk(2):
                (loss_of("gpt2", ref, (part,)) / 4).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.manual_seed(0)
    eager = build("gpt2").state_dict()
    return {
        "params": first_difference(model.state_dict(), ref.state_dict()),
        "init_vs_eager": first_difference(initial, eager, rtol=0, atol=0),
        "wte_std": _full(model.module.transformer.wte.weight).std().item(),
    }


def test_hf_gpt2_delayed_trains_like_one_process(worlds: Any) -> None:
    for r in worlds.run(2, _gpt2, timeout=300):
        assert r["params"] is None, r
        assert 0.015 < r["wte_std"] < 0.025, r  # HF's _init_weights ran: normal(0, 0.02)
