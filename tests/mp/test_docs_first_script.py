"""The first script of docs/getting_started.md runs as printed, on 2 ranks (pp=2), and its loss falls."""

from __future__ import annotations

import re
from pathlib import Path

from tests._harness import run_script

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "getting_started.md"


def _first_script() -> str:
    section = GUIDE.read_text(encoding="utf-8").split("## Your first script", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/getting_started.md has no python block under 'Your first script'"
    return match.group(1)


def test_the_getting_started_script_trains_on_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_first_script(), encoding="utf-8")
    output, code, _ = run_script(script, 2, env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert code == 0, output
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)$", output, re.M)]
    assert len(losses) == 5, output
    assert losses[-1] < losses[0] - 0.1, losses
