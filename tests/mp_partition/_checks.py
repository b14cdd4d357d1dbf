"""Plan checks shared by the mp_partition tests."""

from __future__ import annotations

from mp_partition import PlanNode


def walk_consistent(node: PlanNode) -> None:
    """A subtree given a single partition lies wholly on it."""
    if len(node.devices) == 1:
        for d in node.walk():
            assert d.partition == node.partition, (node.label, d.label)
    assert node.partition == min(node.devices)
    for child in node.children:
        assert set(child.devices) <= set(node.devices)
        walk_consistent(child)
