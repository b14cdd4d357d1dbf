"""HuggingFace architectures built from configs (nothing downloaded): T5 and GPT-2 plans, 10B on meta."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("transformers")

from transformers import GPT2Config, T5Config

from mp_partition import ModelTooSmallError, PartitionError, auto_partition, build_hf_model, partition_hf
from mp_partition.hf import load_hf_config

from ._checks import walk_consistent


def t5_config() -> T5Config:
    return T5Config(vocab_size=256, d_model=64, d_ff=256, d_kv=16, num_heads=4, num_layers=12)


def child(plan_node, label):  # type: ignore[no-untyped-def]
    return next(c for c in plan_node.children if c.label == label)


def test_t5_plan_looks_like_appendix_d() -> None:
    for alpha in (1.0, 0.2):
        plan = partition_hf(t5_config(), 8, memory_weight=alpha)
        # embedding and LM head share weights: one ModuleNode, one partition (seed 001, Figure 9)
        tied = next(c for c in plan.tree.children if "lm_head" in c.paths)
        assert "shared" in tied.paths
        assert plan.owner("shared") == plan.owner("lm_head") == plan.owner("encoder.embed_tokens")
        encoder, decoder = child(plan.tree, "encoder"), child(plan.tree, "decoder")
        assert len(encoder.devices) + len(decoder.devices) == 8
        # the decoder, with cross-attention, costs more and gets more devices
        assert decoder.cost > encoder.cost
        assert len(decoder.devices) >= len(encoder.devices) >= 3
        # every partition holds a run of consecutive blocks; costs near 1/8 each
        assert not plan.empty_partitions
        assert max(plan.costs) < 0.17 and min(plan.costs) > 0.08
        walk_consistent(plan.tree)
    # Figure 10: partition 0 gets fewer decoder layers, as it also holds the embedding and the LM head
    blocks = [plan.owner(f"decoder.block.{i}") for i in range(12)]
    per_partition = {p: blocks.count(p) for p in set(blocks)}
    assert per_partition[0] == min(per_partition.values()) < max(per_partition.values())


def test_gpt2_layers_split_evenly() -> None:
    config = GPT2Config(n_layer=16, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    plan = partition_hf(config, 4, seq_len=32)
    owners = [plan.owner(f"transformer.h.{i}") for i in range(16)]
    assert owners == [i // 4 for i in range(16)]
    assert plan.owner("lm_head") == plan.owner("transformer.wte") == 0
    assert "h[0:4] (GPT2Block x4)" in plan.report()
    assert plan.inputs.example_inputs == ("input_ids: int64[1, 32] on meta",)


def test_bert_masked_lm_and_presets() -> None:
    built = build_hf_model(
        "bert-base-uncased",
        overrides={
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
    )
    assert built.task == "masked-lm" and type(built.model).__name__ == "BertForMaskedLM"
    assert all(p.device.type == "meta" for p in built.model.parameters())
    assert load_hf_config("t5-11b").d_ff == 65536
    with pytest.raises(PartitionError, match="unknown architecture"):
        load_hf_config("no-such-architecture-xyz")


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def test_ten_billion_parameters_trace_on_meta() -> None:
    config = GPT2Config(n_layer=32, n_embd=5120, n_head=40)
    before = _rss_bytes()
    start = time.perf_counter()
    built = build_hf_model(config, seq_len=64)
    plan = auto_partition(built.model, 8, example_kwargs=built.example_kwargs)
    elapsed = time.perf_counter() - start
    after = _rss_bytes()
    assert plan.inputs.num_parameters > 10_000_000_000
    assert plan.inputs.traced and plan.inputs.trace_device == "meta"
    assert sum(p.activation_bytes for p in plan.partitions) > 0
    assert plan.owner("transformer.h.31") == 7 and plan.owner("transformer.h.0") == 0
    assert elapsed < 30.0
    if before is not None and after is not None:
        assert after - before < 1 << 30  # 40 GB of float32 weights were never allocated


def test_too_few_modules() -> None:
    with pytest.raises(ModelTooSmallError):
        partition_hf(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16), 64, seq_len=4)


def test_t5_11b_partitions_as_figures_9_and_10_with_a_shorter_target() -> None:
    # Appendix D: alpha 1.0 gives the encoder and the decoder four partitions each (Figure 9), alpha 0.2
    # three and five (Figure 10). With equal source and target lengths, alpha 1.0 gives 3/5 here (the
    # decoder's parameters and activations are 57% of the model); with a target 2/3 of the source (T5
    # pretrains on 512 / 114 tokens) the encoder's activations weigh enough for 4/4.
    from mp_partition import trace_model

    built = build_hf_model("t5-11b", seq_len=192, decoder_seq_len=128)
    assert tuple(built.example_kwargs["decoder_input_ids"].shape) == (1, 128)
    trace = trace_model(built.model, (), built.example_kwargs)
    for alpha, expected in ((1.0, (4, 4)), (0.2, (3, 5))):
        plan = auto_partition(
            built.model, 8, example_kwargs=built.example_kwargs, trace=trace, memory_weight=alpha
        )
        encoder = {plan.owner(f"encoder.block.{i}") for i in range(24)}
        decoder = {plan.owner(f"decoder.block.{i}") for i in range(24)}
        assert (len(encoder), len(decoder)) == expected, (alpha, sorted(encoder), sorted(decoder))
