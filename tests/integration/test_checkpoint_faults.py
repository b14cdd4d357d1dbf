"""Crash safety and integrity of smp's checkpoints on real processes.

- kill -9 (``os._exit`` through ``MP_CHECKPOINT_FAULT``) one rank in the middle of a save, at each point
  of the save: the previous checkpoint still resumes, exactly, and ``newest`` never names a torn one;
- truncate, flip bytes in, empty or delete one rank's part: every rank raises an error naming the file
  and what is wrong, before any parameter changes;
- a pickle payload planted in a part does not run;
- the rank that survives a kill during an async save ends by itself, with its error, even under a
  launcher that does not end the job when one rank dies.

This module is also the crashing script: ``python test_checkpoint_faults.py FOLDER MODE POINT`` under
mpiexec saves step 10, then dies at POINT while saving step 20. MODE ``async`` saves with
``async_save=True`` and trains on while the save runs in the background (where the rank dies); the
first background write is held back 2 s, so step 20 arrives with it in flight.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mp as smp
from mp.errors import SMPCheckpointError
from tests.integration._checkpoint_job import build_job, own_keys, state_copy, train_once


def _save(model: Any, opt: Any, folder: str, mode: str, step: int) -> None:
    if mode in {"folder", "async"}:
        smp.save_checkpoint(
            folder,
            f"step{step}",
            model=model,
            optimizer=opt,
            user_content={"step": step},
            num_kept_partial_checkpoints=1,
            async_save=mode == "async",
        )
    else:  # smp.save to a fixed name, every rank
        smp.save(
            {"model": model.local_state_dict(), "step": step}, os.path.join(folder, "ckpt"), partial=True
        )


def _slow_first_write() -> None:
    """Delay the background write of step 10 by 2 s on every rank, as a loaded host does: steps 11 and
    20 run while it is written, and step 20 arrives with it in flight (where the fault hook, armed too
    early, killed the first save instead of the second)."""
    from mp_memory import checkpoint as engine

    save_folder = engine.save_folder

    def slow(path: str, tag: str, *args: Any, **kwargs: Any) -> None:
        if tag == "step10":
            time.sleep(2.0)
        save_folder(path, tag, *args, **kwargs)

    engine.save_folder = slow


def main(folder: str, mode: str, point: str) -> None:
    """Save at steps 10 and 20 (recording the expected parameters), dying at ``point`` in the second."""
    if mode == "async":
        _slow_first_write()
    model, opt = build_job(0)
    for step in (10, 20):
        train_once(model, opt, step)
        expected = state_copy(model)
        if smp.rank() == 0:
            torch.save(expected, os.path.join(folder, f"expected{step}"))
        smp.barrier()
        if step == 20:
            # The fault hook fires in whichever save reaches the point first: arm it only once step 10's
            # background save is published, or a slow one (a loaded host) dies instead, with no
            # checkpoint before it to keep. Steps 11 and 20 still ran while step 10 was written.
            smp.wait_checkpoint()
            os.environ["MP_CHECKPOINT_FAULT"] = point
        _save(model, opt, folder, mode, step)
        if mode == "async":  # the next step runs while the save is written: it must not change it
            train_once(model, opt, step + 1)
    smp.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.exit(0)


# ----------------------------------------------------------------------------------------- the tests
def _crash(folder: Path, mode: str, point: str, *, launcher_ends_job: bool = True) -> str:
    """Run this module as the script on 2 ranks; return its output (it must have died). A job that does not
    end fails with every live process's stacks (tests._harness.run_job).

    ``launcher_ends_job=False`` runs it under ``mpiexec -disable-auto-cleanup``: mpiexec then does not end
    the other rank when one dies, and the job ends only if mp itself ends the survivor."""
    from tests._harness import mpiexec, run_job

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cleanup = [] if launcher_ends_job else ["-disable-auto-cleanup"]
    command = [mpiexec(), *cleanup, "-n", "2", sys.executable, __file__, str(folder), mode, point]
    out, returncode = run_job(command, env=env, timeout=240)
    assert returncode != 0, f"no rank died at {point}:\n{out[-3000:]}"
    assert f"exits at {point.split(':', maxsplit=1)[0]}" in out, out[-3000:]
    return out


def _resume(world: Any, folder: str, mode: str) -> dict[str, Any]:
    """Load what ``newest`` (or the fixed name) holds; the rank's own parameters must be exactly those
    saved at that step (compared before the first step, which would change them)."""
    model, _ = build_job(1)
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    try:
        if mode in {"folder", "async"}:
            step = smp.resume_from_checkpoint(folder)["step"]
        else:
            loaded = smp.load(os.path.join(folder, "ckpt"), partial=True)
            model.load_state_dict(loaded["model"])
            step = loaded["step"]
    except SMPCheckpointError as exc:
        now = model.module.state_dict()
        unchanged = all(torch.equal(v, now[k]) for k, v in before.items())
        smp.reset()
        return {"error": f"{type(exc).__name__}: {exc}", "unchanged": unchanged}
    expected = torch.load(os.path.join(folder, f"expected{step}"), weights_only=True)
    got = model.module.state_dict()
    wrong = [k for k, v in own_keys(expected).items() if not torch.equal(v, got[k])]
    smp.reset()
    return {"step": step, "wrong": wrong}


@pytest.mark.parametrize("mode", ["folder", "async"])
@pytest.mark.parametrize("point", ["part-half:1", "part-written:1", "agreed:0", "published:0", "newest:0"])
def test_kill_during_save_checkpoint_keeps_the_last_good_one(
    worlds: Any, tmp_path: Path, point: str, mode: str
) -> None:
    _crash(tmp_path, mode, point)
    newest = (tmp_path / "newest").read_text()
    assert newest == ("step20" if point == "newest:0" else "step10"), (newest, sorted(os.listdir(tmp_path)))
    assert not [n for n in os.listdir(tmp_path / f"{newest}_partial") if ".tmp-" in n]
    results = worlds.run(2, _resume, str(tmp_path), "folder", timeout=120)
    assert results == [{"step": int(newest[4:]), "wrong": []}] * 2, results
    # The next save removes what the crash left and keeps one complete checkpoint (keep=1).
    worlds.run(2, _save_again, str(tmp_path), timeout=120)
    names = sorted(os.listdir(tmp_path))
    assert names == ["expected10", "expected20", "newest", "step30_partial"], names


def test_the_survivor_of_a_kill_during_an_async_save_ends_on_its_own(tmp_path: Path) -> None:
    """Rank 0 dies right after publishing step 20's background save, under a launcher that leaves the
    other rank running. Rank 1's background agreement fails ("Connection closed by peer"): it must end
    with status 1 and say why, instead of exiting normally into MPI_Finalize, which would wait for the
    dead rank for ever (mp's heartbeat cannot end it there: Python and its thread have finalized).

    Rank 1 ends one of two ways, by which it notices first: at exit, where the failed save ends the
    process; or in the script's last ``smp.barrier()``, whose gloo connection to the dead rank is reset,
    and mp's handler of the uncaught error ends the job. Either way the save's failure is named."""
    out = _crash(tmp_path, "async", "published:0", launcher_ends_job=False)
    assert "smp.save_checkpoint(" in out and "rank 1 could not agree with the other ranks" in out, out[-3000:]
    at_exit = "[rank 1] mp: smp.save_checkpoint(" in out and (
        "The process exits with status 1: its last checkpoint was not saved" in out
    )
    in_barrier = "failed in the background: CheckpointAgreementError" in out and (
        "[rank 1] mp: uncaught RuntimeError; aborting the MPI job" in out
    )
    assert at_exit or in_barrier, out[-3000:]
    assert (tmp_path / "newest").read_text() == "step10"


def _save_again(world: Any, folder: str) -> None:
    model, opt = build_job(2)
    train_once(model, opt, 30)
    _save(model, opt, folder, "folder", 30)
    smp.reset()


@pytest.mark.parametrize("point", ["part-written:1", "published:1"])
def test_kill_during_smp_save_never_loads_a_mix(worlds: Any, tmp_path: Path, point: str) -> None:
    """Before any part is published the old parts stay whole; after, the manifest says "writing" and
    loading refuses instead of mixing rank 0's step 20 with rank 1's step 10."""
    _crash(tmp_path, "fixed", point)
    results = worlds.run(2, _resume, str(tmp_path), "fixed", timeout=120)
    if point == "part-written:1":
        assert results == [{"step": 10, "wrong": []}] * 2, results
    else:
        for r in results:
            assert (
                r["error"].startswith("MissingCheckpointFilesError") and "did not complete" in r["error"]
            ), r
            assert r["unchanged"], r
