"""sharded_data_parallel_degree (FSDP2 underneath) on real worlds against plain single-process PyTorch,
alone and combined with tensor parallelism, delayed parameter initialization and fp16/bf16.

The model, batches, references and the functions the ranks run are in tests/integration/_sdp.py; this
module holds the cases as tables and what each must show.

- fp32 (sdp=2 on 2 ranks: ZeRO-3; sdp=2 x dp=2 on 4: HSDP; tp=2 x sdp=2 on 4; tp=2 x 2 replicas x
  sdp=2 on 8): every step's loss, the parameters after 4 AdamW steps and the full optimizer state equal
  one process training on all replicas' batches (the same microbatch averaging, the same clipping by
  the global norm) within 1e-5; without TP every gradient of the last step too.
- fp16 / bf16: against one process running the same mixed-precision recipe (_sdp.half_reference). Under
  sharding the sharded parameters stay fp32 and are their own masters; FSDP2 gathers them in the half
  dtype for forward and backward and reduce-scatters the gradients in fp32. The small parameters below
  sdp_param_persistence_threshold (here the biases) are half with separate fp32 masters, as without
  sharding. Tolerance: the masters within rtol 1e-3, atol 1e-4 for fp16 (its unit roundoff is 5e-4) and
  rtol 1e-2, atol 1e-3 for bf16 (unit roundoff 4e-3); the half parameters within one more rounding of
  the half dtype; losses within 1e-3 (fp16) and 1e-2 (bf16) relative. An inf in one rank's shard skips
  the step on every rank. Under TP clipping uses the whole model's norm: shards summed over the sharding
  group, TP shards over the TP group, TP-replicated parameters counted once.
- Delayed initialization: DistributedModel materializes the meta model in module order and shards each
  block as soon as it is initialized, so at most the root's parameters and one block are ever whole;
  the values equal eager initialization under the same seed (under TP: those of delayed init under TP
  without sharding, each TP shard drawn as its distributed module's constructor draws it).
- Checkpoints: partial (sharded) and full ones resume bitwise, in fp32 and fp16, with and without TP.
- Also: sdp_gradient_clipping, per-rank state bytes (at most 0.55x unsharded), the prefetch depth from
  sdp_max_live_parameters, refused options, memory flat over 200 steps, Hugging Face GPT-2.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import mp as smp
from tests._harness import run_script
from tests.integration import _sdp

# ---- fp32 training equals one process --------------------------------------------------------------

# id: (ranks, config, tp, delayed)
TRAIN: dict[str, tuple[int, dict[str, Any], bool, bool]] = {
    "sdp2": (2, _sdp.config(2), False, False),  # ZeRO-3
    "sdp2-dp2": (4, _sdp.config(2), False, False),  # HSDP
    # sdp_param_persistence_threshold's default (1e6) shards no parameter of this small model: every
    # gradient is averaged over the data-parallel group instead
    "sdp2-smp-default-threshold": (
        2,
        _sdp.config(2, sdp_param_persistence_threshold=1_000_000),
        False,
        False,
    ),
    "sdp2-delayed": (2, _sdp.config(2), False, True),
    "sdp2-dp2-delayed": (4, _sdp.config(2), False, True),
    "tp2-sdp2-memory": (4, _sdp.config(2, tensor_parallel_degree=2), True, False),
    "tp2-sdp2-speed": (4, _sdp.config(2, tensor_parallel_degree=2, optimize="speed"), True, False),
    "tp2-sdp2-prescaled": (
        4,
        _sdp.config(2, tensor_parallel_degree=2, optimize="speed", prescaled_batch=True),
        True,
        False,
    ),
}


@pytest.mark.parametrize("case", list(TRAIN))
def test_sharded_training_equals_one_process(worlds: Any, case: str) -> None:
    ranks, config, tp, delayed = TRAIN[case]
    for r in worlds.run(ranks, _sdp.train, config, tp, delayed, timeout=400):
        assert r["loss_ok"] and r["params"] is None and r["opt"] is None and r.get("grads") is None, r
        kinds = r["kinds"]
        if tp:
            assert r["layer"] == "DistributedLinear" and "DTensor" in kinds.values(), r
        elif config["sdp_param_persistence_threshold"] > 10_000:
            assert set(kinds.values()) == {"Parameter"}, r  # nothing sharded
        else:
            assert kinds["blocks.0.inner.weight"] == "DTensor", r  # sharded
            assert kinds["blocks.0.inner.bias"] == "Parameter", r  # below the persistence threshold


def test_tp2_hsdp_2x2_trains_like_one_process(tmp_path: Path) -> None:
    """tp=2 x 2 replicas x sdp=2 on 8 ranks: a (tp, replicate, shard) mesh, FSDP2's hybrid sharding over
    the last two dimensions; clipped by sdp_gradient_clipping (the norm sums shards over one replica
    only); a partial checkpoint (one file per shard and TP rank, written by the first replica) resumes
    bitwise."""
    for r in _on_8_ranks(tmp_path, "hsdp", (str(tmp_path / "ckpt"),)):
        assert r["norms"] and min(r.pop("norms")) > _sdp.HSDP_CLIP, r
        assert r == {"mesh": (2, 2), "loss_ok": True, "params": None, "opt": None, "resumed": None}, r


def _on_8_ranks(tmp_path: Path, name: str, args: tuple[Any, ...]) -> list[Any]:
    """_sdp's function ``name`` on every rank of an 8-rank job under plain mpiexec (the reused pool's
    listener takes its ranks' connections one at a time and did not start 8 ranks within its 300 s on
    this host); the results in rank order."""
    script = tmp_path / "job.py"
    script.write_text(
        f"from tests.integration import _sdp\n_sdp.write_result({name!r}, {args!r}, {str(tmp_path)!r})\n"
    )
    output, code, _ = run_script(script, _sdp.HSDP_RANKS, timeout=600)
    assert code == 0, output[-4000:]
    return [pickle.loads((tmp_path / f"result{rank}.pkl").read_bytes()) for rank in range(_sdp.HSDP_RANKS)]


# ---- fp16 / bf16 against the one-process recipe ----------------------------------------------------

# id: (ranks, precision, overflow step or None, tp)
HALF: dict[str, tuple[int, str, int | None, bool]] = {
    "sdp2-fp16": (2, "fp16", None, False),
    "sdp2-bf16": (2, "bf16", None, False),
    "sdp2-dp2-fp16": (4, "fp16", None, False),
    "sdp2-fp16-overflow": (2, "fp16", 2, False),
    "tp2-sdp2-fp16": (4, "fp16", None, True),
    "tp2-sdp2-bf16": (4, "bf16", None, True),
    "tp2-sdp2-fp16-overflow": (4, "fp16", 2, True),
}


def _check_half(r: dict[str, Any], precision: str, overflow_step: int | None) -> None:
    assert r["masters"] is None and r["params"] is None, r
    assert r["master_dtypes"] == ["torch.float32"], r
    assert max(r["losses"]) <= _sdp.LOSS_TOL[precision], r
    assert r["scales"][0] == r["scales"][1] and r["skipped"][0] == r["skipped"][1], r
    half = str(_sdp.DTYPES[precision])
    assert r["dtypes"] == [half], r  # the model's state is in the half dtype, as smp's
    assert r["kinds"]["blocks.0.inner.weight"] == ("DTensor", "torch.float32"), r  # fp32 shards = masters
    assert r["kinds"]["blocks.0.inner.bias"] == ("Parameter", half), r  # kept whole, half
    got, want = r["norms"]
    assert len(got) == len(want) and all(abs(g - w) <= 1e-3 * w for g, w in zip(got, want, strict=True)), r
    if overflow_step is not None:  # skipped on every rank, the scale halved; clip_master_grads' norms
        scales, skipped = r["scales"][0], r["skipped"][0]
        assert skipped == [step == overflow_step for step in range(_sdp.HALF_STEPS)], r
        assert scales[overflow_step + 1] == scales[overflow_step] / 2, r
        assert len(got) == _sdp.HALF_STEPS - 1, r


@pytest.mark.parametrize("case", list(HALF))
def test_half_precision_sharded_trains_like_the_one_process_recipe(worlds: Any, case: str) -> None:
    """sdp_gradient_clipping 1.0 inside optimizer.step(); with a forced overflow (an inf in one rank's
    shard) the script clips by clip_master_grads instead."""
    ranks, precision, overflow_step, tp = HALF[case]
    for r in worlds.run(ranks, _sdp.train_half, precision, overflow_step, tp, timeout=400):
        if tp:
            assert r["layer"] == "DistributedLinear", r
        _check_half(r, precision, overflow_step)


def test_tp2_hsdp_2x2_fp16_with_a_forced_overflow(tmp_path: Path) -> None:
    """The tp2-sdp2-fp16-overflow case with 2 replicas on 8 ranks: same tolerances."""
    for r in _on_8_ranks(tmp_path, "train_half", ("fp16", 2, True)):
        _check_half(r, "fp16", 2)


# ---- checkpoints ----------------------------------------------------------------------------------

# id: (ranks, partial, tp, precision, load_sharded_optimizer_state)
ROUND_TRIP: dict[str, tuple[int, bool, bool, str | None, bool]] = {
    "sdp2-partial": (2, True, False, None, True),
    "sdp2-full": (2, False, False, None, True),
    "sdp2-fp16-partial": (2, True, False, "fp16", True),
    "sdp2-fp16-full": (2, False, False, "fp16", True),
    "tp2-sdp2-partial": (4, True, True, None, True),
    "tp2-sdp2-fp16-partial": (4, True, True, "fp16", True),
    # the weights load, AdamW's state starts afresh: the run no longer follows the straight one
    "sdp2-partial-without-optimizer-state": (2, True, False, None, False),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_checkpoint_round_trip(worlds: Any, tmp_path: Any, case: str) -> None:
    """Partial: one file per shard (and TP rank), this rank's shards of the parameters, the fp32
    masters, AdamW's state and the scaler; full: gathered. Under TP in fp16 the full optimizer state is
    refused by name (optimizer.local_state_dict() instead)."""
    ranks, partial, tp, precision, sharded_state = ROUND_TRIP[case]
    kwargs = {"tp": tp, "precision": precision, "sharded_state": sharded_state}
    for r in worlds.run(ranks, _sdp.round_trip, str(tmp_path), partial, timeout=400, **kwargs):
        assert r["user"] == {"step": 2}, r
        if not sharded_state:
            assert r["params"] is not None, r
            continue
        assert r["params"] is None, r
        if precision is not None:
            assert r["masters"] is None and r["scaler"], r
        if tp and precision is not None:
            assert "optimizer.local_state_dict()" in r["refused"], r


def test_tp2_sdp2_full_states_gather_translate_and_load_across_layouts(worlds: Any, tmp_path: Any) -> None:
    """optimizer.state_dict() gathers each state tensor over the sharding group and translates the TP
    shards to the original model's names and full tensors; model/optimizer.load_state_dict of full states
    cut them back to each rank's shard of its TP shard: within 1e-5 of one process after 2 and 4 steps; a
    full checkpoint resumes bitwise; the one-process run's own states load and train on like it."""
    for r in worlds.run(4, _sdp.tp_full_states, str(tmp_path), timeout=500):
        assert r == {
            "keys": True,
            "opt_early": None,
            "opt_late": None,
            "resumed": None,
            "resumed_opt": None,
            "from_one_process": None,
            "from_one_process_opt": None,
        }, r


# ---- delayed parameter initialization --------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "precision"),
    [("delay_param_initialization", None), ("model_creation", None), ("model_creation", "fp16")],
)
def test_materialized_block_by_block_equal_to_eager_init(
    worlds: Any, how: str, precision: str | None
) -> None:
    """The values equal eager initialization under the same seed for a model whose modules draw their
    random numbers in module order (this one: nn.Linear's reset_parameters)."""
    for r in worlds.run(2, _sdp.materialized, how, precision, timeout=300):
        assert r["on_meta"] and not r["meta_left"] and r["kinds"] == ["DTensor"], r
        assert r["init"] is None, r  # bitwise the eager values (fp16: eager fp32 init, then cast)
        assert r["peak"] <= _sdp.ROOT + _sdp.BLOCK, r  # never more than the root and one block whole (of 4)


@pytest.mark.parametrize("precision", [None, "fp16"], ids=["fp32", "fp16"])
def test_tp2_sdp2_delayed_init_draws_tp_shards_and_trains_like_one_process(
    worlds: Any, precision: str | None
) -> None:
    for r in worlds.run(4, _sdp.delayed_tp, precision, timeout=400):
        assert r["on_meta"] and not r["meta_left"] and "DTensor" in r["kinds"], r
        assert r["init"] is None, r  # the TP path's own draws, bitwise
        assert r["params"] is None, r
        if precision is None:
            assert r["moved"] > 0, (
                r
            )  # not the eager values: the distributed modules' own init (docs/memory.md)
            assert r["peak"] <= _sdp.TP_ROOT + _sdp.TP_BIASES + _sdp.TP_BLOCK_WEIGHTS, (
                r
            )  # never 2 blocks whole
            assert r["loss_ok"], r
        else:
            assert r["dtypes"] == ["torch.float16"] and r["losses"] <= 1e-3, r


# ---- Hugging Face GPT-2 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "tp", "delayed"),
    [(2, False, False), (2, False, True), (4, True, False)],
    ids=["sdp2", "sdp2-delayed", "tp2-sdp2"],
)
def test_hf_gpt2_trains_like_one_process(worlds: Any, ranks: int, tp: bool, delayed: bool) -> None:
    """Blocks from _no_split_modules, tied embeddings; tp: whole-stack tensor-parallel
    (GPT2DistributedLMHead), each DistributedTransformerLayer sharded on its own; delayed: built on meta,
    HF's _init_weights ran."""
    for r in worlds.run(ranks, _sdp.gpt2, tp, delayed, timeout=500):
        assert r["loss_ok"] and r["params"] is None, r
        if tp:
            assert r["model"].endswith("GPT2DistributedLMHead"), r  # FSDP2 prefixes the class name
            assert r["blocks"] == 2, r
        else:
            assert r["tied"] and r["refused"] == [True, True], r
        if delayed:
            assert 0.015 < r["wte_std"] < 0.025, r  # HF's _init_weights ran: normal(0, 0.02)


# ---- options, memory, refusals -------------------------------------------------------------------------


def test_sdp_gradient_clipping_clips_by_the_global_norm(worlds: Any) -> None:
    for r in worlds.run(2, _sdp.clipped, 0.01, timeout=300):
        assert r["before"] > 0.1, r  # the raw gradient is well above the threshold
        assert abs(r["after"] - 0.01) <= 1e-5, r  # clipped to it, over all shards together
        assert r["params"] is None, r  # the same step as clip_grad_norm_ in one process


def test_sharded_state_per_rank_is_at_most_055_of_unsharded(worlds: Any) -> None:
    for r in worlds.run(2, _sdp.state_bytes_by_sdp, timeout=300):
        assert r["2"] <= 0.55 * r["1"], r


def test_sdp_max_live_parameters_sets_the_prefetch_depth(worlds: Any) -> None:
    # root: inp (10*32+32) + out (32*4+4) = 484 parameters; a block: 2 * (32*32+32) = 2112
    root, block = _sdp.ROOT, _sdp.BLOCK
    for r in worlds.run(2, _sdp.prefetch, root + 3 * block, timeout=300):
        assert r == {"depth": 2, "params": None}, r
    for r in worlds.run(2, _sdp.prefetch, root + block, timeout=300):
        assert (
            "sdp_max_live_parameters=2596" in r["error"] and f"at least {root + 2 * block}" in r["error"]
        ), r


def test_bucket_size_and_pipeline_parallelism_are_refused() -> None:
    for extra in ({"sdp_reduce_bucket_size": 1000}, {"pipeline_parallel_degree": 2}):
        with pytest.raises(ValueError) as info:
            smp.init({"sharded_data_parallel_degree": 2, **extra})
        assert next(iter(extra)) in str(info.value), info.value
        assert not smp.is_initialized()


def test_shard_groups_spanning_nodes_are_refused(worlds: Any) -> None:
    for text in worlds.run(2, _sdp.spanning, timeout=120):
        assert "'sdp_hierarchical_allgather'" in text and "a divisor of 1" in text, text


def test_backward_passes_per_step_accumulates(worlds: Any) -> None:
    for r in worlds.run(2, _sdp.accumulated, timeout=300):
        assert r["params"] is None, r


def test_memory_stays_flat_over_200_steps(worlds: Any) -> None:
    """As tests/integration/test_endurance.py: fewest live tensors over steps 20-29 vs 191-200, RSS at
    step 100 vs 200."""
    for r in worlds.run(2, _sdp.endurance, timeout=600):
        t0 = min(v for i, v in r["tensors"].items() if i < 30)
        t1 = min(v for i, v in r["tensors"].items() if i > 190)
        assert t1 - t0 <= 8, r["tensors"]
        assert r["rss"][200] - r["rss"][100] <= 16.0, r["rss"]


def test_blocks_are_hf_no_split_modules_else_module_list_children() -> None:
    from mp_memory.sharded import block_modules
    from tests.mp_pipeline.models import build

    gpt = build("gpt2", layers=3)
    assert block_modules(gpt) == list(gpt.transformer.h)  # type: ignore[union-attr]
    stack = _sdp.build()
    assert block_modules(stack) == list(stack.blocks)
    assert block_modules(nn.Sequential(nn.Linear(2, 2))) == []
    stack._no_split_modules = ["NotHere"]  # type: ignore[assignment]
    assert block_modules(stack) == list(stack.blocks)  # named classes absent: ModuleList children
