"""Hugging Face T5 and ViT built under ``smp.tensor_parallelism()`` through ``smp.DistributedModel``:
their blocks become ``DistributedT5Block`` / ``DistributedViTLayer`` and they train like single-process
PyTorch at tp=2 and at tp=2 x pp=2 (losses, and the full state dict after the optimizer steps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mp as smp
from tests.integration._tp_model import assert_losses, global_loss

transformers = pytest.importorskip("transformers")

STEPS, PER_RANK, SEQ, VOCAB, CLASSES = 3, 4, 8, 48, 5


def _model(family: str) -> Any:
    if family == "vit":
        return transformers.ViTForImageClassification(
            transformers.ViTConfig(
                image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, num_labels=CLASSES,
            )
        )  # fmt: skip
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
        pad_token_id=0, feed_forward_proj="gated-gelu", tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _data(family: str, dp_size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = dp_size * PER_RANK
    if family == "vit":
        return [
            {
                "pixel_values": torch.randn(n, 3, 8, 8, generator=g),
                "labels": torch.randint(0, CLASSES, (n,), generator=g),
            }
            for _ in range(STEPS)
        ]
    return [
        {
            "input_ids": torch.randint(2, VOCAB, (n, SEQ), generator=g),
            "labels": torch.randint(2, VOCAB, (n, SEQ), generator=g),
        }
        for _ in range(STEPS)
    ]


def _reference(family: str, dp_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in _data(family, dp_size):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(world: Any, pp: int, family: str) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = _model(family)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def train_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch).loss
        model.backward(loss)
        return loss

    dp, rank = smp.dp_size(), smp.dp_rank()
    losses = []
    for batch in _data(family, dp):
        opt.zero_grad()
        out = train_step(model, {k: v[rank * PER_RANK : (rank + 1) * PER_RANK] for k, v in batch.items()})
        opt.step()
        losses.append(global_loss(out, dp))
    kinds = sorted({type(m).__name__ for m in model.module.modules() if "mp_tensor" in type(m).__module__})
    state = model.state_dict()  # HF's keys and full tensors: TP shards and pipeline stages gathered
    result: dict[str, Any] = {"losses": losses, "dp": dp, "kinds": kinds}
    result["state"] = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    return result


@pytest.mark.parametrize(
    ("family", "n", "pp"),
    [("t5", 2, 1), ("t5", 4, 2), ("vit", 2, 1), ("vit", 4, 2)],
    ids=["t5-tp2", "t5-tp2xpp2", "vit-tp2", "vit-tp2xpp2"],
)
def test_t5_and_vit_train_like_single_process(worlds: Any, family: str, n: int, pp: int) -> None:
    results = worlds.run(n, _train, pp, family, timeout=400)
    ref_losses, ref_state = _reference(family, results[0]["dp"])
    block = "DistributedT5Block" if family == "t5" else "DistributedViTLayer"
    for r, res in enumerate(results):
        assert_losses(res["losses"], ref_losses, r)
        assert block in res["kinds"], res["kinds"]
        if "state" in res:
            assert set(res["state"]) == set(ref_state)
            for key, value in ref_state.items():
                torch.testing.assert_close(
                    res["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
                )


def _volume(world: Any, optimize: str) -> list[Any]:
    from mp_tensor.comm_volume import measure

    prescaled = optimize == "speed"  # smp allows prescaled_batch with speed only
    smp.init({"tensor_parallel_degree": 2, "optimize": optimize, "prescaled_batch": prescaled, "ddp": True})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = _model("t5")
    model = smp.DistributedModel(model)
    batch = {k: v[: PER_RANK if prescaled else PER_RANK // 2] for k, v in _data("t5", 1)[0].items()}

    @smp.step
    def train_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch).loss
        model.backward(loss)
        return loss

    rows = measure(model.module, lambda: train_step(model, batch))
    return [(r.name, r.cls, r.matches(), r.measured) for r in rows if r.cls == "DistributedT5Block"]


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_comm_volume_in_an_smp_job_equals_the_count(worlds: Any, optimize: str) -> None:
    # the TP groups of smp.init (which run CPU collectives over MPI when launched under mpiexec);
    # per-rank batches in memory mode: the reductions are compared
    for rank, rows in enumerate(worlds.run(2, _volume, optimize, timeout=300)):
        assert len(rows) == 4, rows  # 2 encoder and 2 decoder blocks
        for name, _, ok, measured in rows:
            assert measured and ok, (rank, name, measured)
