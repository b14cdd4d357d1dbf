"""mp-plan's activations under tensor parallelism and checkpointing, against what runs.

- ``profile_tp`` traces mp's distributed model under torch's fake process group; a real 2-rank run of
  the same replacement saves the same bytes for backward on each rank (both layouts, with and without
  ``prescaled_batch``).
- the checkpointing peak: a layer's recompute in backward replaces what ran after the layers; the
  estimate's closed form, and the stage split that tells what ran before the layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp.plan import Layout, StageProfile, estimate, profile_model, profile_tp, split_stages
from tests.mp.plan_models import FACTORY, free_cluster

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 16}
SEQ = 16


def _gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**GPT2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def gpt2_factory() -> tuple[nn.Module, tuple[()], dict[str, torch.Tensor]]:
    net, kwargs = _gpt2()
    return net, (), kwargs


def _saved_per_rank(world: Any, optimize: str, prescaled: bool) -> tuple[int, int]:
    """One forward of mp's distributed GPT-2 on this rank (one local sample) over a real group: the
    partitioner's trace of the activations (the planner's measure), and the bytes of the distinct
    storages autograd saves in forward and backward (parameters left out)."""
    import mp_tensor
    from mp_partition import trace_model
    from mp_tensor import TPContext, replace_modules

    assert mp_tensor is not None
    group = dist.new_group(list(range(dist.get_world_size())))
    try:
        net, kwargs = _gpt2()
        root = replace_modules(
            net, TPContext(group=group, optimize=optimize, prescaled_batch=prescaled), default_enabled=True
        )
        root.train()
        trace = trace_model(root, (), kwargs)
        traced = sum(trace.activation_bytes(p) for p, _ in root.named_modules())
        params = {p.untyped_storage().data_ptr() for p in root.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            root(**kwargs).loss.backward()
        return traced, sum(seen.values())
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize(("optimize", "prescaled"), [("memory", False), ("speed", True)])
def test_tp_profile_equals_a_real_two_rank_run(worlds: Any, optimize: str, prescaled: bool) -> None:
    prof = profile_model("tests.mp.test_plan_tp:gpt2_factory", seq_len=SEQ, device="cpu")
    acts = profile_tp(prof, 2, optimize=optimize, prescaled_batch=prescaled)
    assert acts is not None and "GPT2DistributedLMHead" in acts.replaced
    assert len(acts.layer_bytes) == GPT2["n_layer"] and min(acts.layer_bytes) > 0
    predicted = sum(acts.layer_bytes) + acts.outside_bytes  # per rank, one sample of the TP group
    samples = 1 if prescaled else 2  # each rank's one sample: the group works on two without prescaling
    for rank, (traced, saved) in enumerate(worlds.run(2, _saved_per_rank, optimize, prescaled, timeout=180)):
        # the fake group's trace is the real group's, byte for byte (up to the division by samples)
        assert abs(predicted * samples - traced) < samples, (rank, predicted * samples, traced)
        # the trace's measure counts views of one storage (q, k, v of one projection) apart, so it is at
        # least the distinct storages autograd keeps; here 1-20% more (memory: 3%, speed: 20%)
        assert saved <= traced <= 1.25 * saved, (rank, traced, saved)
    # memory mode's per-rank activations are not the original model's divided by tp (here 0.64 of them;
    # speed mode's happen to come within 5% of it at this size)
    if optimize == "memory":
        assert predicted < 0.8 * prof.activation_total / 2


def test_tp_profile_feeds_the_stages() -> None:
    prof = profile_model("tests.mp.test_plan_tp:gpt2_factory", seq_len=SEQ, device="cpu")
    acts = profile_tp(prof, 2, optimize="memory", prescaled_batch=False)
    assert acts is not None
    (stage,) = split_stages(prof, 1, tp_activations=acts)
    assert stage.activation_tp == 2
    assert stage.activation_bytes == pytest.approx(sum(acts.layer_bytes) + acts.outside_bytes, abs=8)
    assert stage.max_block_activation_bytes == max(acts.layer_bytes)
    est = estimate(
        Layout(pp=1, tp=2, rdp=1, microbatches=1, tp_optimize="memory", prescaled_batch=False),
        (stage,),
        free_cluster(),
        global_batch=4,
        seq_len=SEQ,
        hidden=GPT2["n_embd"],
    )
    assert est.memory.activations == pytest.approx(4 * stage.activation_bytes)  # not divided again
    with pytest.raises(Exception, match="profiled at tp=2"):
        estimate(
            Layout(pp=1, tp=4, rdp=1, microbatches=1),
            (stage,),
            free_cluster(),
            global_batch=4,
            seq_len=SEQ,
            hidden=GPT2["n_embd"],
        )


def _stage(outside_leading: int, outside_trailing: int, block: int, layers: int) -> StageProfile:
    return StageProfile(
        index=0,
        params=10,
        activation_bytes=outside_leading + outside_trailing + layers * block,
        block_activation_bytes=layers * block,
        max_block_activation_bytes=block,
        flops=1.0,
        layers=layers,
        leading_activation_bytes=outside_leading,
    )


def test_checkpointing_peak_is_the_forward_end_or_a_layer_recompute() -> None:
    layers, seq, hidden, b = 4, 8, 16, 2
    boundary = layers * b * seq * hidden * 4  # every layer's input, fp32
    common = {"global_batch": b, "seq_len": seq, "hidden": hidden}
    layout = Layout(pp=1, tp=1, rdp=1, microbatches=1, checkpointing=True)
    # a big head after the layers: it is freed before the layers' recompute; the forward's end is the peak
    big_head = estimate(layout, (_stage(100, 50_000, 1_000, layers),), free_cluster(), **common)
    assert big_head.memory.activations == boundary + b * (100 + 50_000)
    # a big layer: the recompute is the peak, with what ran before the layers still held
    big_layer = estimate(layout, (_stage(100, 50, 60_000, layers),), free_cluster(), **common)
    assert big_layer.memory.activations == boundary + b * (100 + 60_000)
    # two micro-batches in flight: the other one holds its inputs and everything outside the layers
    two = estimate(
        Layout(
            pp=1, tp=1, rdp=1, microbatches=2, schedule="simple", checkpointing=True, active_microbatches=2
        ),
        (_stage(100, 50, 60_000, layers),),
        free_cluster(),
        global_batch=2 * b,
        seq_len=seq,
        hidden=hidden,
    )
    assert two.memory.activations == 2 * boundary + b * (100 + 50) + b * (100 + 60_000)


def test_stages_tell_what_runs_before_the_layers() -> None:
    prof = profile_model("tests.mp.plan_models:stem_blocks", seq_len=8, factory_kwargs={"layers": 4})
    stem = sum(b for p, b in prof.activation_bytes.items() if p.startswith("stem"))
    assert stem > 0
    (stage,) = split_stages(prof, 1)
    assert stage.leading_activation_bytes == stem
    first, second = split_stages(prof, 2)
    assert first.leading_activation_bytes == stem
    assert second.leading_activation_bytes == 0  # only the head, after the second stage's layers


def test_factory_without_a_stem_is_unchanged() -> None:
    (stage,) = split_stages(profile_model(FACTORY, seq_len=8), 1)
    assert stage.leading_activation_bytes == 0


def test_tp_profile_of_a_model_mp_cannot_distribute_says_so(caplog: pytest.LogCaptureFixture) -> None:
    prof = profile_model("tests.mp.plan_models:scales", seq_len=8, hidden=16)
    with caplog.at_level("WARNING", logger="mp.plan.tp_profile"):
        acts = profile_tp(prof, 2)
    assert acts is not None and acts.replaced == ()
    # every rank would run the whole model: its activations, not half of them
    assert sum(acts.layer_bytes) + acts.outside_bytes == prof.activation_total
    assert "no distributed implementation" in caplog.text and "tp=2" in caplog.text
