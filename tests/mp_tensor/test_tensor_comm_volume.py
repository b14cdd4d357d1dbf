"""Bytes moved by TP collectives per layer in one step (mp_tensor.comm_volume.measure) equal the
analytic Megatron count, for every mapped family in speed mode and the block-level families in memory
mode; one case is also checked against the count written out by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mp_tensor.comm_report import build_model, format_table, model_inputs
from mp_tensor.comm_volume import measure
from mp_tensor.context import TPContext
from mp_tensor.enable import set_tensor_parallelism
from mp_tensor.replace import replace_modules
from tests.mp_tensor._tp_util import with_group

pytest.importorskip("transformers")

HIDDEN, HEADS, BATCH, SEQ = 32, 4, 2, 6


def _volumes(world: Any, families: list[str], optimize: str, prescaled: bool) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)  # type: ignore[arg-type]
        out = {}
        for family in families:
            torch.manual_seed(0)
            model, blocks = build_model(family, 2, HIDDEN, HEADS)
            for block in blocks:
                set_tensor_parallelism(block, True)
            model = replace_modules(model, ctx)
            inputs = model_inputs(family, BATCH, SEQ)

            def step() -> None:
                model(**inputs).logits.float().pow(2).mean().backward()  # noqa: B023

            rows = measure(model, step)
            out[family] = {
                "rows": [
                    (r.name, r.cls, r.tokens, r.matches(), r.measured, r.analytic, r.complete) for r in rows
                ],
                "table": format_table(rows),
            }
        return out

    return with_group(run)  # type: ignore[no-any-return]


CASES = [
    ("speed", True, ["gpt2", "bert", "llama", "neox", "gptneo", "gptj", "t5", "vit"]),
    ("memory", True, ["llama", "neox", "gptneo", "gptj", "t5", "vit"]),
    ("speed", False, ["llama", "t5", "vit"]),
    ("memory", False, ["gptj", "t5", "vit"]),
]


@pytest.mark.parametrize(
    ("optimize", "prescaled", "families"),
    CASES,
    ids=[f"{o}{'-prescaled' if p else '-per-rank-batch'}" for o, p, _ in CASES],
)
def test_measured_volume_equals_the_analytic_count(
    worlds: Any, optimize: str, prescaled: bool, families: list[str]
) -> None:
    results = worlds.run(2, _volumes, families, optimize, prescaled, timeout=400)
    for rank, per_family in enumerate(results):
        for family, res in per_family.items():
            blocks = [r for r in res["rows"] if r[1].endswith(("Layer", "Block"))]
            assert len(blocks) >= 2, (family, res["table"])
            for name, cls, _, ok, measured, analytic, complete in blocks:
                assert analytic is not None, (rank, family, name, cls)
                assert complete == prescaled
                assert ok, f"rank {rank} {family} {name}: measured != analytic\n{res['table']}"
                assert measured, (family, name)


def test_vit_speed_volume_by_hand(worlds: Any) -> None:
    per_family = worlds.run(2, _volumes, ["vit"], "speed", True, timeout=300)[0]["vit"]
    tokens = BATCH * (16 // 4) ** 2 + BATCH  # patches plus the class token, on the shared batch
    layer = tokens * HIDDEN * 4  # fp32 bytes of one [tokens, hidden] activation
    blocks = [r for r in per_family["rows"] if r[1] == "DistributedViTLayer"]
    assert len(blocks) == 2
    for _, _, t, _, measured, _, _ in blocks:
        assert t == tokens
        # one all-reduce after attention and one after the MLP; backward one per input exchange
        assert measured == {("bwd", "all_reduce"): (2, 2 * layer), ("fwd", "all_reduce"): (2, 2 * layer)}


def test_t5_memory_decoder_volume_by_hand(worlds: Any) -> None:
    per_family = worlds.run(2, _volumes, ["t5"], "memory", True, timeout=300)[0]["t5"]
    t, h, inner, ff = BATCH * SEQ, HIDDEN, HIDDEN, 4 * HIDDEN  # d_kv * heads == hidden here
    decoder = [r for r in per_family["rows"] if r[0].startswith("decoder.block")]
    act = 4  # fp32
    # reduce-scatters: q/k/v, cross q, cross k/v (encoder tokens = decoder tokens here), wi, and
    # the three output projections; norms: 3 RMS (1 number per token); channels gathered out
    want = {
        ("fwd", "reduce_scatter"): (
            7,
            (t * 3 * inner + t * inner + t * 2 * inner + t * ff + 3 * t * h) * act,
        ),
        ("bwd", "all_gather"): (
            9,
            (t * 3 * inner + t * inner + t * 2 * inner + t * ff + 3 * t * h + 2 * t * h) * act,
        ),
        ("fwd", "all_reduce"): (3, 3 * t * 4),
        ("bwd", "all_reduce"): (3, 3 * t * 4),
        ("fwd", "all_gather"): (1, t * h * act),
    }
    assert len(decoder) == 2
    for row in decoder:
        assert row[4] == want, (row[0], row[4])


def test_cli_prints_equal_volumes_as_json() -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mp_tensor.comm_report", "--family", "gptj", "--layers", "1", "--prescaled",
         "--optimize", "memory", "--json"],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    block = [r for r in rows if r["class"] == "DistributedGPTJLayer"]
    assert len(block) == 1 and block[0]["equal"] is True, rows
    assert block[0]["measured"]["fwd reduce_scatter"]["count"] == 2  # q/k/v/fc_in at once, then the sum
