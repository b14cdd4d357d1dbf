"""Rotary embeddings, ALiBi and sliding-window attention in smp.nn's transformer modules.

First the position math (mp_tensor.nn.positions) against the Hugging Face models that define it: GPT-J's
interleaved and GPT-NeoX's half rotary, MPT's and Bloom's ALiBi, GPT-Neo's local attention layer. Then
the distributed modules against their single-process references (mp_tensor.reference) at tp=1 and
tp=2 in both distributions: outputs, input gradients and every parameter gradient within 1e-5 (fp32).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mp_tensor import reference as ref
from mp_tensor.errors import DistTransformerConfigError
from mp_tensor.nn import positions
from tests.mp_tensor._tp_util import SMALL, Case, run_cases, worst

transformers = pytest.importorskip("transformers")

TOL = 1e-5


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_interleaved_rotary_is_gptj(rotary_dim: int) -> None:
    from transformers.models.gptj import modeling_gptj as gptj

    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 8)  # [N, S, heads, d]
    table = gptj.create_sinusoidal_positions(7, rotary_dim)
    sin, cos = table[None].split(rotary_dim // 2, dim=-1)
    want = torch.cat((gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos), x[..., rotary_dim:]), -1)
    c, s = positions.rotary_tables(7, rotary_dim, None, neox=False)
    torch.testing.assert_close(positions.apply_rotary(x, c, s, neox=False), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("rotary_pct", "base"), [(1.0, 10000.0), (0.5, 500.0)])
def test_half_rotary_is_gpt_neox(rotary_pct: float, base: float) -> None:
    from transformers.models.gpt_neox import modeling_gpt_neox as neox

    cfg = transformers.GPTNeoXConfig(
        hidden_size=24,
        num_attention_heads=3,
        rotary_pct=rotary_pct,
        rope_theta=base,
        max_position_embeddings=16,
    )
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": rotary_pct}
    emb = neox.GPTNeoXRotaryEmbedding(cfg)
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)  # [N, heads, S, d]
    cos, sin = emb(q, torch.arange(7)[None])
    want_q, want_k = neox.apply_rotary_pos_emb(q, k, cos, sin)
    dim = int(8 * rotary_pct)
    c, s = positions.rotary_tables(7, dim, base, neox=True)
    got_q = positions.apply_rotary(q.transpose(1, 2), c, s, neox=True).transpose(1, 2)
    got_k = positions.apply_rotary(k.transpose(1, 2), c, s, neox=True).transpose(1, 2)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("heads", "bias_max"), [(8, 8.0), (6, 8.0), (12, 4.0)])
def test_alibi_is_mpt_and_bloom(heads: int, bias_max: float) -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    s = 9
    slopes = positions.alibi_slopes(heads, bias_max)
    ours = positions.alibi_bias(slopes, s, s, torch.float32)  # [heads, S, S]: slope * (j - i)
    mpt = build_mpt_alibi_tensor(heads, s, bias_max)  # [heads, 1, S]: slope * (j - (S-1))
    # softmax is invariant to a per-row constant: the last row is MPT's bias exactly
    torch.testing.assert_close(ours[:, -1:, :], mpt.float(), rtol=0, atol=1e-6)
    rows = ours - ours[:, :, :1]  # every row shifted to start at 0: slope * j, Bloom's
    bloom = build_alibi_tensor(torch.ones(1, s), heads, torch.float32).reshape(heads, 1, s)
    if bias_max == 8.0 and heads & (heads - 1) == 0:  # Bloom's slopes are MPT's for a power of two
        torch.testing.assert_close(rows, bloom.expand(heads, s, s), rtol=0, atol=1e-5)


def test_local_attention_is_gpt_neo() -> None:
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    cfg = transformers.GPTNeoConfig(
        hidden_size=16, num_heads=4, max_position_embeddings=12, window_size=3, attention_dropout=0.0,
        resid_dropout=0.0, attention_types=[[["local"], 1]], num_layers=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = GPTNeoSelfAttention(cfg, "local").eval()
    mine = ref.AttentionLayer(
        num_attention_heads=4, attention_head_size=4, hidden_size=16, attention_dropout_prob=0.0,
        hidden_dropout_prob=0.0, causal_mask_size=12, window_size=3, scale_attention_scores=False,
        use_qkv_bias=False, pre_layernorm=False, post_layernorm=False, single_pre_layernorm=True,
        mask_value=-1e9,
    ).eval()  # fmt: skip
    names = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "dense"}
    mine.load_state_dict(
        {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in hf.state_dict().items()}
    )
    x = torch.randn(2, 10, 16)
    want = hf(x)[0]
    got = mine((x, None)) - x  # the reference adds the residual
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_position_options_are_checked() -> None:
    bad: list[dict[str, Any]] = [
        {"rotary_dim": 6},  # more than the head size (4)
        {"rotary_dim": 2, "add_cross_attention": True},
        {"window_size": 0, "causal_mask_size": 8},
        {"alibi_bias_max": 0},
        {"pre_layernorm": True, "single_pre_layernorm": True},
        {"parallel_attn_output": True, "add_cross_attention": True},
    ]
    for kwargs in bad:
        with pytest.raises(DistTransformerConfigError):
            ref.TransformerLayer(**{**SMALL, **kwargs})
    with pytest.raises(DistTransformerConfigError, match="attention_layers_type"):
        ref.Transformer(
            **SMALL, num_layers=2, causal_mask_size=8, window_size=2, attention_layers_type=["local"]
        )


GPTJ_LIKE = {  # smp's GPT-J layer: one norm feeding attention and MLP in parallel, interleaved rotary
    "rotary_dim": 2, "single_pre_layernorm": True, "pre_layernorm": False, "post_layernorm": False,
    "parallel_attn_output": True, "use_qkv_bias": False, "use_attn_dense_bias": False, "causal_mask_size": 8,
}  # fmt: skip
NEOX_LIKE = {  # smp's GPT-NeoX layer: a norm per block, in parallel, half rotary over the whole head
    "rotary_dim": 4, "gpt_neox_type_rotary": True, "rotary_emb_base": 500.0, "pre_layernorm": True,
    "post_layernorm": False, "parallel_attn_output": True, "causal_mask_size": 8,
}  # fmt: skip
NEO_LIKE = {  # smp's GPT-Neo: alternating global and local layers, unscaled scores
    "num_layers": 2, "attention_layers_type": ["local", "global"], "window_size": 2, "causal_mask_size": 8,
    "scale_attention_scores": False, "use_qkv_bias": False, "pre_layernorm": True, "post_layernorm": False,
}  # fmt: skip


# Embeddings drawn from N(0, 1), not N(0, 0.02): tiny embeddings make the first layer norm scale their
# gradients up to ~1e2, where fp32 rounding alone exceeds an absolute 1e-5.
WIDE = {"initializer_range": 1.0}


def _cases(optimize: str, prescaled: bool = False) -> list[Case]:
    unfused = {"fused_softmax": False}
    cases = [
        Case("layer", optimize, prescaled, {"rotary_dim": 2, "causal_mask_size": 8}),
        Case("layer", optimize, prescaled, NEOX_LIKE),
        Case("layer", optimize, prescaled, {**GPTJ_LIKE, **unfused}),
        Case("layer", optimize, prescaled, {"use_alibi": True, "causal_mask_size": 8}),
        Case("layer", optimize, prescaled, {"use_alibi": True, "alibi_bias_max": 4.0, **unfused}),
        Case("layer", optimize, prescaled, {"window_size": 2, "causal_mask_size": 8, **unfused}),
        Case("transformer", optimize, prescaled, NEO_LIKE),
        Case(
            "lmhead",
            optimize,
            prescaled,
            {
                **GPTJ_LIKE,
                "num_layers": 2,
                "use_positional_embedding": False,
                "use_lm_head_bias": True,
                "tie_input_output_embedding": False,
                "final_layernorm": True,
                **WIDE,
            },
        ),
        Case("lmhead", optimize, prescaled, {**NEO_LIKE, "final_layernorm": True, "use_alibi": True, **WIDE}),
    ]
    return cases


def _run(world: Any, optimize: str, prescaled: bool) -> Any:
    return run_cases(world, _cases(optimize, prescaled))


@pytest.mark.parametrize(
    ("n", "optimize", "prescaled"),
    [(1, "speed", False), (2, "speed", False), (2, "memory", False), (2, "speed", True)],
    ids=["tp1", "tp2-speed", "tp2-memory", "tp2-prescaled"],
)
def test_distributed_positions_equal_reference(worlds: Any, n: int, optimize: str, prescaled: bool) -> None:
    results = worlds.run(n, _run, optimize, prescaled, timeout=240)
    bad = worst(results, TOL)
    assert not bad, bad
    assert len(results[0]) == len(_cases(optimize, prescaled))
