"""mp-memory's checkpoint engine on its own (mp-comm and mp-memory installed, one process): atomic
publication, manifests, the damage each check catches, loading that runs no code, smp's file names,
and rotation that never deletes the last complete checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mp_memory.checkpoint import (
    CheckpointFolder,
    Layout,
    load_full,
    load_partial,
    prune,
    read_newest,
    remove_stale,
    save_folder,
    save_full,
    save_partial,
)
from mp_memory.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointLayoutError,
    CheckpointMissingError,
    UntrustedCheckpointError,
)
from mp_memory.checkpoint.zipcheck import directory_record

STATE = {"w": torch.arange(1000, dtype=torch.float32), "step": 3, "names": ["a", "b"]}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["w"], b["w"]) and a["step"] == b["step"] and a["names"] == b["names"]


def test_full_round_trip_writes_a_manifest_and_no_temporary_file(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    save_full(STATE, path, 0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.mp-manifest.json"]
    manifest = json.loads((tmp_path / "ckpt.mp-manifest.json").read_text())
    record = directory_record(str(tmp_path / "ckpt"))
    assert manifest["parts"]["ckpt"] == {"size": record.size, "crc32": record.crc32}
    assert record.size == (tmp_path / "ckpt").stat().st_size
    assert _equal(load_full(path, trusted=False), STATE)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:-100])
    elif how.startswith("flip"):  # 4 bytes: in tensor data, in the zip directory, in its end record
        i = {"flip": len(data) // 2, "flip-directory": len(data) - 200, "flip-end": len(data) - 12}[how]
        path.write_bytes(data[:i] + bytes(b ^ 0x5A for b in data[i : i + 4]) + data[i + 4 :])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()


@pytest.mark.parametrize(
    ("how", "error", "words"),
    [
        ("truncate", CheckpointCorruptError, "(truncated)"),
        ("flip", CheckpointCorruptError, "is corrupted: its CRC-32"),
        ("flip-directory", CheckpointCorruptError, "is corrupted"),
        ("flip-end", CheckpointCorruptError, "is corrupted"),
        ("empty", CheckpointCorruptError, "is empty"),
        ("delete", CheckpointMissingError, "does not exist"),
    ],
)
def test_damage_is_named(tmp_path: Path, how: str, error: type[Exception], words: str) -> None:
    path = tmp_path / "ckpt"
    save_full(STATE, str(path), 0)
    _damage(path, how)
    with pytest.raises(error, match=r"ckpt") as info:
        load_full(str(path), trusted=False)
    assert words in str(info.value), str(info.value)


def test_damage_without_a_manifest_still_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "legacy"
    torch.save(STATE, path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointCorruptError, match=r"legacy.*is damaged"):
        load_full(str(path), trusted=False)
    path.write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="is empty"):
        load_full(str(path), trusted=False)


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_no_code_runs_unless_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    path = str(tmp_path / "ckpt")
    save_full({"x": Payload(str(marker))}, path, 0)
    with pytest.raises(UntrustedCheckpointError, match="trust_file=True"):
        load_full(path, trusted=False)
    assert not marker.exists()
    load_full(path, trusted=True)  # the documented opt-in
    assert marker.exists()


def test_mp_metadata_goes_through_an_allow_list(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    save_full({"_smp_is_partial": "yes"}, path, 0)
    with pytest.raises(CheckpointCorruptError, match="_smp_is_partial"):
        load_full(path, trusted=False)


def test_partial_single_process_and_smp_names(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    save_partial(STATE, path, Layout(), None, group_rank=0, v3=False)
    assert sorted(os.listdir(tmp_path)) == ["f.mp-manifest.json", "f_0_0_0"]
    assert _equal(load_partial(path, Layout(), trusted=False), STATE)


@pytest.mark.parametrize(
    "names", [["f_0_0_0", "f_1_0_0"], ["f_0_0", "f_1_0"], ["f_0", "f_1"], ["f_0_0.pt", "f_1_0.pt"]]
)
def test_every_smp_naming_is_read(tmp_path: Path, names: list[str]) -> None:
    """smp >= 1.10 (three indices), smp < 1.10 (two), smp before TP (mp_rank), mp's earlier .pt names."""
    for i, name in enumerate(names):
        torch.save({"part": i}, tmp_path / name)
    for pp_rank in (0, 1):
        got = load_partial(str(tmp_path / "f"), Layout(pp_rank=pp_rank, pp=2), trusted=False)
        assert got == {"part": pp_rank}
    with pytest.raises(CheckpointLayoutError, match="pipeline_parallel_degree=2"):
        load_partial(str(tmp_path / "f"), Layout(), trusted=False)


def test_a_missing_legacy_part_is_named(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "f_0_0_0")
    torch.save({}, tmp_path / "f_2_0_0")
    with pytest.raises(CheckpointMissingError, match="f_1_0_0"):
        load_partial(str(tmp_path / "f"), Layout(pp=3), trusted=False)


def test_a_torn_save_is_refused_not_mixed(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    save_partial(STATE, path, Layout(), None, group_rank=0, v3=False)
    (tmp_path / "f.mp-manifest.json").write_text(
        json.dumps({"format": "mp-checkpoint", "version": 1, "state": "writing"})
    )
    with pytest.raises(CheckpointMissingError, match="did not complete"):
        load_partial(path, Layout(), trusted=False)


def test_folder_rotation_keeps_the_last_complete_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path)
    for i in range(3):
        save_folder(path, f"t{i}", Layout(), None, {"model_0_0_0.pt": STATE}, partial=True, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["newest", "t1_partial", "t2_partial"]
    assert read_newest(path) == "t2"
    # A torn later save (no manifest: killed before publishing) neither counts nor is removed by rotation,
    # and leftover staging folders go at the next save.
    os.makedirs(tmp_path / "t3_partial")
    os.makedirs(tmp_path / "t4_partial.tmp-deadbeef")
    assert prune(path, 1, "t2") == ["t1_partial"]
    assert sorted(os.listdir(tmp_path)) == ["newest", "t2_partial", "t3_partial", "t4_partial.tmp-deadbeef"]
    assert remove_stale(path) == ["t4_partial.tmp-deadbeef"]
    ckpt = CheckpointFolder(path, "t2", partial=True)
    ckpt.check()
    assert _equal(ckpt.load("model_0_0_0.pt"), STATE)


def test_full_folder_carries_its_manifest(tmp_path: Path) -> None:
    path = str(tmp_path)
    files = {"t": {"w": torch.ones(3)}, "optimizer_t": {"state": {}}, "user_content_t": {"step": 1}}
    save_folder(path, "t", Layout(), None, files, partial=False, keep=None)
    assert sorted(os.listdir(tmp_path)) == ["manifest_t.json", "newest", "optimizer_t", "t", "user_content_t"]
    ckpt = CheckpointFolder(path, "t", partial=False)
    _damage(tmp_path / "optimizer_t", "truncate")
    with pytest.raises(CheckpointCorruptError, match="optimizer_t"):
        ckpt.check()


def test_a_failed_folder_save_leaves_nothing(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> Any:
            raise TypeError("no")

    with pytest.raises(TypeError):
        save_folder(
            str(tmp_path), "t", Layout(), None, {"model_0_0_0.pt": Unpicklable()}, partial=True, keep=1
        )
    assert os.listdir(tmp_path) == []


def test_smp_load_of_a_full_folder_checkpoint_uses_its_manifest(tmp_path: Path) -> None:
    save_folder(str(tmp_path), "t", Layout(), None, {"t": STATE}, partial=False, keep=None)
    _damage(tmp_path / "t", "flip")
    with pytest.raises(CheckpointCorruptError, match="is corrupted"):
        load_full(str(tmp_path / "t"), trusted=False)
