"""Write the checkpoint fixtures (see recipes.py), from the repository root:
``mpiexec -n 2 python -m tests.checkpoint_fixtures.generate``.
It refuses to overwrite a kind that exists."""

from __future__ import annotations

import os
import sys

import torch

import mp as smp
from tests.checkpoint_fixtures.recipes import FOLDER, KINDS, SAVE_AT, STEPS, build, full_state, train


def main(kinds: list[str]) -> None:
    for kind in kinds:
        folder = os.path.join(FOLDER, kind)
        if os.path.exists(folder):
            raise SystemExit(f"{folder} exists: the fixtures are what an older mp wrote; keep them")
        model, opt = build(kind, 0)
        losses = train(kind, model, opt, range(SAVE_AT))
        partial = KINDS[kind]["partial"]
        smp.save_checkpoint(
            folder, "step2", partial=partial, model=model, optimizer=opt, user_content={"step": 2}
        )
        losses += train(kind, model, opt, range(SAVE_AT, STEPS))
        expected = {"state": full_state(model), "losses": losses}
        if smp.rank() == 0:
            torch.save(expected, os.path.join(folder, "expected.pt"))
        smp.reset()


if __name__ == "__main__":
    main(sys.argv[1:] or list(KINDS))
