"""The standalone command: presets to JSON, JSON to the search table, errors as exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mp_tensor.atp import CommMatrix
from mp_tensor.atp.cli import PRESETS, main

SHAPE = ["--layers", "24", "--batch", "4", "--seq", "2048", "--hidden", "4096"]


def test_preset_then_search_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = tmp_path / "fig7a.json"
    assert main(["preset", "--preset", "fig7a", "-o", str(topo)]) == 0
    assert CommMatrix.load(topo).num_devices == 16
    assert main(["search", "--topology", str(topo), *SHAPE]) == 0
    table = capsys.readouterr().out
    assert "16 devices on 4xnvlink-4gpu-ib200" in table
    assert any(line.startswith("*") and "(4, 4)" in line for line in table.splitlines())
    assert main(["search", "--topology", str(topo), "--devices", "8", "--json", *SHAPE]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["n_devices"] == 8 and len(data["table"]) == 4


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_searches(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "--preset", name, *SHAPE]) == 0
    assert "T_comm ms" in capsys.readouterr().out


def test_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["search", "--topology", str(bad), *SHAPE]) == 2
    assert "not a communication matrix" in capsys.readouterr().err
    assert main(["search", "--preset", "nvswitch", "--devices", "32", *SHAPE]) == 2
    assert "exceeds the 8 devices" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mp_tensor.atp", "search", "--preset", "torus", *SHAPE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "torus-4x4" in done.stdout
