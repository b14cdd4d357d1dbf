"""mp-memory's background saves on their own (one process): the staged copy is what gets written, whatever
happens to the state afterwards; buffers are reused between saves; a background failure is raised by
``wait`` once; the next save waits for the one in flight."""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest
import torch

from mp_memory.checkpoint import BackgroundSave, CheckpointFolder, Layout, read_newest, save_folder


def _state() -> dict[str, object]:
    w = torch.arange(1000, dtype=torch.float32)
    sd = collections.OrderedDict([("w", w), ("tied", w), ("b", torch.ones(3, 4)[:, 1])])
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # torch's state-dict metadata
    return {"model": sd, "step": 7, "groups": [{"lr": 0.1, "params": [0]}], "pair": (torch.zeros(2), "x")}


def test_the_staged_copy_is_written_not_the_live_state(tmp_path: Path) -> None:
    live = _state()
    saver = BackgroundSave()
    staged = saver.stage({"model_0_0_0.pt": live})
    gate = threading.Event()

    def write() -> None:
        gate.wait(30)  # the state changes before the write starts
        save_folder(str(tmp_path), "t", Layout(), None, staged, partial=True, keep=None)

    saver.start(write, "test save")
    model = live["model"]
    assert isinstance(model, dict)
    model["w"].add_(1.0)  # an optimizer step, in place
    model["b"].zero_()
    live["step"] = 8
    groups = live["groups"]
    assert isinstance(groups, list)
    groups[0]["lr"] = 0.5
    gate.set()
    saver.wait()
    got = CheckpointFolder(str(tmp_path), "t", partial=True).load("model_0_0_0.pt")
    assert torch.equal(got["model"]["w"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(got["model"]["b"], torch.ones(3))
    assert got["model"]["tied"] is got["model"]["w"]  # one tensor reached twice stays one
    assert got["step"] == 7 and got["groups"] == [{"lr": 0.1, "params": [0]}]
    assert got["pair"][1] == "x" and torch.equal(got["pair"][0], torch.zeros(2))
    assert read_newest(str(tmp_path)) == "t"


def test_buffers_are_reused_and_keep_the_mapping_type() -> None:
    saver = BackgroundSave()
    live = _state()
    first = saver.stage(live)
    saver.start(lambda: None, "nothing")
    saver.wait()
    second = saver.stage(live)
    assert first["model"]["w"].data_ptr() == second["model"]["w"].data_ptr()
    assert type(second["model"]) is collections.OrderedDict
    assert second["model"]._metadata == {"": {"version": 1}}
    model = live["model"]
    assert isinstance(model, dict)
    model["w"] = torch.zeros(5)  # another shape: a new buffer
    third = saver.stage(live)
    assert (
        third["model"]["w"].shape == (5,) and third["model"]["w"].data_ptr() != first["model"]["w"].data_ptr()
    )


def test_a_background_failure_is_raised_by_wait_once() -> None:
    saver = BackgroundSave()

    def fail() -> None:
        raise OSError(28, "No space left on device")

    saver.start(fail, "test save")
    assert saver.in_flight
    with pytest.raises(OSError, match="No space left"):
        saver.wait()
    assert not saver.in_flight
    saver.wait()  # reported once


def test_staging_while_a_save_is_in_flight_is_refused() -> None:
    saver = BackgroundSave()
    gate = threading.Event()
    saver.start(lambda: gate.wait(30) and None, "slow save")
    with pytest.raises(AssertionError, match="wait"):
        saver.stage({"w": torch.ones(2)})
    gate.set()
    saver.wait()
