"""Collectives per transformer block, forward and backward, for every Hugging Face family mp maps at
the transformer level: the Megatron count (one all-reduce per attention or MLP output forward, one per
input exchange backward), counted on the wire with the torch.distributed probe. A block's count is the
difference between models of 2 and 1 blocks (T5: encoder and decoder blocks apart)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mp_tensor.comm_report import build_model, model_inputs
from mp_tensor.context import TPContext
from mp_tensor.enable import set_tensor_parallelism
from mp_tensor.replace import replace_modules
from tests.mp_tensor._tp_probe import count_collectives, tally
from tests.mp_tensor._tp_util import with_group

pytest.importorskip("transformers")

FAMILIES = ("gpt2", "bert", "llama", "neox", "gptneo", "gptj", "t5", "vit")
SIZES = {"hidden": 32, "heads": 4}


def _phases(family: str, ctx: TPContext, layers: int, decoder_layers: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model, blocks = build_model(family, layers, decoder_layers=decoder_layers, **SIZES)
    for block in blocks:  # only the blocks: the model's other layers cancel in the difference anyway
        set_tensor_parallelism(block, True)
    model = replace_modules(model, ctx)
    kinds = sorted({type(b).__name__ for b in model.modules() if "mp_tensor" in type(b).__module__})
    inputs = model_inputs(family, 2, 6)
    with count_collectives() as fwd:
        out = model(**inputs)
    with count_collectives() as bwd:
        out.logits.float().pow(2).mean().backward()
    return {"fwd": tally(fwd), "bwd": tally(bwd), "kinds": kinds}


def _diff(two: dict[str, Any], one: dict[str, Any]) -> dict[str, dict[str, int]]:
    out = {}
    for phase in ("fwd", "bwd"):
        d = {k: two[phase].get(k, 0) - one[phase].get(k, 0) for k in set(one[phase]) | set(two[phase])}
        out[phase] = {k: v for k, v in d.items() if v}
    return out


def _per_block(world: Any, family: str, optimize: str, prescaled: bool) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)  # type: ignore[arg-type]
        one = _phases(family, ctx, 1, 1)
        if family != "t5":
            return {"block": _diff(_phases(family, ctx, 2, 2), one), "kinds": one["kinds"]}
        return {
            "encoder": _diff(_phases(family, ctx, 2, 1), one),
            "decoder": _diff(_phases(family, ctx, 1, 2), one),
            "kinds": one["kinds"],
        }

    return with_group(run)  # type: ignore[no-any-return]


BLOCK_CLASS = {
    "gpt2": "DistributedTransformerLayer",
    "bert": "DistributedTransformerLayer",
    "llama": "DistributedLlamaLayer",
    "neox": "DistributedGPTNeoXLayer",
    "gptneo": "DistributedGPTNeoLayer",
    "gptj": "DistributedGPTJLayer",
    "t5": "DistributedT5Block",
    "vit": "DistributedViTLayer",
}


def _ar(fwd: int, bwd: int) -> dict[str, dict[str, int]]:
    return {"fwd": {"all_reduce": fwd}, "bwd": {"all_reduce": bwd}}


# Megatron, prescaled batch (the TP group shares one batch, so only the reductions communicate):
# forward one all-reduce per attention / MLP output (a parallel attention+MLP block sums both before
# one), backward one per input exchange (each group of projections reading one normalized input).
MEGATRON = {
    "gpt2": _ar(2, 2),
    "bert": _ar(2, 2),
    "llama": _ar(2, 2),
    "neox": _ar(1, 2),  # parallel residual: two layer norms feed attention and MLP, one reduction
    "gptneo": _ar(2, 2),
    "gptj": _ar(1, 1),  # one layer norm feeds attention and MLP: one exchange each way
    "vit": _ar(2, 2),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_collectives_per_block(worlds: Any, family: str) -> None:
    res = worlds.run(2, _per_block, family, "speed", True, timeout=300)[0]
    assert BLOCK_CLASS[family] in res["kinds"], res["kinds"]
    if family == "t5":
        assert res["encoder"] == _ar(2, 2), res
        # self-attention, cross-attention and feed-forward outputs forward; backward their three
        # input exchanges plus the cross-attention keys/values read from the encoder's states
        assert res["decoder"] == _ar(3, 4), res
    else:
        assert res["block"] == MEGATRON[family], res


@pytest.mark.parametrize("family", ["t5", "vit"])
def test_per_rank_batches_add_only_sample_exchanges(worlds: Any, family: str) -> None:
    # without prescaled_batch the reductions are the same; each block gathers its group's samples
    # on the way in (hidden states and masks) and gathers the input gradient's samples on the way out
    res = worlds.run(2, _per_block, family, "speed", False, timeout=300)[0]
    if family == "vit":
        assert res["block"] == {
            "fwd": {"all_reduce": 2, "all_gather": 1},
            "bwd": {"all_reduce": 2, "all_gather": 1},
        }
        return
    assert res["encoder"] == {
        "fwd": {"all_reduce": 2, "all_gather": 2},
        "bwd": {"all_reduce": 2, "all_gather": 1},
    }
    # decoder: hidden, mask, encoder states and encoder mask gathered; the hidden gradient's samples
    # gathered back (the encoder states' gradient is a slice of a replicated one: no exchange)
    assert res["decoder"] == {
        "fwd": {"all_reduce": 3, "all_gather": 4},
        "bwd": {"all_reduce": 4, "all_gather": 1},
    }, res


@pytest.mark.parametrize("family", ["t5", "vit"])
def test_memory_mode_collectives_per_block(worlds: Any, family: str) -> None:
    res = worlds.run(2, _per_block, family, "memory", True, timeout=300)[0]
    # a reduce-scatter per input exchange and per output projection, an all-reduce of the moments per
    # norm; backward their mirrors; the channels all-gathered on the way out and (backward) in
    if family == "vit":
        assert res["block"] == {
            "fwd": {"reduce_scatter": 4, "all_reduce": 2, "all_gather": 1},
            "bwd": {"all_gather": 5, "all_reduce": 2},
        }, res
        return
    assert res["encoder"] == {
        "fwd": {"reduce_scatter": 4, "all_reduce": 2, "all_gather": 1},
        "bwd": {"all_gather": 5, "all_reduce": 2},
    }, res
    assert res["decoder"] == {
        "fwd": {"reduce_scatter": 7, "all_reduce": 3, "all_gather": 1},
        "bwd": {"all_gather": 9, "all_reduce": 3},
    }, res
