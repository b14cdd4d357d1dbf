"""smp's module options: FlashAttentionLayer, DistributedLinear's keyword names, fused_softmax /
fused_bias_gelu, and the transformer options mp refuses by name. Compared with plain torch math."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mp_tensor import nn as tnn
from mp_tensor import reference as ref
from mp_tensor.context import TPContext
from mp_tensor.errors import DistEmbeddingConfigError, DistTransformerConfigError, TPInputError
from tests.mp_tensor._tp_util import SMALL


def _plain_attention(
    qkv: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> torch.Tensor:
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, S, D]
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_flash_attention_matches_softmax_attention(causal: bool, with_mask: bool) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(2, 6, 3, 4, 8)
    mask = None
    if with_mask:
        mask = torch.zeros(2, 1, 1, 6)
        mask[1, ..., 4:] = -1e4
    layer = tnn.FlashAttentionLayer(attention_dropout_prob=0.0, attention_head_size=8).eval()
    got = layer(qkv, attn_mask=mask, causal=causal)
    assert got.shape == (2, 4, 6, 8)
    torch.testing.assert_close(got, _plain_attention(qkv, mask, causal, 1 / math.sqrt(8)), rtol=0, atol=1e-5)
    by_layer = tnn.FlashAttentionLayer(0.0, 8, scale_attn_by_layer_idx=True, layer_idx=2).eval()
    want = _plain_attention(qkv, mask, causal, 1 / (math.sqrt(8) * 3))
    torch.testing.assert_close(by_layer(qkv, mask, causal), want, rtol=0, atol=1e-5)
    fixed = tnn.FlashAttentionLayer(0.0, scale=0.5, scale_attn_by_layer_idx=True, layer_idx=2).eval()
    torch.testing.assert_close(
        fixed(qkv, mask, causal), _plain_attention(qkv, mask, causal, 0.5), rtol=0, atol=1e-5
    )
    unscaled = tnn.FlashAttentionLayer(0.0, scale_attention_scores=False).eval()
    torch.testing.assert_close(
        unscaled(qkv, mask, causal), _plain_attention(qkv, mask, causal, 1.0), rtol=0, atol=1e-5
    )


def test_flash_attention_dropout_and_errors() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(2, 16, 3, 2, 8)
    layer = tnn.FlashAttentionLayer(attention_dropout_prob=0.5, attention_head_size=8)
    torch.manual_seed(1)
    a = layer(qkv)
    torch.manual_seed(1)
    assert torch.equal(a, layer(qkv))  # dropout from torch's generator
    assert not torch.allclose(a, layer.eval()(qkv))  # and only in training
    bad: list[dict[str, Any]] = [
        {"triton_flash_attention": True, "attention_head_size": 8},
        {"use_alibi": True, "attention_head_size": 8},
        {},  # scaling by head size needs the head size
        {"attention_head_size": 8, "scale_attn_by_layer_idx": True},  # ... and by layer needs the index
    ]
    for kwargs in bad:
        with pytest.raises(DistTransformerConfigError):
            tnn.FlashAttentionLayer(**kwargs)
    with pytest.raises(TPInputError, match="head_size"):
        tnn.FlashAttentionLayer(attention_head_size=4)(qkv)


def test_linear_takes_smp_keyword_names() -> None:
    ctx = TPContext()
    torch.manual_seed(0)
    a = tnn.DistributedLinear(input_features=6, output_features=4, bias=False, tp=ctx)
    assert tuple(a.weight.shape) == (4, 6) and a.bias is None
    torch.manual_seed(0)
    b = tnn.DistributedLinear(in_features=6, out_features=4, bias=False, tp=ctx)
    assert torch.equal(a.weight, b.weight)
    x = torch.randn(3, 6)
    torch.testing.assert_close(a(x), F.linear(x, b.weight), rtol=0, atol=0)
    with pytest.raises(TypeError, match="in_features=6 and input_features=5"):
        tnn.DistributedLinear(6, 4, input_features=5, tp=ctx)
    with pytest.raises(TypeError, match="output_features"):
        tnn.DistributedLinear(input_features=6, tp=ctx)


def test_fused_softmax_both_ways_equal_reference() -> None:
    torch.manual_seed(0)
    r = ref.TransformerLayer(**SMALL, causal_mask_size=8)
    x, m = torch.randn(2, 5, 16), torch.zeros(2, 1, 1, 5)
    m[1, ..., 3:] = -1e4
    want = r((x, m))[0]
    for fused in (True, False):
        d = tnn.DistributedTransformerLayer(**SMALL, causal_mask_size=8, fused_softmax=fused, tp=TPContext())
        d.load_full_state_dict(r.state_dict())
        torch.testing.assert_close(d((x, m))[0], want, rtol=0, atol=1e-5)


def test_fused_bias_gelu_is_megatrons_tanh_gelu() -> None:
    torch.manual_seed(0)
    r = ref.TransformerOutputLayer(
        hidden_size=16, intermediate_size=32, hidden_dropout_prob=0.0, activation="gelu_new"
    )
    d = tnn.DistributedTransformerOutputLayer(
        hidden_size=16, intermediate_size=32, hidden_dropout_prob=0.0, fused_bias_gelu=True, tp=TPContext()
    )
    d.load_full_state_dict(r.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(d(x), r(x), rtol=0, atol=1e-6)
    with pytest.raises(DistTransformerConfigError, match="fused_bias_gelu=True with activation='relu'"):
        tnn.DistributedTransformerOutputLayer(activation="relu", fused_bias_gelu=True, tp=TPContext())


@pytest.mark.parametrize(
    "option",
    [
        {"scale_attn_by_layer_idx": True},
        {"distribute_embedding": True},
        {"rotary_dim": 3},  # built (tests/mp_tensor/test_tp_positions.py), but must be even
        {"window_size": 4},  # ... and needs causal_mask_size
    ],
)
def test_unbuilt_transformer_options_are_refused_by_name(option: dict[str, Any]) -> None:
    (name,) = option
    with pytest.raises(DistTransformerConfigError, match=name):
        tnn.DistributedTransformerLayer(**SMALL, **option, tp=TPContext())


def test_vocab_parallel_embedding_checks() -> None:
    ctx = TPContext()
    torch.manual_seed(0)
    e = tnn.DistributedEmbedding(10, 6, padding_idx=2, vocab_parallel=True, tp=ctx)
    ids = torch.tensor([[0, 2, 9]])
    torch.testing.assert_close(e(ids), F.embedding(ids, e.weight, 2), rtol=0, atol=0)
    with pytest.raises(DistEmbeddingConfigError, match="scale_grad_by_freq"):
        tnn.DistributedEmbedding(10, 6, scale_grad_by_freq=True, vocab_parallel=True, tp=ctx)
    with pytest.raises(DistEmbeddingConfigError, match="max_norm"):
        tnn.DistributedEmbedding(10, 6, max_norm=1.0, vocab_parallel=True, tp=ctx)


def test_tensor_parallelism_passes_vocab_parallel_to_embeddings() -> None:
    from torch import nn

    from mp_tensor.enable import tensor_parallelism
    from mp_tensor.replace import replace_modules

    torch.manual_seed(0)
    with tensor_parallelism(vocab_parallel=True):
        model = nn.Sequential(nn.Embedding(10, 6))
    want = model[0].weight.detach().clone()
    replaced = replace_modules(model, TPContext())
    emb = replaced[0]
    assert isinstance(emb, tnn.DistributedEmbedding) and emb.vocab_parallel
    assert torch.equal(emb.full_state_dict()["weight"], want)
