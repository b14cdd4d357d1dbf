"""A Hugging Face GPT-NeoX built under ``smp.tensor_parallelism()`` becomes smp's DistributedTransformerLMHead
(``GPTNeoXDistributedLMHead``) through ``smp.DistributedModel`` and trains like the plain Hugging Face
model in one process on the global batch, with AdamW: losses every step, every gradient of the first step
(TP shards gathered, pipeline stages joined, Hugging Face's names) and the full ``state_dict()`` after the
steps, within 1e-5, at tp=2 and at tp=2 x pp=2 (as tests/integration/test_train_gptj_neo.py for GPT-J and
GPT-Neo, whose data, optimizer and comparison this reuses)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mp as smp
from tests.integration._gptj_neo import (
    LAYERS,
    PER_RANK,
    SEQ,
    STEPS,
    VOCAB,
    _close,
    _data,
    _optimizer,
)
from tests.integration._tp_model import assert_losses, global_loss

transformers = pytest.importorskip("transformers")

HEADS = 4


def _model() -> Any:
    cfg = transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
        max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, vocab_size=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(cfg)


def _reference(dp_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer(model.parameters())
    ids, mask = _data(dp_size)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids[step], attention_mask=mask[step], labels=ids[step]).loss
        loss.backward()
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "state": model.state_dict()}


def _gradients(model: Any) -> dict[str, torch.Tensor]:
    """This step's gradients in Hugging Face's names: TP shards gathered, pipeline stages joined."""
    from mp_tensor.hf.translate_gpt import gptneox_from_smp
    from mp_tensor.nn.base import param_spec

    group = smp.get_tp_process_group()
    local = {n.removeprefix("module.") for n, _ in model.local_named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.get_module().named_parameters():
        if name not in local:  # another stage's
            continue
        assert p.grad is not None, name
        g, spec = p.grad.detach().clone(), param_spec(p)
        if spec is not None and spec.split_dim is not None:
            parts = [torch.empty_like(g) for _ in range(smp.tp_size())]
            torch.distributed.all_gather(parts, g.contiguous(), group=group)
            g = torch.cat(parts, spec.split_dim % g.dim())
        grads[name] = g
    if smp.pp_size() > 1:
        stages: list[Any] = [None] * smp.pp_size()
        torch.distributed.all_gather_object(stages, grads, group=smp.get_pp_process_group())
        grads = {k: v for part in stages for k, v in part.items()}
    return gptneox_from_smp(grads, HEADS)


def _train(world: Any, pp: int) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = _model()
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, attention_mask=mask, labels=ids)["loss"]
        model.backward(loss)
        return loss

    dp, rank = smp.dp_size(), smp.dp_rank()
    ids, mask = _data(dp)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        out = train_step(model, ids[step, mine], mask[step, mine])
        if grads is None:
            grads = _gradients(model)
        opt.step()
        losses.append(global_loss(out, dp))
    result = {
        "losses": losses,
        "dp": dp,
        "grads": grads,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "type": type(model.get_module()).__name__,
        "layers": sorted(
            {
                n.split(".seq_layers.")[1].split(".")[0]
                for n, _ in model.local_named_parameters()
                if ".seq_layers." in n
            },
            key=int,
        ),
    }
    smp.reset()
    return result


@pytest.mark.parametrize(("n", "pp"), [(2, 1), (4, 2)], ids=["tp2", "tp2xpp2"])
def test_whole_gptneox_trains_like_hugging_face(worlds: Any, n: int, pp: int) -> None:
    results = worlds.run(n, _train, pp, timeout=400)
    want = _reference(results[0]["dp"])
    stages: set[str] = set()
    for r, res in enumerate(results):
        assert res["type"] == "GPTNeoXDistributedLMHead", res["type"]
        assert_losses(res["losses"], want["losses"], r)
        _close(res["grads"], want["grads"], f"rank {r} first-step gradients")
        _close(res["state"], want["state"], f"rank {r} state_dict after {STEPS} AdamW steps")
        if pp > 1:  # the pipeline splits seq_layers: each stage holds some of the layers
            assert 0 < len(res["layers"]) < LAYERS, res["layers"]
        stages.update(res["layers"])
    assert stages == {str(i) for i in range(LAYERS)}
