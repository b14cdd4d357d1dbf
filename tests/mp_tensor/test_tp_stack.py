"""smp's whole-stack replacement (mp_tensor.hf.stack): a Hugging Face ``GPT2LMHeadModel`` built inside
``tensor_parallelism()`` becomes ``GPT2DistributedLMHead`` (a DistributedTransformerLMHead with
``transformer.seq_layers``), called as Hugging Face's model, equal to it in outputs, loss, gradients and
state dict at tp=2 in both distributions (each rank its own samples, or the same ones with
``prescaled_batch``); ``whole_stack=False`` and untied heads keep the block-by-block replacement; the
calls it cannot serve are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mp_tensor.context import TPContext
from mp_tensor.enable import tensor_parallelism
from mp_tensor.errors import TPInputError
from mp_tensor.grads import reduce_gradients
from mp_tensor.replace import replace_modules
from mp_tensor.state_dict import gather_state_dict, load_original_state_dict
from tests.mp_tensor._tp_util import with_group

transformers = pytest.importorskip("transformers")

B, S, V = 2, 8, 40  # local batch, sequence, vocabulary


def _model(**overrides: Any) -> Any:
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=3, n_head=4, n_positions=S, vocab_size=V, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False, **overrides,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _case(world: Any, optimize: str, prescaled: bool) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)  # type: ignore[arg-type]
        torch.manual_seed(0)
        ref = _model()
        torch.manual_seed(0)
        with tensor_parallelism():
            tp = replace_modules(_model(), ctx)
        gen = torch.Generator().manual_seed(5)
        ids = torch.randint(1, V, (B * n, S), generator=gen)
        mask = torch.ones(B * n, S, dtype=torch.long)
        mask[1, -3:] = 0  # padding on one sample
        mine = slice(0, B * n) if prescaled else slice(rank * B, (rank + 1) * B)
        w = torch.randn(B * n, S, V, generator=gen)
        ref_out = ref(input_ids=ids[mine], attention_mask=mask[mine], labels=ids[mine])
        full = ref(input_ids=ids, attention_mask=mask).logits
        (full * w).sum().backward()
        out = tp(input_ids=ids[mine], attention_mask=mask[mine], labels=ids[mine])
        # with prescaled_batch and labels each rank gets the logits of its share of the shared samples
        own = slice(rank * B, (rank + 1) * B) if prescaled else slice(None)
        (out.logits * w[mine][own]).sum().backward()
        res: dict[str, Any] = {
            "type": type(tp).__name__,
            "layers": [type(m).__name__ for m in tp.transformer.seq_layers],
            "logits": (out.logits - ref_out.logits[own]).abs().max().item(),
            "rows": out.logits.shape[0],
            "loss": abs(out["loss"].item() - ref_out.loss.item()),
            "tuple": len(tp(ids[mine], attention_mask=mask[mine], return_dict=False)),
        }
        # gradients: summed over the ranks' samples (none to sum with prescaled_batch), gathered, translated
        if not prescaled:
            reduce_gradients(tp.parameters(), dp_group=group, rdp_group=None, tp_size=n, average=False)
        weights = gather_state_dict(tp)
        ref_sd = ref.state_dict()
        res["keys"] = sorted(weights) == sorted(ref_sd)
        res["weights"] = max((weights[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
        with torch.no_grad():
            for p in tp.parameters():
                p.copy_(p.grad)
        grads = gather_state_dict(tp)
        res["grads"] = {k: (grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()}
        load_original_state_dict(tp, ref_sd)  # back from Hugging Face's names
        again = tp(input_ids=ids[mine], attention_mask=mask[mine]).logits
        res["reloaded"] = (again - ref_out.logits).abs().max().item()
        return res

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("optimize", "prescaled"), [("speed", False), ("memory", False), ("speed", True)])
def test_whole_gpt2_equals_hugging_face(worlds: Any, optimize: str, prescaled: bool) -> None:
    for rank, res in enumerate(worlds.run(2, _case, optimize, prescaled, timeout=180)):
        assert res["type"] == "GPT2DistributedLMHead", res
        assert res["layers"] == ["DistributedTransformerLayer"] * 3, res
        assert res["logits"] < 3e-5 and res["loss"] < 1e-5 and res["tuple"] == 1, (rank, res)
        assert res["rows"] == B, (rank, res)  # its own samples, also with prescaled_batch
        assert res["keys"] and res["weights"] == 0.0, (rank, res)
        bad = {k: v for k, v in res["grads"].items() if not v < 3e-5}
        assert not bad, (rank, bad)
        assert res["reloaded"] < 3e-5, (rank, res)


def _prescaled_loss(world: Any, batch: int) -> dict[str, Any]:
    """The loss's own gradients with prescaled_batch: labels with ignored tokens spread unevenly over the
    ranks' shares (the mean is over the whole batch's labelled tokens, not each share's)."""

    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n = dist.get_world_size(group)
        ctx = TPContext(group=group, optimize="speed", prescaled_batch=True)
        torch.manual_seed(0)
        ref = _model()
        torch.manual_seed(0)
        with tensor_parallelism():
            tp = replace_modules(_model(), ctx)
        ids = torch.randint(1, V, (batch, S), generator=torch.Generator().manual_seed(7))
        labels = ids.clone()
        labels[0, 2:] = -100  # most of the first rank's share ignored
        want = ref(input_ids=ids, labels=labels)
        want.loss.backward()
        out = tp(input_ids=ids, labels=labels)
        out.loss.backward()
        with torch.no_grad():
            for p in tp.parameters():
                p.copy_(p.grad)
        grads = gather_state_dict(tp)
        return {
            "rows": out.logits.shape[0],
            "share": batch // n if batch % n == 0 else batch,
            "loss": abs(out.loss.item() - want.loss.item()),
            "grads": {k: (grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()},
        }

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("batch", [4, 3], ids=["own-share", "indivisible-batch"])
def test_prescaled_loss_over_own_share(worlds: Any, batch: int) -> None:
    """With prescaled_batch each TP rank computes the cross entropy of its 1/T of the shared samples only
    (its logits have batch/T rows), and the loss and its gradients still equal Hugging Face's over the
    whole batch; a batch the TP degree does not divide falls back to every rank holding all logits."""
    for rank, res in enumerate(worlds.run(2, _prescaled_loss, batch, timeout=180)):
        assert res["rows"] == res["share"], (rank, res)
        assert res["loss"] < 1e-6, (rank, res)
        bad = {k: v for k, v in res["grads"].items() if not v < 3e-6}
        assert not bad, (rank, bad)


def _opt_outs(world: Any) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group)
        kept: dict[str, Any] = {}
        with tensor_parallelism(whole_stack=False):
            kept["whole_stack=False"] = replace_modules(_model(), ctx)
        with tensor_parallelism():
            kept["untied"] = replace_modules(_model(tie_word_embeddings=False), ctx)
        out = {name: (type(m).__name__, type(m.transformer.h[0]).__name__) for name, m in kept.items()}
        with tensor_parallelism():
            tp = replace_modules(_model(), ctx)
        ids = torch.randint(1, V, (B, S))
        refused = {}
        for name, kwargs in {
            "token_type_ids": {"token_type_ids": torch.zeros_like(ids)},
            "inputs_embeds": {"input_ids": None, "inputs_embeds": torch.zeros(B, S, 16)},
            "output_attentions": {"output_attentions": True},
            "unknown": {"head_masks": None},
            "logits_to_keep": {"logits_to_keep": 1},
        }.items():
            call = {"input_ids": ids, **kwargs}
            try:
                tp(**call)
                refused[name] = "accepted"
            except TPInputError as exc:
                refused[name] = str(exc)
        out["refused"] = refused
        return out

    return with_group(run)  # type: ignore[no-any-return]


def test_opt_outs_and_refusals(worlds: Any) -> None:
    for res in worlds.run(2, _opt_outs, timeout=180):
        assert res["whole_stack=False"] == ("GPT2LMHeadModel", "DistributedTransformerLayer"), res
        assert res["untied"] == ("GPT2LMHeadModel", "DistributedTransformerLayer"), res
        refused = res["refused"]
        assert "token_type_ids" in refused["token_type_ids"], refused
        assert "inputs_embeds given: True" in refused["inputs_embeds"], refused
        assert "output_attentions=True" in refused["output_attentions"], refused
        assert "head_masks" in refused["unknown"], refused
        assert "logits_to_keep=1" in refused["logits_to_keep"], refused


@pytest.mark.parametrize("arch", ["gpt2", "bert", "roberta"])
def test_whole_stack_at_tp1(arch: str) -> None:
    """At tp=1 only the whole-stack entries apply (what smp.DistributedModel does): GPT-2 becomes the
    LM head, a BERT/RoBERTa encoder a DistributedTransformer; outputs and state dicts are Hugging Face's."""
    from mp_tensor.hf.stack import whole_stack_registry
    from mp_tensor.registry import default_registry

    torch.manual_seed(0)
    with tensor_parallelism():
        if arch == "gpt2":
            model = _model()
        else:
            cfg = transformers.BertConfig(
                hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                vocab_size=V, max_position_embeddings=S + 2, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )  # fmt: skip
            cls = transformers.RobertaForMaskedLM if arch == "roberta" else transformers.BertForMaskedLM
            model = cls(cfg)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(2, V, (3, S))
    mask = torch.ones(3, S, dtype=torch.long)
    mask[0, -3:] = 0
    want = model(input_ids=ids, attention_mask=mask).logits
    new = replace_modules(model, TPContext(group=None), registry=whole_stack_registry(default_registry))
    got = new(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stack = new.transformer if arch == "gpt2" else getattr(new, arch).encoder
    assert len(stack.seq_layers) == (3 if arch == "gpt2" else 2)
    assert type(stack.seq_layers[0]).__name__ == "DistributedTransformerLayer"
    state = gather_state_dict(new)
    assert sorted(state) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(state[key], value), key
