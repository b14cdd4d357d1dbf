"""The core check: pipelined (and data-parallel) training equals plain single-process PyTorch.

Same model, seed and data: the loss of every step and every parameter after 3 optimizer steps agree
(fp32, rtol 1e-5, atol 1e-6; the first tensor that differs is named). The reference is plain PyTorch
running the step once per microbatch (tests/mp_pipeline/models.py). The larger grid lives in
benchmarks/pipeline_grid.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mp as smp
from mp import DistributedModel, DistributedOptimizer, step
from mp.errors import NotSupportedByFastModeError
from tests.integration._equivalence import train_and_compare
from tests.integration._fast_mode import RECORD_STEPS, record_steps
from tests.mp_pipeline.models import (
    STEPS,
    batch,
    build,
    first_difference,
    loss_of,
    make_optimizer,
    manual_marks,
)

REPLAYED_STEPS = 6
"""Steps of the default config's cases: the plan (step 1), the predictions (2), two recorded steps (3, 4)
and two replayed from each rank's program (5, 6; mp_pipeline.replay)."""


CASES = [
    # (ranks, model, pp, microbatches, schedule, mode). "default": static_mode and fast_mode unset, as
    # users run it (fast mode's plan from the second step, a step it cannot finish run again), for the
    # cases whose plan takes shortcuts. "dynamic": fast_mode false (the full path, which a retry falls
    # back on), for the cases whose plan takes none (the default would change nothing there).
    (2, "mlp", 2, 2, "interleaved", "dynamic"),
    (2, "mlp", 1, 4, "simple", "default"),  # pp=1: pure data parallelism over 2 replicas
    (2, "cnn", 2, 4, "simple", "dynamic"),
    (2, "reuse", 2, 4, "interleaved", "default"),  # microbatches take different branches
    (2, "reuse", 2, 4, "deterministic", "dynamic"),  # interleaved with deterministic_server
    (2, "reuse", 2, 1, "simple", "default"),
    (2, "gpt2", 2, 2, "interleaved", "dynamic"),
    (4, "reuse", 2, 2, "simple", "default"),  # pp=2 with 2 data-parallel replicas
    (4, "gpt2", 2, 2, "simple", "dynamic"),  # GPT-2 on pp=2 with 2 data-parallel replicas
    (4, "gpt2", 4, 4, "interleaved", "default"),  # child to child across ranks, posted calls
    (2, "t5", 2, 2, "interleaved", "dynamic"),  # T5: shared embedding (encoder, decoder, tied LM head)
    (4, "t5", 4, 2, "simple", "default"),
]


@pytest.mark.parametrize(("n", "name", "pp", "microbatches", "pipeline", "mode"), CASES)
def test_pipeline_equals_plain_pytorch(  # noqa: PLR0917 - pytest parameters
    worlds: Any, n: int, name: str, pp: int, microbatches: int, pipeline: str, mode: str
) -> None:
    layers = 4 if pp == 4 else 2
    deterministic = pipeline == "deterministic"
    results = worlds.run(
        n,
        train_and_compare,
        name,
        pp,
        microbatches,
        "interleaved" if deterministic else pipeline,
        optimizer_first=microbatches != 2,
        layers=layers,
        deterministic=deterministic,
        mode=mode,
        # the default config replays each rank's program from the fifth step (mp_pipeline.replay)
        steps=REPLAYED_STEPS if mode == "default" and pp > 1 else STEPS,
        timeout=240,
    )
    for r in results:
        assert r["loss"] is None, f"rank {r['rank']}: {r['loss']}"
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
    print(
        f"{name} pp={pp} m={microbatches} {mode}: {results[0]['replayed']} calls replayed by pp_rank 0, "
        f"{results[0]['relearned']} step(s) fell back to the full path"
    )
    if pp > 1:
        # each rank keeps only its partition's parameters
        assert all(r["local_params"] < r["total_params"] for r in results), results
    if mode == "default" and pp > 1:
        # the plan was followed (outputs passed child to child); all ranks ran the same steps again
        assert sum(r["shortcuts"] for r in results) > 0, results
        assert len({r["relearned"] for r in results}) == 1, results
        if name == "reuse":  # its branch follows the data, which changes between steps: some fell back
            assert results[0]["relearned"] > 0, results[0]
        else:  # the last two steps ran from each rank's program, without requests from pp_rank 0
            assert results[0]["replayed"] > 0 and results[0]["relearned"] == 0, results[0]


# -- static and fast mode (seed 001 §4.4) -------------------------------------------------------------


def train_recorded(world: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    with record_steps(RECORD_STEPS):
        return train_and_compare(world, *args, **kwargs)


@pytest.mark.parametrize("mode", ["static", "fast"])
@pytest.mark.parametrize(
    ("name", "pipeline"), [("gpt2", "interleaved"), ("t5", "simple"), ("reuse_static", "simple")]
)
def test_static_and_fast_mode_equal_plain_pytorch(worlds: Any, mode: str, name: str, pipeline: str) -> None:
    """Steps replayed from the recording (compact messages) train exactly like plain PyTorch; under fast
    mode, blocks that follow each other on rank 1 pass their activations child to child."""
    results = worlds.run(
        2,
        train_recorded,
        name,
        2,
        2,
        pipeline,
        mode=mode,
        layers=4,
        # fast mode learns its plan in the first step and records from the second
        steps=RECORD_STEPS + 2 + (mode == "fast"),
        timeout=180,
    )
    for r in results:
        assert r["loss"] is None, f"rank {r['rank']}: {r['loss']}"
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        # both ranks send messages (requests, responses) and replayed them compact; under fast mode
        # rank 0's calls may be replayed by their owner instead (no requests: mp_pipeline.replay)
        assert r["compact_sent"] > 0 or (mode == "fast" and r["replayed"] > 0), r
    # rank 0 calls the modules on rank 1; the shortcut is fast mode's only
    shortcuts, handoffs = results[0]["shortcuts"], results[1]["handoffs"]
    if mode == "static":
        assert shortcuts == handoffs == results[0]["posted"] == 0, results
    elif name == "gpt2":  # blocks on rank 1 called one after another (T5's decoder is one call)
        assert shortcuts > 0, results[0]
        assert handoffs > 0, results[1]  # block outputs stay on rank 1 from the second step on
        # from the third step on, rank 0 posts those blocks' calls instead of awaiting each response
        assert results[0]["posted"] > 0, results[0]


def branch_change(world: Any, mode: str) -> dict[str, Any]:
    """The reuse model with a flow that is static for the recorded steps, then takes the other branch."""
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "static_mode": mode == "static",
            # "auto": unset, mp's default (the fast-mode shortcut, with a changed step run again)
            "fast_mode": None if mode == "auto" else mode == "fast",
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    steps = RECORD_STEPS + 2 + (mode != "static")  # fast mode records from the second step

    def data(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, target = batch("reuse", s, 0)
        ids[:, 0] = 2 * (ids[:, 0] // 2) + (s >= RECORD_STEPS + 1)  # even (pos), then odd (neg)
        return ids, target

    ref = build("reuse")
    ref_opt = make_optimizer("reuse", ref.parameters())
    ref_losses = []
    for s in range(steps):
        ids, target = data(s)
        loss = sum(loss_of("reuse", ref, (i, t)) for i, t in zip(ids.chunk(2), target.chunk(2), strict=True))
        ref_losses.append(float(loss) / 2)
        (loss / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    with record_steps(RECORD_STEPS):
        net = build("reuse")
        manual_marks("reuse", net, 2)
        model = DistributedModel(net)
        opt = DistributedOptimizer(make_optimizer("reuse", model.parameters()))

    @step
    def train_step(ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_of("reuse", model, (ids, target))
        model.backward(loss)
        return loss

    losses: list[float] = []
    error = None
    for s in range(steps):
        try:
            out = train_step(*data(s))
        except NotSupportedByFastModeError as exc:
            error = (s, str(exc))
            break
        losses.append(out.reduce_mean().item())
        opt.step()
        opt.zero_grad()
    diff = None
    if error is None:
        diff = first_difference(model.state_dict(), ref.state_dict())
    assert model._runtime is not None
    relearned = model._runtime.relearned
    return {
        "rank": smp.rank(),
        "error": error,
        "losses": losses,
        "ref_losses": ref_losses,
        "params": diff,
        "relearned": relearned,
    }


@pytest.mark.parametrize("mode", ["static", "fast", "auto"])
def test_a_branch_change_after_the_recording(worlds: Any, mode: str) -> None:
    """Fast mode: NotSupportedByFastModeError on every rank (no hang); static mode: falls back to full
    messages and still trains exactly like plain PyTorch, and so does mp's default (fast_mode unset),
    whose shortcut this branch leaves intact (no step has to run again)."""
    results = worlds.run(2, branch_change, mode, timeout=180)
    replay = RECORD_STEPS + 1  # the step whose branch differs from the recording
    for r in results:
        want = r["ref_losses"]
        assert r["relearned"] == 0, r
        if mode == "fast":
            assert r["error"] is not None, f"rank {r['rank']}: no error"
            assert r["error"][0] == replay, r["error"]
            assert "'fast_mode' to False" in r["error"][1], r["error"][1]
            want = want[:replay]
        else:
            assert r["error"] is None, r["error"]
            assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6), r
