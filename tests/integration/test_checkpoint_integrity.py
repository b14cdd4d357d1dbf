"""A damaged checkpoint is refused on every rank, naming the file and what is wrong, before any parameter
changes: one rank's part truncated, with flipped bytes, emptied or deleted; a pickle payload planted in
a part (with a manifest forged to match) does not run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import mp as smp
from mp_memory.checkpoint.zipcheck import directory_record
from tests.integration._checkpoint_job import build_job, train_once


def _save(world: Any, folder: str) -> None:
    model, opt = build_job(0)
    train_once(model, opt, 1)
    smp.save_checkpoint(folder, "step1", model=model, optimizer=opt, user_content={"step": 1})
    smp.reset()


def _try_resume(world: Any, folder: str) -> dict[str, Any]:
    model, _ = build_job(1)
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    out: dict[str, Any] = {}
    try:
        smp.resume_from_checkpoint(folder)
        out["error"] = None
    except smp.SMPCheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["class"] = type(exc)
    now = model.module.state_dict()
    out["unchanged"] = all(torch.equal(v, now[k]) for k, v in before.items())
    smp.reset()
    return out


@pytest.fixture(scope="module")
def saved(worlds: Any, tmp_path_factory: Any) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    worlds.run(2, _save, str(folder), timeout=120)
    return Path(folder)


def _damage(part: Path, how: str) -> None:
    data = part.read_bytes()
    if how == "truncate":
        part.write_bytes(data[: len(data) // 2])
    elif how == "flip":  # 4 bytes in the middle of the tensor data, size unchanged
        i = len(data) // 2
        part.write_bytes(data[:i] + bytes(b ^ 0xFF for b in data[i : i + 4]) + data[i + 4 :])
    elif how == "empty":
        part.write_bytes(b"")
    else:
        part.unlink()


REASONS = {
    "truncate": "(truncated)",
    "flip": "is corrupted: its CRC-32",
    "empty": "is empty",
    "delete": "is missing",
}
CLASSES = {  # docs/checkpoint.md's table: the class every rank raises
    "truncate": smp.CorruptCheckpointError,
    "flip": smp.CorruptCheckpointError,
    "empty": smp.CorruptCheckpointError,
    "delete": smp.MissingCheckpointFilesError,
}


@pytest.mark.parametrize("name", ["model_1_0_0.pt", "optimizer_0_0_0.pt"])
@pytest.mark.parametrize("how", list(REASONS))
def test_a_damaged_part_is_named_on_every_rank(
    worlds: Any, saved: Path, tmp_path: Path, name: str, how: str
) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    _damage(folder / "step1_partial" / name, how)
    for rank, r in enumerate(worlds.run(2, _try_resume, str(folder), timeout=120)):
        assert r["error"] is not None and name in r["error"] and REASONS[how] in r["error"], (rank, r)
        # the same class on the rank that read the damaged part and on the other (which used to raise
        # the base SMPCheckpointError): `except smp.CorruptCheckpointError` catches it everywhere
        assert r["class"] is CLASSES[how], (rank, r)
        assert r["unchanged"], (rank, r)


class Payload:
    """Unpickling this would create ``marker``: the stand-in for code an attacker runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_a_planted_pickle_payload_does_not_run(worlds: Any, saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    marker = tmp_path / "pwned"
    part = folder / "step1_partial" / "model_1_0_0.pt"
    state = torch.load(part, weights_only=True)
    state["b.weight"] = Payload(str(marker))
    torch.save(state, part)
    # The attacker rewrites the manifest too, so the checksums pass: weights_only must still refuse.
    manifest_path = folder / "step1_partial" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    record = directory_record(str(part))
    manifest["parts"]["model_1_0_0.pt"] = {"size": record.size, "crc32": record.crc32}
    manifest_path.write_text(json.dumps(manifest))
    results = worlds.run(2, _try_resume, str(folder), timeout=120)
    assert not marker.exists(), "the payload ran"
    for r in results:
        assert "model_1_0_0.pt" in r["error"] and "trust_file=True" in r["error"], r
        assert r["unchanged"], r
    assert os.listdir(tmp_path) == ["ckpt"]
