"""Text and picture reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mp_partition import PartitionError, auto_partition, render_plan
from mp_partition.report import display_tree, format_devices

from .models import Stack, TiedLM


def test_format_devices() -> None:
    assert format_devices((0, 1, 2, 3, 6)) == "0-3,6"
    assert format_devices((5,)) == "5"
    assert format_devices((1, 3)) == "1,3"


def test_text_report_groups_layers_like_the_seed_figures() -> None:
    plan = auto_partition(Stack(layers=12), 3, example_args=(torch.randn(2, 16),))
    text = plan.report()
    assert "Partition plan: Stack" in text and "into 3 partitions" in text
    assert "layers[0:4] (Block x4)" in text and "layers[8:12] (Block x4)" in text
    assert "{0-2}" in text
    for i in range(3):
        assert f"       p{i}" in text
    assert "max/mean" in text
    assert "layers.0.up" not in text  # collapsed: whole subtree on one partition
    full = plan.report(full=True)
    assert "up (Linear)" in full
    shallow = display_tree(plan.tree, full=True, max_depth=1)
    assert all(not c.children for c in shallow.children)


def test_report_shows_tied_node_and_manual_plans() -> None:
    plan = auto_partition(TiedLM(layers=4), 2, example_args=(torch.randint(0, 64, (2, 3)),))
    assert "embed + head.1" in plan.report()


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_render(tmp_path: Path, suffix: str) -> None:
    plan = auto_partition(TiedLM(layers=8), 4, example_args=(torch.randint(0, 64, (2, 3)),))
    target = tmp_path / f"plan{suffix}"
    render_plan(plan, target)
    data = target.read_bytes()
    assert len(data) > 1000
    if suffix == ".svg":
        assert b"<svg" in data[:500]
    else:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    plan.render(tmp_path / f"full{suffix}", full=True)
    with pytest.raises(PartitionError, match=r"\.png, \.svg or \.pdf"):
        render_plan(plan, tmp_path / "plan.gif")
