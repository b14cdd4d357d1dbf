"""Hugging Face T5 (encoder and decoder blocks, relative position bias, DenseReluDense and the gated
T5 v1.1 feed-forward) and ViT built inside ``tensor_parallelism()`` at tp=2: whole blocks become
``DistributedT5Block`` / ``DistributedViTLayer``; logits, loss, gradients, the full state dict after
SGD steps equal the single-process model in both layouts; dropout masks agree where they must."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_tensor.context import TPContext
from mp_tensor.enable import tensor_parallelism
from mp_tensor.grads import reduce_gradients
from mp_tensor.replace import replace_modules
from mp_tensor.state_dict import gather_state_dict, load_original_state_dict
from tests.mp_tensor._tp_util import with_group

transformers = pytest.importorskip("transformers")

B, S, V, CLASSES = 2, 6, 40, 5
TOL = 3e-5


def t5_model(layers: int = 2, **extra: Any) -> nn.Module:
    tf = transformers
    defaults = {"d_kv": 8, "num_heads": 4, "dropout_rate": 0.0, "use_cache": False}
    cfg = tf.T5Config(
        vocab_size=V, d_model=32, d_ff=64, num_layers=layers, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        tie_word_embeddings=False, **{**defaults, **extra},
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return tf.T5ForConditionalGeneration(cfg)  # type: ignore[no-any-return]


def vit_model(layers: int = 2, **extra: Any) -> nn.Module:
    tf = transformers
    cfg = tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_labels=CLASSES,
        **{"intermediate_size": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **extra},
    )  # fmt: skip
    return tf.ViTForImageClassification(cfg)  # type: ignore[no-any-return]


def batch(family: str, total: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    if family == "vit":
        return {
            "pixel_values": torch.randn(total, 3, 8, 8, generator=gen),
            "labels": torch.randint(0, CLASSES, (total,), generator=gen),
        }
    ids = torch.randint(2, V, (total, S), generator=gen)
    mask = torch.ones(total, S, dtype=torch.long)
    mask[1, -2:] = 0  # right padding on one sample's encoder input
    labels = torch.randint(2, V, (total, S - 1), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def summed_loss(family: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy: the data-parallel sum of the ranks' losses is the single-process loss."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


def _case(world: Any, family: str, optimize: str, prescaled: bool, extra: dict[str, Any]) -> dict[str, Any]:
    build = t5_model if family == "t5" else vit_model

    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)  # type: ignore[arg-type]
        torch.manual_seed(0)
        ref = build(**extra)
        torch.manual_seed(0)
        with tensor_parallelism():
            tp_model = build(**extra)
        tp_model = replace_modules(tp_model, ctx)
        total = B if prescaled else B * n
        data = batch(family, total)
        local = slice(0, total) if prescaled else slice(rank * B, (rank + 1) * B)
        mine = {k: v[local] for k, v in data.items()}
        out: dict[str, Any] = {
            "replaced": sorted(
                {type(m).__name__ for m in tp_model.modules() if "mp_tensor" in type(m).__module__}
            )
        }
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
        opt_tp = torch.optim.SGD(tp_model.parameters(), lr=0.01)
        for step in range(2):
            ref_logits = ref(**data).logits
            tp_logits = tp_model(**mine).logits
            out[f"logits{step}"] = (tp_logits - ref_logits[local]).abs().max().item()
            ref_loss = summed_loss(family, ref_logits, data["labels"])
            tp_loss = summed_loss(family, tp_logits, mine["labels"])
            summed = tp_loss.detach().clone()
            if not prescaled:
                dist.all_reduce(summed, group=group)
            out[f"loss{step}"] = abs(summed.item() - ref_loss.item()) / ref_loss.item()
            opt_ref.zero_grad()
            opt_tp.zero_grad()
            ref_loss.backward()
            tp_loss.backward()
            if not prescaled:
                reduce_gradients(
                    tp_model.parameters(), dp_group=group, rdp_group=None, tp_size=n, average=False
                )
            if step == 0:
                with torch.no_grad():
                    saved = {id(p): p.detach().clone() for p in tp_model.parameters()}
                    for p in tp_model.parameters():
                        p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                    grads = gather_state_dict(tp_model)
                    for p in tp_model.parameters():
                        p.copy_(saved[id(p)])
                ref_grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
                out["grads"] = {k: (grads[k] - g).abs().max().item() for k, g in ref_grads.items()}
            opt_ref.step()
            opt_tp.step()
        weights = gather_state_dict(tp_model)
        ref_sd = ref.state_dict()
        out["keys_equal"] = sorted(weights) == sorted(ref_sd)
        # relative to each tensor's scale (at least 1)
        out["weights"] = {
            k: ((weights[k] - ref_sd[k]).abs().max() / ref_sd[k].abs().max().clamp_min(1.0)).item()
            for k in ref_sd
        }
        load_original_state_dict(tp_model, ref_sd)
        again = tp_model(**mine).logits
        out["reloaded"] = (again - ref(**data).logits[local]).abs().max().item()
        return out

    return with_group(run)  # type: ignore[no-any-return]


CASES = [
    ("t5", "speed", False, {}),
    ("t5", "speed", True, {"feed_forward_proj": "gated-gelu"}),
    ("t5", "memory", False, {"feed_forward_proj": "gated-gelu"}),
    ("t5", "memory", True, {}),
    ("vit", "speed", False, {}),
    ("vit", "memory", True, {"qkv_bias": False}),
    ("vit", "memory", False, {"hidden_act": "gelu_new"}),
]


@pytest.mark.parametrize(
    ("family", "optimize", "prescaled", "extra"),
    CASES,
    ids=[f"{f}-{o}{'-prescaled' if p else ''}{'-' + '-'.join(e) if e else ''}" for f, o, p, e in CASES],
)
def test_blocks_train_like_the_plain_model(
    worlds: Any, family: str, optimize: str, prescaled: bool, extra: dict[str, Any]
) -> None:
    results = worlds.run(2, _case, family, optimize, prescaled, extra, timeout=240)
    want = "DistributedT5Block" if family == "t5" else "DistributedViTLayer"
    for rank, res in enumerate(results):
        assert want in res["replaced"], res["replaced"]
        for step in (0, 1):
            assert res[f"logits{step}"] < TOL, (rank, step, res[f"logits{step}"])
            assert res[f"loss{step}"] < 1e-5, (rank, step, res[f"loss{step}"])
        bad = {k: v for k, v in res["grads"].items() if not v < TOL}
        assert not bad, (rank, bad)
        assert res["keys_equal"], rank
        bad = {k: v for k, v in res["weights"].items() if not v < 1e-5}
        assert not bad, (rank, bad)
        assert res["reloaded"] < TOL, (rank, res["reloaded"])


def _dropout(world: Any, family: str) -> dict[str, Any]:
    build = t5_model if family == "t5" else vit_model
    extra = (
        {"dropout_rate": 0.3}
        if family == "t5"
        else {"hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.3}
    )

    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group, optimize="speed", prescaled_batch=True)
        torch.manual_seed(0)
        ref = build(**extra)
        torch.manual_seed(0)
        with tensor_parallelism():
            tp_model = build(**extra)
        tp_model = replace_modules(tp_model, ctx)
        for m in tp_model.modules():  # HF's dropouts outside the blocks (embeddings) draw from the
            if isinstance(m, nn.Dropout):  # global RNG, which this test sets apart per rank
                m.p = 0.0
        data = batch(family, B)
        ref.eval()
        tp_model.eval()
        out = {"eval": (tp_model(**data).logits - ref(**data).logits).abs().max().item()}
        tp_model.train()
        torch.manual_seed(1 + dist.get_rank(group))  # the global RNG differs: TP masks must not use it
        train = tp_model(**data).logits.detach()
        peer = train.clone()
        dist.broadcast(peer, src=dist.get_global_rank(group, 0), group=group)
        out["ranks_differ"] = (train - peer).abs().max().item()
        out["train_vs_eval"] = (train - ref(**data).logits).abs().max().item()
        return out

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["t5", "vit"])
def test_dropout_masks_agree_over_replicated_activations(worlds: Any, family: str) -> None:
    # speed mode with a shared batch: every rank holds the same activations, so the dropout masks on
    # them must be the same on every rank (heads and MLP channels, held apart, draw their own)
    for rank, res in enumerate(worlds.run(2, _dropout, family, timeout=240)):
        assert res["eval"] < TOL, (rank, res)
        assert res["ranks_differ"] == 0.0, (rank, res)
        assert res["train_vs_eval"] > 1e-3, (rank, res)  # dropout did act


def test_t5_trains_with_the_default_cache_and_refuses_cached_generation() -> None:
    # T5's config defaults to use_cache=True, so Hugging Face hands the decoder a cache even in
    # training: the blocks leave it empty, and generate() with that cache is refused by name
    from mp_tensor.errors import TPInputError

    torch.manual_seed(0)
    ref = t5_model(use_cache=True)
    torch.manual_seed(0)
    with tensor_parallelism():
        model = t5_model(use_cache=True)
    model = replace_modules(model, TPContext(optimize="speed"))
    assert any(type(m).__name__ == "DistributedT5Block" for m in model.modules())
    data = batch("t5", 2)
    assert (model(**data).logits - ref(**data).logits).abs().max().item() < TOL
    ids = data["input_ids"]
    with pytest.raises(TPInputError, match="use_cache=False"):
        model.generate(ids, max_new_tokens=3)
    want = ref.generate(ids, max_new_tokens=3, use_cache=False)
    assert torch.equal(model.generate(ids, max_new_tokens=3, use_cache=False), want)


def _refused(world: Any) -> list[str]:
    import logging

    def run(group: dist.ProcessGroup) -> list[str]:
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("mp_tensor")
        logger.addHandler(handler)
        old = logger.level
        logger.setLevel(logging.INFO)  # setLevel, not .level: it clears the loggers' cached levels
        try:
            for family, extra in (("t5", {"feed_forward_proj": "tanh"}), ("t5", {"num_heads": 3, "d_kv": 8})):
                with tensor_parallelism():
                    model = t5_model(**extra)
                model = replace_modules(model, TPContext(group=group, optimize="speed"))
                assert not any(type(m).__name__ == "DistributedT5Block" for m in model.modules()), family
            with tensor_parallelism():
                model = vit_model(intermediate_size=63)
            model = replace_modules(model, TPContext(group=group, optimize="speed"))
            assert not any(type(m).__name__ == "DistributedViTLayer" for m in model.modules())
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old)
        return [m for m in records if "not distributing" in m and ("T5Block" in m or "ViTLayer" in m)]

    return with_group(run)  # type: ignore[no-any-return]


def test_unmapped_activation_and_indivisible_sizes_are_refused_with_a_reason(worlds: Any) -> None:
    logs = worlds.run(2, _refused, timeout=240)[0]
    assert any("dense_act_fn='tanh'" in m for m in logs), logs
    assert any("num_heads=3" in m and "tensor-parallel degree 2" in m for m in logs), logs
    assert any("intermediate_size=63" in m for m in logs), logs
