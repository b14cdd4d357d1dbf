"""smp's whole-stack replacement for GPT-J, GPT-Neo and GPT-NeoX (mp_tensor.hf.stack_gpt): a Hugging
Face ``GPTJForCausalLM`` / ``GPTNeoForCausalLM`` / ``GPTNeoXForCausalLM`` built inside
``tensor_parallelism()`` becomes a DistributedTransformerLMHead (``transformer.seq_layers``) using the
rotary / local attention of smp.nn's transformer, called as Hugging Face's model and equal to it in
logits, loss, gradients and state dict (Hugging Face's names) at tp=1 and tp=2 in both distributions;
smp.nn.huggingface's translations round-trip; ``whole_stack=False`` keeps the block-by-block mapping; the
calls it cannot serve are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mp.nn.huggingface import gptj as smp_gptj
from mp.nn.huggingface import gptneo as smp_gptneo
from mp.nn.huggingface import gptneox as smp_gptneox
from mp_tensor.context import TPContext
from mp_tensor.enable import tensor_parallelism
from mp_tensor.errors import HFTranslationError, TPInputError
from mp_tensor.grads import reduce_gradients
from mp_tensor.replace import replace_modules
from mp_tensor.state_dict import gather_state_dict, load_original_state_dict
from tests.mp_tensor._tp_util import with_group

transformers = pytest.importorskip("transformers")

B, S, V = 2, 8, 40  # local batch, sequence, vocabulary
CLASSES = {
    "gptj": "GPTJDistributedLMHead",
    "gptneo": "GPTNeoDistributedLMHead",
    "gptneox": "GPTNeoXDistributedLMHead",
    "gptneox-seq": "GPTNeoXDistributedLMHead",
}


def _model(family: str, **overrides: Any) -> Any:
    common = {"vocab_size": V, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    if family == "gptj":
        cfg = transformers.GPTJConfig(
            n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=S, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **common, **overrides,
        )  # fmt: skip
        return transformers.GPTJForCausalLM(cfg)
    if family.startswith("gptneox"):  # half of each head rotary; -seq: the sequential residual
        cfg = transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            use_parallel_residual=family == "gptneox", **common, **overrides,
        )  # fmt: skip
        return transformers.GPTNeoXForCausalLM(cfg)
    cfg = transformers.GPTNeoConfig(
        hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=3,
        max_position_embeddings=S, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0, **common,
        **overrides,
    )  # fmt: skip
    return transformers.GPTNeoForCausalLM(cfg)


def _case(world: Any, family: str, optimize: str, prescaled: bool) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)  # type: ignore[arg-type]
        torch.manual_seed(0)
        ref = _model(family)
        torch.manual_seed(0)
        with tensor_parallelism():
            tp = replace_modules(_model(family), ctx)
        gen = torch.Generator().manual_seed(5)
        ids = torch.randint(1, V, (B * n, S), generator=gen)
        mask = torch.ones(B * n, S, dtype=torch.long)
        # padding on one sample; fewer pads than GPT-Neo's window, so that no query has every key masked
        # (such rows are degenerate: Hugging Face's and mp's masks give them different uniform weights)
        mask[1, -2:] = 0
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
        if not prescaled:  # gradients summed over the ranks' samples, gathered, translated
            reduce_gradients(tp.parameters(), dp_group=group, rdp_group=None, tp_size=n, average=False)
        weights = gather_state_dict(tp)
        ref_sd = ref.state_dict()
        res["keys"] = sorted(set(weights) ^ set(ref_sd))
        res["weights"] = max((weights[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
        with torch.no_grad():
            for p in tp.parameters():
                p.copy_(p.grad)
        grads = gather_state_dict(tp)
        # relative to the gradient's size where it exceeds 1 (sums over ~100 terms of size ~1 in fp32)
        res["grads"] = {
            k: ((grads[k] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1.0)).item()
            for k, p in ref.named_parameters()
        }
        load_original_state_dict(tp, ref_sd)  # back from Hugging Face's names
        again = tp(input_ids=ids[mine], attention_mask=mask[mine]).logits
        res["reloaded"] = (again - ref_out.logits).abs().max().item()
        return res

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["gptj", "gptneo", "gptneox", "gptneox-seq"])
@pytest.mark.parametrize(
    ("n", "optimize", "prescaled"),
    [(1, "speed", False), (2, "speed", False), (2, "memory", False), (2, "speed", True)],
    ids=["tp1", "tp2-speed", "tp2-memory", "tp2-prescaled"],
)
def test_whole_model_equals_hugging_face(
    worlds: Any, family: str, n: int, optimize: str, prescaled: bool
) -> None:
    for rank, res in enumerate(worlds.run(n, _case, family, optimize, prescaled, timeout=240)):
        assert res["type"] == CLASSES[family], res
        assert res["layers"] == ["DistributedTransformerLayer"] * 2, res
        assert res["logits"] < 1e-5 and res["loss"] < 1e-5 and res["tuple"] == 1, (rank, res)
        assert res["rows"] == B, (rank, res)  # its own samples, also with prescaled_batch
        assert not res["keys"] and res["weights"] == 0.0, (rank, res)
        bad = {k: v for k, v in res["grads"].items() if not v < 1e-5}
        assert not bad, (rank, bad)
        assert res["reloaded"] < 1e-5, (rank, res)


@pytest.mark.parametrize("family", ["gptj", "gptneo"])
def test_translations_round_trip(family: str) -> None:
    torch.manual_seed(0)
    hf = _model(family).state_dict()
    mod = smp_gptj if family == "gptj" else smp_gptneo
    to_smp = (
        smp_gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj
        if family == "gptj"
        else smp_gptneo.translate_hf_state_dict_to_smdistributed_gptneo
    )
    to_hf = getattr(mod, f"translate_state_dict_to_hf_{family}")
    smp_sd = to_smp(hf)
    assert "transformer.seq_layers.1.attention.query.weight" in smp_sd
    assert ("lm_head.bias" in smp_sd) == (family == "gptj")
    back = to_hf(smp_sd)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())
    old = to_hf(smp_sd, max_seq_len=S)  # with the buffers older transformers saved
    buffer = "transformer.h.0.attn.bias" if family == "gptj" else "transformer.h.0.attn.attention.bias"
    assert old[buffer].shape == (1, 1, S, S)
    assert sorted(to_smp(old)) == sorted(smp_sd)
    with pytest.raises(HFTranslationError, match="have no counterpart"):
        to_smp({**hf, "transformer.h.0.attn.extra.weight": torch.zeros(1)})


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied"])
def test_gptneox_translations_round_trip(tied: bool) -> None:
    torch.manual_seed(0)
    model = _model("gptneox", tie_word_embeddings=tied)
    hf = model.state_dict()
    smp_sd = smp_gptneox.translate_hf_state_dict_to_smdistributed_gptneox(hf, 4, tied)
    # query_key_value's rows are [head, (q|k|v), head_size]: head 1's query rows 24..31 are query's 8..15
    fused = hf["gpt_neox.layers.1.attention.query_key_value.weight"]
    assert torch.equal(smp_sd["transformer.seq_layers.1.attention.query.weight"][8:16], fused[24:32])
    assert torch.equal(smp_sd["transformer.seq_layers.1.attention.value.bias"][:8],
                       hf["gpt_neox.layers.1.attention.query_key_value.bias"][16:24])  # fmt: skip
    assert ("lm_head.weight" in smp_sd) == (not tied)
    back = smp_gptneox.translate_state_dict_to_hf_gptneox(smp_sd, 4)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())
    with pytest.raises(HFTranslationError, match="have no counterpart"):
        smp_gptneox.translate_hf_state_dict_to_smdistributed_gptneox(
            {**hf, "gpt_neox.layers.0.attention.extra.weight": torch.zeros(1)}, 4
        )


def _opt_outs(world: Any, family: str) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group)
        with tensor_parallelism(whole_stack=False):
            kept = replace_modules(_model(family), ctx)
        untie = {"tie_word_embeddings": family == "gptj"}
        with tensor_parallelism():
            other = replace_modules(_model(family, **untie), ctx)
        out: dict[str, Any] = {
            "whole_stack=False": (type(kept).__name__, type(kept.transformer.h[0]).__name__),
            "untied": (type(other).__name__, type(other.transformer.h[0]).__name__),
        }
        with tensor_parallelism():
            tp = replace_modules(_model(family), ctx)
        ids = torch.randint(1, V, (B, S))
        refused = {}
        for name, kwargs in {
            "token_type_ids": {"token_type_ids": torch.zeros_like(ids)},
            "inputs_embeds": {"input_ids": None, "inputs_embeds": torch.zeros(B, S, 32)},
            "output_attentions": {"output_attentions": True},
            "position_ids": {"position_ids": torch.arange(S).flip(0).expand(B, S)},
        }.items():
            try:
                tp(**{"input_ids": ids, **kwargs})
                refused[name] = "accepted"
            except TPInputError as exc:
                refused[name] = str(exc)
        out["refused"] = refused
        return out

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["gptj", "gptneo"])
def test_opt_outs_and_refusals(worlds: Any, family: str) -> None:
    block = "DistributedGPTJLayer" if family == "gptj" else "DistributedGPTNeoLayer"
    model = "GPTJForCausalLM" if family == "gptj" else "GPTNeoForCausalLM"
    for res in worlds.run(2, _opt_outs, family, timeout=180):
        assert res["whole_stack=False"] == (model, block), res
        assert res["untied"] == (model, block), res
        refused = res["refused"]
        assert "token_type_ids" in refused["token_type_ids"], refused
        assert "inputs_embeds given: True" in refused["inputs_embeds"], refused
        assert "output_attentions=True" in refused["output_attentions"], refused
        if family == "gptj":  # rotary positions are 0..S-1; GPT-Neo's learned positions take any ids
            assert "position_ids" in refused["position_ids"], refused
        else:
            assert refused["position_ids"] == "accepted", refused
