"""The simulated hosts, started once per test session and torn down at its end (tests/multihost/hosts.py).

Where hosts cannot be simulated (not root, no sshd), the tests skip with the reason, except under
MP_REQUIRE_HOSTS=1 (set by .ci/run), where that is a failure: CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.multihost.hosts import SimulatedHosts, missing_requirements


@pytest.fixture(scope="session")
def hosts() -> Iterator[SimulatedHosts]:
    why = missing_requirements()
    if why is not None:
        if os.environ.get("MP_REQUIRE_HOSTS") == "1":
            pytest.fail(f"MP_REQUIRE_HOSTS=1 but {why}")
        pytest.skip(why)
    made = SimulatedHosts(count=2).start()
    try:
        yield made
    finally:
        made.teardown()


@pytest.fixture(scope="session")
def slurm(hosts: SimulatedHosts) -> dict[str, str]:
    """A Slurm cluster (slurmctld on h1, a slurmd per host, munge) over the simulated hosts: the
    environment its clients need."""
    return hosts.start_slurm()
