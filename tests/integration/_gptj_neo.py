"""The Hugging Face GPT-J and GPT-Neo whole-stack TP runs (tests/integration/test_train_gptj_neo.py), shared
with tests/mp_tensor/test_tp_stack_neox_train.py: sizes, data, optimizer, reference and the rank-side run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mp as smp
from tests.integration._tp_model import global_loss

transformers = pytest.importorskip("transformers")

STEPS, PER_RANK, SEQ, VOCAB, LAYERS = 3, 2, 12, 64, 4


def _model(family: str) -> Any:
    common = {"vocab_size": VOCAB, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    if family == "gptj":
        cfg = transformers.GPTJConfig(
            n_embd=32, n_layer=LAYERS, n_head=4, rotary_dim=4, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
        return transformers.GPTJForCausalLM(cfg)
    cfg = transformers.GPTNeoConfig(
        hidden_size=32, num_layers=LAYERS, num_heads=4, attention_types=[[["global", "local"], LAYERS // 2]],
        window_size=4, max_position_embeddings=SEQ, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0, **common,
    )  # fmt: skip
    return transformers.GPTNeoForCausalLM(cfg)


def _data(dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (STEPS, dp_size * PER_RANK, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[:, 0, -2:] = 0  # right padding on one sample of each batch
    return ids, mask


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # Adam moves a weight whose gradient is ~0 by about lr whatever the gradient's size, so fp32 summation
    # noise (1e-9 on such a gradient) becomes a 1e-2 * lr difference; eps=1e-6 damps updates of gradients
    # below 1e-6 as for any optimizer, and the gradients themselves are compared at 1e-5 above.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def _reference(dp_size: int, family: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model(family)
    opt = _optimizer(model.parameters())
    ids, mask = _data(dp_size)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids[step], attention_mask=mask[step], labels=ids[step]).loss
        loss.backward()
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            if family == "gptneo":  # tied: the state dict names the embedding twice
                grads["lm_head.weight"] = grads["transformer.wte.weight"]
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "state": model.state_dict()}


def _gradients(model: Any, family: str) -> dict[str, torch.Tensor]:
    """This step's gradients in Hugging Face's names: TP shards gathered, pipeline stages joined."""
    from mp_tensor.hf.translate_gpt import gptj_from_smp, gptneo_from_smp
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
        parts: list[Any] = [None] * smp.pp_size()
        torch.distributed.all_gather_object(parts, grads, group=smp.get_pp_process_group())
        grads = {k: v for part in parts for k, v in part.items()}
    return gptj_from_smp(grads) if family == "gptj" else gptneo_from_smp(grads)


def _train(world: Any, pp: int, family: str) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = _model(family)
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
            grads = _gradients(model, family)
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


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for key, value in want.items():
        torch.testing.assert_close(
            got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{what}, {key}: {m}"
        )
