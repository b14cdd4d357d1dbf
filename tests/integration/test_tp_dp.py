"""Tensor parallelism composed with data parallelism through the smp API: 4 ranks, tp 2 x rdp 2.

Gradients of distributed parameters are reduced over the reduced-data-parallel group, all others over
the data-parallel group; after one SGD step every parameter equals single-process training on the
global batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp
from mp_tensor import reference as ref
from tests.mp_tensor._tp_util import SMALL

LOCAL_B, S, V = 2, 5, 24


class Model(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.transformer = transformer
        self.head = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.transformer((self.embed(ids), None))[0]
        return self.head(h)  # type: ignore[no-any-return]


def _train_step(world: Any, optimize: str, prescaled: bool) -> dict[str, float]:
    import mp.nn
    import mp.tensor_api as tapi

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "optimize": optimize, "prescaled_batch": prescaled})
    kw = {**SMALL, "num_layers": 2, "causal_mask_size": 8}
    torch.manual_seed(0)
    reference = Model(ref.Transformer(**kw))
    with tapi.tensor_parallelism():
        model = Model(mp.nn.DistributedTransformer(**kw))
    tapi.load_original_state_dict(model, reference.state_dict())
    model = tapi.replace_tp_modules(model)  # the head (a marked nn.Linear) becomes a DistributedLinear
    assert type(model.head).__name__ == "DistributedLinear"

    batches = smp.rdp_size() if prescaled else smp.dp_size()
    which = smp.rdp_rank() if prescaled else smp.dp_rank()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (batches * LOCAL_B, S), generator=gen)
    labels = torch.randint(0, V, (batches * LOCAL_B, S), generator=gen)
    mine = slice(which * LOCAL_B, (which + 1) * LOCAL_B)

    F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(model(ids[mine]).flatten(0, 1), labels[mine].flatten()).backward()
    tapi.reduce_tp_gradients(list(model.parameters()))
    for m in (reference, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    after = tapi.gather_state_dict(model)
    expected = reference.state_dict()
    return {k: (after[k] - v).abs().max().item() for k, v in expected.items()}


@pytest.mark.parametrize(("optimize", "prescaled"), [("memory", False), ("speed", True)])
def test_tp_with_dp_matches_single_process(worlds: Any, optimize: str, prescaled: bool) -> None:
    results = worlds.run(4, _train_step, optimize, prescaled, timeout=120)
    for rank, diffs in enumerate(results):
        bad = {k: v for k, v in diffs.items() if not v < 2e-6}
        assert not bad, (rank, bad)


def _tp_inspection(world: Any) -> dict[str, Any]:
    import mp.nn

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        kw = {**SMALL, "num_layers": 2, "causal_mask_size": 8}
        with smp.tensor_parallelism():
            model = smp.DistributedModel(Model(mp.nn.DistributedTransformer(**kw)))

        @smp.step
        def train(ids: torch.Tensor) -> torch.Tensor:
            loss = model(ids).float().square().mean()
            model.backward(loss)
            return loss

        train(torch.randint(0, V, (LOCAL_B, S)))
        local = dict(model.local_named_parameters())
        default = dict(model.default_reducer_named_parameters())
        scaled = dict(model.scaled_batch_reducer_named_parameters())
        return {
            "modules": sorted({type(m).__name__ for m in model.distributed_modules()}),
            "split": set(default) | set(scaled) == set(local) and not set(default) & set(scaled),
            "scaled_flags": all(model.is_scaled_batch_parameter(p) for p in scaled.values())
            and not any(model.is_scaled_batch_parameter(p) for p in default.values()),
            "sharded": sum(model.is_distributed_parameter(p) for p in local.values()),
            "sharded_in_tp_modules": {id(p) for p in local.values() if model.is_distributed_parameter(p)}
            <= {id(p) for m in model.distributed_modules() for p in m.parameters()},
            "buffers": [model.is_distributed_buffer(b) for b in model.buffers()],
        }
    finally:
        smp.reset()


def test_tp_inspection_helpers(worlds: Any) -> None:
    for r in worlds.run(2, _tp_inspection, timeout=120):
        assert "DistributedTransformer" in r["modules"], r
        assert r["split"] and r["scaled_flags"], r
        assert r["sharded"] > 0 and r["sharded_in_tp_modules"], r
        assert not any(r["buffers"]), r


def _model_creation(world: Any) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        with smp.model_creation(tensor_parallelism=True, dtype=torch.float64):
            net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        inside_default = torch.get_default_dtype()
        model = smp.DistributedModel(net)
        return {
            "modules": sorted(type(m).__name__ for m in model.distributed_modules()),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "default_after": str(inside_default),
            "shapes": [tuple(p.shape) for p in model.parameters()],
        }
    finally:
        smp.reset()


def test_model_creation_marks_for_tp_and_sets_the_dtype(worlds: Any) -> None:
    for r in worlds.run(2, _model_creation, timeout=120):
        assert r["modules"] == ["DistributedLinear", "DistributedLinear"], r
        assert r["dtypes"] == ["torch.float64"] and r["default_after"] == "torch.float32", r
        assert (8, 4) in r["shapes"] or (4, 8) in r["shapes"] or (2, 8) in r["shapes"], r  # sharded over 2


def test_model_creation_restores_the_default_dtype_on_error() -> None:
    try:
        with smp.model_creation(dtype=torch.float16):
            assert nn.Linear(2, 2).weight.dtype == torch.float16
            raise KeyError("boom")
    except KeyError:
        pass
    assert torch.get_default_dtype() == torch.float32
