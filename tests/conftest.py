"""Shared fixtures. `worlds` runs a function on n ranks of a reused MPI world (see tests/_harness.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The multi-rank tests start several ranks on one machine; on a machine with one GPU they share it
# (smp would refuse that; mp allows it with MP_SHARE_GPUS=1, collectives then going through gloo).
os.environ.setdefault("MP_SHARE_GPUS", "1")


@pytest.fixture(scope="session")
def worlds() -> Iterator[object]:
    from tests._harness import Worlds

    manager = Worlds()
    try:
        yield manager
    finally:
        manager.close()
