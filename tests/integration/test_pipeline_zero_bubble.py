"""``"pipeline": "zero_bubble"`` (mp's addition): each remote call's owner sends the input gradients
first and computes the weight gradients later, when it would otherwise wait; training still equals plain
single-process PyTorch (the check of test_pipeline_equivalence: every step's loss and every parameter
after 3 optimizer steps)."""

from __future__ import annotations

from typing import Any

import pytest

from mp.state import state
from tests.integration._equivalence import train_and_compare
from tests.mp_pipeline.models import STEPS

REPLAYED_STEPS = 6
"""The default path's cases run past per-rank replay's learning: steps 5 and 6 are replayed."""


def train_zero_bubble(world: Any, name: str, pp: int, microbatches: int, mode: str) -> dict[str, Any]:
    result = train_and_compare(
        world,
        name,
        pp,
        microbatches,
        "zero_bubble",
        optimizer_first=microbatches != 2,
        layers=4 if pp == 4 else 2,
        mode=mode,
        steps=REPLAYED_STEPS if mode == "default" else STEPS,
    )
    runtime = state.model._runtime if state.model is not None else None
    weights = runtime.remote.weights if runtime is not None else None
    result["pp_rank"] = runtime.pp_rank if runtime is not None else 0
    result["weights"] = None if weights is None else (weights.ran_idle, weights.ran_early, weights.ran_at_end)
    return result


CASES = [
    # (ranks, model, pp, microbatches, mode, split): "dynamic" = the full path (fast_mode false),
    # "default" = the users' default (fast mode's plan, per-rank replay); split: whether the owners'
    # calls split. T5's call on rank 1 calls the shared embedding back on rank 0: that nested call's
    # backward goes out in the input half (split_backward's must_run)
    (2, "mlp", 2, 4, "dynamic", True),
    (2, "reuse", 2, 4, "default", True),  # module reuse: microbatches take different branches
    (2, "gpt2", 2, 4, "dynamic", True),  # HF GPT-2 (tied input and output embeddings)
    (2, "t5", 2, 2, "dynamic", True),  # shared embedding across encoder, decoder and LM head
    (4, "gpt2", 2, 2, "dynamic", True),  # pp=2 with 2 data-parallel replicas
    (4, "gpt2", 4, 4, "default", True),  # pp=4: outputs handed child to child across ranks, replay
]


@pytest.mark.parametrize(("n", "name", "pp", "microbatches", "mode", "split"), CASES)
def test_zero_bubble_equals_plain_pytorch(  # noqa: PLR0917 - pytest parameters
    worlds: Any, n: int, name: str, pp: int, microbatches: int, mode: str, split: bool
) -> None:
    results = worlds.run(n, train_zero_bubble, name, pp, microbatches, mode, timeout=240)
    for r in results:
        assert r["loss"] is None, f"rank {r['rank']}: {r['loss']}"
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["weights"] is not None, f"rank {r['rank']}: no weight queue under zero_bubble"
    owners = [r for r in results if r["pp_rank"] > 0]
    if split:  # the calls pp_rank 0 sent were split on their owners, and some halves filled a wait there
        assert all(sum(r["weights"]) > 0 for r in owners), results
        assert sum(r["weights"][0] for r in owners) > 0, results
    else:
        assert all(sum(r["weights"]) == 0 for r in owners), results
