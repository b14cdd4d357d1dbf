"""Shared fixtures. `worlds` runs a function on n ranks of a reused MPI world (see tests/_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def worlds() -> Iterator[object]:
    from tests._harness import Worlds

    manager = Worlds()
    try:
        yield manager
    finally:
        manager.close()
