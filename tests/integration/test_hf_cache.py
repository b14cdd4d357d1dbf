"""HF's key/value cache is off in pipelined training steps (mp/hf_cache.py): no block called on another
rank gets a cache object, training equals plain PyTorch with the user's config, the config is the
user's again after the step and in evaluation steps, and the model's modules are walked once to find its
configs, not at every step."""

from __future__ import annotations

from typing import Any

import torch
import transformers

import mp as smp


def _config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=16,
        tie_word_embeddings=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def train_gpt2(world: Any) -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(_config())
    reference = transformers.GPT2LMHeadModel(_config())
    reference.load_state_dict(net.state_dict())
    caches: list[str] = []
    for block in net.transformer.h:  # hooks run on the rank that calls the block: pp_rank 0
        block.register_forward_pre_hook(
            lambda _m, args, kwargs: caches.append(type(kwargs.get("past_key_values", args[1])).__name__),
            with_kwargs=True,
        )
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    inside: list[bool] = []

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        inside.append(bool(net.config.use_cache))
        loss = model(input_ids=x, labels=x).loss
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        inside.append(bool(net.config.use_cache))
        return model(input_ids=x, labels=x).loss

    g = torch.Generator().manual_seed(3)
    gaps = []
    for _ in range(3):
        x = torch.randint(0, 64, (4, 16), generator=g)
        losses = train_step(model, x)
        opt.step()
        opt.zero_grad()
        expected = sum(reference(input_ids=xm, labels=xm).loss for xm in x.chunk(2)) / 2
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gaps.append(abs(float(losses.reduce_mean()) - float(expected)))
    after_training = bool(net.config.use_cache)
    training = {"inside": sorted(set(inside)), "caches": sorted(set(caches)), "calls": len(caches)}
    inside.clear()
    model.eval()
    eval_step(model, x)
    return {
        **training,
        "eval_inside": sorted(set(inside)),
        "gaps": gaps,
        "after": after_training,
        "walks": model.kv_cache.walks,  # the model's modules walked to find its configs
    }


def test_pipelined_training_steps_build_no_kv_cache(worlds: Any) -> None:
    results = worlds.run(2, train_gpt2, timeout=240)
    top = results[0]
    assert top["inside"] == [False] and top["eval_inside"] == [True], top
    assert top["after"] is True, top
    assert top["calls"] >= 3 * 2 * 4 and top["caches"] == ["NoneType"], top  # every block, no cache
    assert max(top["gaps"]) < 1e-5, top["gaps"]
    assert [r["walks"] for r in results] == [1, 1], results  # once in 3 training steps, not per step
