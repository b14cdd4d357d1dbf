"""``smp.save_checkpoint(..., async_save=True)`` on real processes (pp=2, 2 ranks).

- what is written is the state at the call, though training steps run before the write starts, and a
  resume from it trains on exactly as the run that never stopped; a second async save waits for the first;
- a write that fails in the background on one rank (a file size limit: a full disk) reaches every rank
  at ``smp.wait_checkpoint()`` and, for the next failure, at the next save; ``newest`` keeps the last good
  checkpoint; so does state that cannot be copied on one rank;
- the process ends only once the save is published, and a failed last save ends it with status 1.

The crash-at-any-moment cases of the background save are in test_checkpoint_faults.py (mode ``async``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import mp as smp
from mp_memory import checkpoint as engine
from tests.integration._checkpoint_job import build_job, own_keys, state_copy, train_once


@contextlib.contextmanager
def _writes_held(gate: threading.Event) -> Iterator[None]:
    """Background writes start only once ``gate`` is set (so training steps surely run first)."""
    original = engine.save_folder

    def held(*args: Any, **kwargs: Any) -> None:
        assert gate.wait(120), "the gate was never opened"
        original(*args, **kwargs)

    engine.save_folder = held  # type: ignore[assignment]
    try:
        yield
    finally:
        engine.save_folder = original  # type: ignore[assignment]


def _train_saving(world: Any, folder: str) -> dict[str, Any]:
    model, opt = build_job(0)
    for i in (1, 2, 3):
        train_once(model, opt, i)
    at_call = state_copy(model)
    gate = threading.Event()
    with _writes_held(gate):
        smp.save_checkpoint(
            folder, "step3", model=model, optimizer=opt, user_content={"step": 3}, async_save=True
        )
        for i in (4, 5, 6):  # while the save is in flight, before it writes anything
            train_once(model, opt, i)
        gate.set()
        smp.save_checkpoint(
            folder, "step6", model=model, optimizer=opt, user_content={"step": 6}, async_save=True
        )
    smp.wait_checkpoint()
    final = state_copy(model)
    smp.reset()
    return {"at_call": at_call, "final": final, "listing": sorted(os.listdir(folder))}


def _resume_and_train(world: Any, folder: str, at_call: dict[str, Any]) -> dict[str, Any]:
    model, opt = build_job(1)
    step = smp.resume_from_checkpoint(folder, tag="step3")["step"]
    got = model.module.state_dict()
    wrong = [k for k, v in own_keys(at_call).items() if not torch.equal(v, got[k])]
    for i in (4, 5, 6):
        train_once(model, opt, i)
    final = state_copy(model)
    smp.reset()
    return {"step": step, "wrong_at_load": wrong, "final": final}


def test_async_save_writes_the_state_at_the_call_and_resumes_exactly(worlds: Any, tmp_path: Path) -> None:
    saved = worlds.run(2, _train_saving, str(tmp_path), timeout=180)
    assert saved[0]["listing"] == ["newest", "step3_partial", "step6_partial"], saved[0]["listing"]
    assert (tmp_path / "newest").read_text() == "step6"
    at_call, final = saved[0]["at_call"], saved[0]["final"]
    assert any(not torch.equal(v, final[k]) for k, v in at_call.items()), "training did not change the state"
    resumed = worlds.run(2, _resume_and_train, str(tmp_path), at_call, timeout=180)
    for rank, r in enumerate(resumed):
        assert r["step"] == 3 and r["wrong_at_load"] == [], (rank, r["wrong_at_load"])
        differ = [k for k, v in final.items() if not torch.equal(v, r["final"][k])]
        assert differ == [], (rank, differ)  # bitwise: the same steps from the same state


@contextlib.contextmanager
def _file_size_limit(on: bool) -> Iterator[None]:
    """Writes of regular files past 1 KB fail on this rank (EFBIG, as ENOSPC on a full disk)."""
    if not on:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _error(call: Any) -> str | None:
    try:
        call()
    except smp.SMPCheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _failing_saves(world: Any, folder: str) -> dict[str, Any]:
    model, opt = build_job(0)
    train_once(model, opt, 1)
    smp.save_checkpoint(folder, "step1", model=model, optimizer=opt)
    out: dict[str, Any] = {}
    full = smp.rank() == 1
    with _file_size_limit(full):
        smp.save_checkpoint(folder, "step2", model=model, optimizer=opt, async_save=True)  # returns
        train_once(model, opt, 2)
        out["wait"] = _error(smp.wait_checkpoint)
        out["wait_again"] = _error(smp.wait_checkpoint)  # reported once
        smp.save_checkpoint(folder, "step3", model=model, optimizer=opt, async_save=True)
        train_once(model, opt, 3)
        out["next_save"] = _error(lambda: smp.save_checkpoint(folder, "step4", model=model, optimizer=opt))
    out["newest_after_failures"] = (Path(folder) / "newest").read_text()
    smp.save_checkpoint(folder, "step5", model=model, optimizer=opt, async_save=True)
    smp.wait_checkpoint()
    # user_content (rank 0's part) that cannot be copied: the call returns, every rank learns it at wait
    lock = {"lock": threading.Lock()}
    smp.save_checkpoint(folder, "step6", model=model, optimizer=opt, user_content=lock, async_save=True)
    out["uncopyable"] = _error(smp.wait_checkpoint)
    out["listing"] = sorted(os.listdir(folder))
    smp.reset()
    return out


def test_a_background_failure_reaches_every_rank(worlds: Any, tmp_path: Path) -> None:
    results = worlds.run(2, _failing_saves, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        wait, nxt = r["wait"], r["next_save"]
        assert wait is not None and "tag='step2'" in wait, (rank, wait)
        assert "rank 1 could not write checkpoint file" in wait and "file size limit" in wait, (rank, wait)
        assert r["wait_again"] is None, (rank, r)
        assert nxt is not None and "the background save before" in nxt and "tag='step4'" in nxt, (rank, nxt)
        assert "tag='step3'" in nxt and "rank 1 could not write checkpoint file" in nxt, (rank, nxt)
        assert r["newest_after_failures"] == "step1", (rank, r)
        bad = r["uncopyable"]
        assert bad is not None and "tag='step6'" in bad and "rank 0: TypeError" in bad, (rank, bad)
    assert results[0]["listing"] == ["newest", "step1_partial", "step5_partial"], results[0]["listing"]
    assert (tmp_path / "newest").read_text() == "step5"


EXIT_SCRIPT = r"""
import resource, signal, sys
import torch
import mp as smp

folder, mode = sys.argv[1], sys.argv[2]
smp.init({})
if mode == "fail":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
smp.save_checkpoint(folder, "last", user_content={"w": torch.ones(1 << 24)}, async_save=True)
print("script ended", flush=True)
"""


def test_the_process_ends_after_the_background_save(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    for mode in ("ok", "fail"):
        folder = tmp_path / mode
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, str(folder), mode],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        out = proc.stdout + proc.stderr
        assert "script ended" in proc.stdout, out[-3000:]
        if mode == "ok":
            assert proc.returncode == 0, out[-3000:]
            assert (folder / "newest").read_text() == "last"
            assert sorted(os.listdir(folder / "last_partial")) == ["manifest.json", "user_content.pt"]
        else:
            assert proc.returncode == 1, out[-3000:]
            assert "could not write checkpoint file" in out and "exits with status 1" in out, out[-3000:]
            assert not (folder / "newest").exists() and not (folder / "last_partial").exists()
