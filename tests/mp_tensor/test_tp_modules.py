"""Every distributed module against its non-distributed reference: outputs and every gradient equal.

Both distributions (optimize "speed" and "memory"), with and without prescaled_batch, causal and not,
self and cross attention, pre/post layer norm; tp 2 on 2 ranks, and tp 4 on 4 ranks for a few.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mp_tensor import nn as tnn
from mp_tensor.context import TPContext
from mp_tensor.errors import (
    DistEmbeddingConfigError,
    DistTransformerConfigError,
    NoTPContextError,
    TPInputError,
)
from tests.mp_tensor._tp_util import SMALL, Case, run_cases, with_group, worst

TOL = 2e-5  # fp32; the sums run in a different order than in one process


def _cases(optimize: str, prescaled: bool) -> list[Case]:
    def c(kind: str, **opts: Any) -> Case:
        return Case(kind, optimize, prescaled, opts)

    return [
        c("linear"),
        c("linear", bias=False),
        c("embedding", padding_idx=3),
        c("embedding", padding_idx=13, vocab_parallel=True),
        c("layernorm"),
        c("attention"),
        c("attention", causal_mask_size=8),
        c("attention", causal_mask_size=8, fused_softmax=False),
        c("layer", causal_mask_size=8, fused_bias_gelu=True),
        c("attention", pre_layernorm=True, post_layernorm=False, causal_mask_size=8),
        c("attention", pre_layernorm=True, post_layernorm=True),
        c("attention", cross_attention=True),
        c("attention", cross_attention=True, pre_layernorm=True, post_layernorm=False),
        c("output"),
        c("output", activation="relu", pre_layernorm=True, post_layernorm=False),
        c("output", activation="gelu_new", pre_layernorm=True, post_layernorm=True),
        c("layer", causal_mask_size=8),
        c("layer", add_cross_attention=True, pre_layernorm=True, post_layernorm=False),
        c("transformer", num_layers=2),
        c("transformer", num_layers=2, pre_layernorm=True, post_layernorm=False, causal_mask_size=8),
        c("lmhead", num_layers=2, num_token_types=2),
        c(
            "lmhead",
            num_layers=1,
            causal_mask_size=8,
            pre_layernorm=True,
            post_layernorm=False,
            final_layernorm=True,
        ),
        c("lmhead", num_layers=1, add_cross_attention=True),
    ]


@pytest.mark.parametrize("prescaled", [False, True], ids=["per-rank-batch", "prescaled"])
@pytest.mark.parametrize("optimize", ["memory", "speed"])
def test_modules_match_reference_tp2(worlds: Any, optimize: str, prescaled: bool) -> None:
    results = worlds.run(2, run_cases, _cases(optimize, prescaled), timeout=120)
    assert not worst(results, TOL)


@pytest.mark.parametrize("optimize", ["memory", "speed"])
def test_modules_match_reference_tp4(worlds: Any, optimize: str) -> None:
    cases = [
        Case("linear", optimize),
        Case("embedding", optimize),
        Case("embedding", optimize, False, {"vocab_parallel": True, "padding_idx": 17}),
        Case("transformer", optimize, False, {"num_layers": 2, "causal_mask_size": 8}),
        Case("transformer", optimize, True, {"num_layers": 1, "pre_layernorm": True}),
        Case("lmhead", optimize, False, {"num_layers": 1, "num_token_types": 2}),
    ]
    results = worlds.run(4, run_cases, cases, timeout=120)
    assert not worst(results, TOL)


def _validation(world: Any) -> list[str]:
    def run(group: dist.ProcessGroup) -> list[str]:
        ctx = TPContext(group=group)
        raised = []
        attempts = [
            (DistTransformerConfigError, lambda: tnn.DistributedLinear(15, 4, tp=ctx)),
            (DistEmbeddingConfigError, lambda: tnn.DistributedEmbedding(10, 7, tp=ctx)),
            (DistEmbeddingConfigError, lambda: tnn.DistributedEmbedding(10, 8, max_norm=1.0, tp=ctx)),
            (
                DistEmbeddingConfigError,
                lambda: tnn.DistributedEmbedding(10, 8, _weight=torch.zeros(10, 8), tp=ctx),
            ),
            (DistTransformerConfigError, lambda: tnn.DistributedLayerNorm(15, tp=ctx)),
            (
                DistTransformerConfigError,
                lambda: tnn.DistributedTransformerLayer(**{**SMALL, "num_attention_heads": 3}, tp=ctx),
            ),
            (
                DistTransformerConfigError,
                lambda: tnn.DistributedTransformerLayer(**{**SMALL, "intermediate_size": 33}, tp=ctx),
            ),
            (
                DistTransformerConfigError,
                lambda: tnn.DistributedTransformer(pre_layernorm=False, post_layernorm=False, tp=ctx),
            ),
            (
                DistTransformerConfigError,
                lambda: tnn.DistributedTransformerOutputLayer(activation="tanh", tp=ctx),
            ),
            (
                DistTransformerConfigError,
                lambda: tnn.DistributedTransformerLMHead(
                    **SMALL, num_positions=16, causal_mask_size=8, tp=ctx
                ),
            ),
            (
                DistTransformerConfigError,
                lambda: tnn.DistributedAttentionLayer(**SMALL, window_size=2, tp=ctx),  # needs causal
            ),
        ]
        for expected, attempt in attempts:
            try:
                attempt()
            except expected as exc:
                raised.append(str(exc))
            else:
                raise AssertionError(f"no {expected.__name__}")
        lm = tnn.DistributedTransformerLMHead(**SMALL, num_layers=1, vocab_size=8, num_positions=8, tp=ctx)
        ids = torch.zeros(2, 4, dtype=torch.long)
        try:
            lm((ids, None, ids, None, None))
        except DistTransformerConfigError as exc:
            raised.append(str(exc))
        try:
            tnn.DistributedLinear(8, 4, tp=ctx)(torch.zeros(8))
        except TPInputError as exc:
            raised.append(str(exc))
        return raised

    return with_group(run)  # type: ignore[no-any-return]


def test_invalid_arguments_raise_smp_errors(worlds: Any) -> None:
    messages = worlds.run(2, _validation)[0]
    assert len(messages) == 13
    assert "in_features=15" in messages[0] and "tensor-parallel degree 2" in messages[0]
    assert "num_token_types=0" in messages[11]


def test_no_context_is_an_error() -> None:
    with pytest.raises(NoTPContextError, match=r"smp\.init"):
        tnn.DistributedLinear(4, 4)


def test_single_rank_context_matches_reference() -> None:
    from mp_tensor import reference as ref

    ctx = TPContext()
    torch.manual_seed(3)
    r = ref.Transformer(**SMALL, num_layers=2, causal_mask_size=8)
    torch.manual_seed(3)
    d = tnn.DistributedTransformer(**SMALL, num_layers=2, causal_mask_size=8, tp=ctx)
    # same seed, same draws: the distributed module is initialized exactly like the reference
    assert all(torch.equal(v, d.full_state_dict()[k]) for k, v in r.state_dict().items())
    x, m = torch.randn(2, 5, 16), torch.zeros(2, 1, 1, 5)
    torch.testing.assert_close(d((x, m))[0], r((x, m))[0], rtol=0, atol=1e-6)
