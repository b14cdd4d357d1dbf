"""Checkpoints that an older mp wrote keep loading: each kind in tests/checkpoint_fixtures/v1 (partial and
full under TP, partial under pp, sharded data parallelism in fp32 and bf16), written by
tests/checkpoint_fixtures/generate.py with the mp of commit a63c4a4, resumes with today's mp and trains
its third step to the model state and loss that the saving job reached (fp32 within 1e-6, bf16's masters
through the half parameters within 1e-6 of the saving job's)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

import mp as smp
from tests.checkpoint_fixtures.recipes import FOLDER, KINDS, SAVE_AT, STEPS, build, full_state, train

pytest.importorskip("transformers")

CASES = [
    # fixture, resuming config and model (None: the saving job's)
    *((kind, None, None) for kind in KINDS),
    ("partial_tp2", {"ddp": True}, "gpt2"),  # tp 2 -> 1 into the plain Hugging Face model
    ("partial_tp2", {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}, "gpt2"),
    ("full_tp2", {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}, "gpt2"),
]


def _resume(world: Any, kind: str, folder: str, config: dict[str, Any] | None, model: str | None) -> Any:
    net, opt = build(kind, 1, config, model)  # another init: only the checkpoint makes the runs equal
    user = smp.resume_from_checkpoint(folder, partial=KINDS[kind]["partial"])
    losses = train(kind, net, opt, range(user["step"], STEPS))
    out = {"losses": losses, "state": full_state(net)}
    smp.reset()
    return out


@pytest.mark.parametrize(("kind", "config", "model"), CASES, ids=str)
def test_an_older_checkpoint_resumes(
    worlds: Any, tmp_path: Any, kind: str, config: dict[str, Any] | None, model: str | None
) -> None:
    folder = str(tmp_path / kind)
    shutil.copytree(os.path.join(FOLDER, kind), folder)
    expected = torch.load(os.path.join(folder, "expected.pt"), weights_only=True)
    for rank, r in enumerate(worlds.run(2, _resume, kind, folder, config, model, timeout=240)):
        torch.testing.assert_close(
            torch.tensor(r["losses"]),
            torch.tensor(expected["losses"][SAVE_AT:]),
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m, rank=rank: f"rank {rank} losses: {m}",
        )
        assert sorted(r["state"]) == sorted(expected["state"])
        for key, value in expected["state"].items():
            torch.testing.assert_close(
                r["state"][key],
                value,
                rtol=1e-6,
                atol=1e-6,
                msg=lambda m, k=key, rank=rank: f"rank {rank} {k}: {m}",
            )
