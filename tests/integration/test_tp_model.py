"""Tensor parallelism through smp.DistributedModel: a HuggingFace GPT-2 built under
`smp.tensor_parallelism()` trains exactly like single-process PyTorch, with tp=2 alone and with
tp=2 x pp=2 (also under fast mode, whose child-to-child shortcut then carries TP shards' activations),
each tp rank holding different samples (TP across data-parallel ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration._tp_model import CLIP, STEPS, _reference, _train, assert_losses


@pytest.mark.parametrize(
    ("n", "pp", "microbatches", "clip", "fast"),
    [
        (2, 1, 1, False, False),
        (2, 1, 2, False, False),
        (4, 2, 2, False, False),
        (4, 2, 2, True, False),
        (4, 2, 2, False, True),
    ],
)
def test_tensor_parallel_gpt2_trains_like_single_process(  # noqa: PLR0917 - pytest parameters
    worlds: Any, n: int, pp: int, microbatches: int, clip: bool, fast: bool
) -> None:
    # fast mode learns its plan in step 1 and follows it from step 2; a step that fails under the plan
    # runs again on the full path and the plan is learned again (steps 3 and 4)
    steps = 4 if fast else STEPS
    results = worlds.run(n, _train, pp, microbatches, clip, fast, "cpu", steps, timeout=240)
    ref_losses, ref_state, ref_norms = _reference(results[0]["dp"], clip, 4 if fast else 2, "cpu", steps)
    assert all(n > CLIP for n in ref_norms)
    if fast:  # pp_rank 0 of each pipeline passes block outputs on to the next block on pp_rank 1
        retries = [res["retries"] for res in results]
        assert results[0]["shortcuts"] > 0, f"no step followed the plan; steps run again, per rank: {retries}"
    for r, res in enumerate(results):
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {r} clipped norms"
        assert_losses(res["losses"], ref_losses, r)
        if "state" in res:
            assert set(res["state"]) == set(ref_state)
            for key, value in ref_state.items():
                torch.testing.assert_close(
                    res["state"][key],
                    value,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, r=r, key=key: f"rank {r} parameter {key}: {m}",
                )
