"""``smp.nn.huggingface.<family>``: HF state dicts <-> mp's distributed-module layout, checked by running.

The translated state dict loads (strict) into the distributed module built from the HF config, which
then computes what the HF model computes; both directions round-trip exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from mp_tensor import nn as tnn
from mp_tensor.context import TPContext
from mp_tensor.errors import HFTranslationError
from mp_tensor.hf import bert as hf_bert

transformers = pytest.importorskip("transformers")

from mp.nn.huggingface import bert, gpt2, gptj, gptneo, roberta  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k, value in a.items():
        assert torch.equal(value, b[k]), k


def _gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=4, vocab_size=40, n_positions=12, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_translates_into_a_working_lm_head_and_back() -> None:
    hf = _gpt2()
    sd = hf.state_dict()
    smp_sd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(sd)
    assert "transformer.seq_layers.1.attention.query.weight" in smp_sd
    lm = tnn.DistributedTransformerLMHead(**gpt2.gpt2_lm_head_kwargs(hf.config), tp=TPContext()).eval()
    lm.load_full_state_dict(smp_sd)  # strict: the layout is exactly the module's
    ids = torch.randint(0, 40, (3, 10))
    loss, logits = lm((ids, None, None, None, ids))
    want = hf(input_ids=ids, labels=ids)
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=1e-6)
    # exact round trips both ways
    _same(gpt2.translate_state_dict_to_hf_gpt2(smp_sd), dict(sd))
    _same(
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2(gpt2.translate_state_dict_to_hf_gpt2(smp_sd)),
        smp_sd,
    )
    # a module's own state dict loads into a fresh HF model (strict) and computes the same
    fresh = transformers.GPT2LMHeadModel(hf.config).eval()
    fresh.load_state_dict(gpt2.translate_state_dict_to_hf_gpt2(lm.full_state_dict()))
    torch.testing.assert_close(fresh(input_ids=ids).logits, logits, rtol=0, atol=1e-5)


def test_gpt2_bare_model_buffers_and_bad_input() -> None:
    hf = _gpt2()
    bare = {k[len("transformer.") :]: v for k, v in hf.state_dict().items() if k.startswith("transformer.")}
    smp_sd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(bare)
    _same(smp_sd, gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict()))
    old = gpt2.translate_state_dict_to_hf_gpt2(smp_sd, max_seq_len=12)
    assert old["transformer.h.1.attn.bias"].shape == (1, 1, 12, 12)
    assert old["transformer.h.1.attn.bias"].tril().equal(old["transformer.h.1.attn.bias"])
    _same(gpt2.translate_hf_state_dict_to_smdistributed_gpt2(old), smp_sd)  # old buffers are dropped
    untied = dict(hf.state_dict())
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    with pytest.raises(HFTranslationError, match="tied"):
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2(untied)
    with pytest.raises(HFTranslationError, match="stray"):
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2({**hf.state_dict(), "stray": torch.zeros(1)})
    with pytest.raises(HFTranslationError, match="no place"):
        gpt2.translate_state_dict_to_hf_gpt2({**smp_sd, "token_type_embedding.weight": torch.zeros(2, 16)})


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_encoder_translates_into_a_working_distributed_transformer(family: str) -> None:
    torch.manual_seed(1)
    kw = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "intermediate_size": 32}
    if family == "bert":
        hf = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=40, **kw)).eval()
        encoder, to_smp, to_hf = (
            hf.bert.encoder,
            bert.translate_hf_state_dict_to_smdistributed_bert,
            bert.translate_state_dict_to_hf_bert,
        )
    else:
        hf = transformers.RobertaModel(transformers.RobertaConfig(vocab_size=40, **kw)).eval()
        encoder, to_smp, to_hf = (
            hf.encoder,
            roberta.translate_hf_state_dict_to_smdistributed_roberta,
            roberta.translate_state_dict_to_hf_roberta,
        )
    sd = hf.state_dict()
    smp_sd = to_smp(sd)
    prefix = "bert.encoder." if family == "bert" else "encoder."
    part = {k[len(prefix) :]: v for k, v in smp_sd.items() if k.startswith(prefix)}
    assert all(k.startswith("seq_layers.") for k in part)
    assert {k: v for k, v in smp_sd.items() if not k.startswith(prefix)}.keys() == {
        k for k in sd if not k.startswith(prefix)
    }
    dt = tnn.DistributedTransformer(num_layers=2, **hf_bert.layer_kwargs(hf.config), tp=TPContext()).eval()
    dt.load_full_state_dict(part)
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 6)
    keep[1, 4:] = 0
    additive = (1.0 - keep)[:, None, None, :] * torch.finfo(torch.float32).min
    got = dt((x, additive))[0]
    want = encoder(x, attention_mask=additive).last_hidden_state
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, :4], want[1, :4], rtol=0, atol=1e-5)
    _same(to_hf(smp_sd), dict(sd))
    _same(to_smp(to_hf(smp_sd)), smp_sd)
    assert to_hf(smp_sd, max_seq_len=8)[prefix.replace("encoder.", "") + "embeddings.position_ids"].shape == (
        1,
        8,
    )


def test_gpt_j_and_neo_translations_refuse_a_foreign_state_dict() -> None:
    for fn, family in (
        (gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj, "gptj"),
        (gptj.translate_state_dict_to_hf_gptj, "gptj"),
        (gptneo.translate_hf_state_dict_to_smdistributed_gptneo, "gptneo"),
        (gptneo.translate_state_dict_to_hf_gptneo, "gptneo"),
    ):
        with pytest.raises(HFTranslationError, match=family):
            fn({})


def test_importable_through_the_smdistributed_alias() -> None:
    code = """
        import smdistributed.modelparallel.torch as smp
        from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
        from smdistributed.modelparallel.torch.nn.huggingface.gptj import (
            translate_hf_gptj_state_dict_to_smdistributed_gptj,
        )
        import smdistributed.modelparallel.torch.nn.huggingface.bert as b
        import mp.nn.huggingface.gpt2
        assert translate_state_dict_to_hf_gpt2 is mp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2
        assert smp.nn.huggingface.roberta.translate_state_dict_to_hf_roberta
        assert b.translate_hf_state_dict_to_smdistributed_bert
    """
    env = {k: v for k, v in os.environ.items() if k not in ("MP_SMDISTRIBUTED_ALIAS", "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
