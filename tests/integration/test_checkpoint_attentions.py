"""smp's ``checkpoint_attentions`` config key: the attention of every distributed transformer layer is
recomputed in backward, and training is unchanged."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import mp as smp
from mp_tensor.nn.attention import DistributedAttentionLayer


def _train(world: Any, checkpoint_attentions: bool) -> dict[str, Any]:
    smp.init({"checkpoint_attentions": checkpoint_attentions})
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0)
    config.embd_pdrop = config.attn_pdrop = 0.0
    with smp.tensor_parallelism():  # the whole GPT-2 becomes smp's DistributedTransformerLMHead
        net = GPT2LMHeadModel(config)
    calls = [0]
    original = DistributedAttentionLayer.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    DistributedAttentionLayer.forward = counted  # type: ignore[method-assign]
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    layers = list(model.module.transformer.seq_layers)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        losses.append(train_step(torch.randint(0, 64, (4, 16), generator=g)).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    smp.reset()
    DistributedAttentionLayer.forward = original  # type: ignore[method-assign]
    return {"losses": losses, "attention_calls": calls[0], "layers": len(layers)}


def test_checkpoint_attentions_recomputes_each_attention_and_trains_alike(worlds: Any) -> None:
    plain = worlds.run(1, _train, False, timeout=120)[0]
    ckpt = worlds.run(1, _train, True, timeout=120)[0]
    assert plain["attention_calls"] == plain["layers"] * 2  # once per layer per step
    assert ckpt["attention_calls"] == ckpt["layers"] * 2 * 2  # and again in each backward
    assert ckpt["losses"] == plain["losses"]
