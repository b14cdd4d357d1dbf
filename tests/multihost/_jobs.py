"""What the multi-host tests share: the training script, the Python environment's bin folder, a job's
environment, the ranks' JSON records and hydra's command over the simulated hosts' ssh."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.multihost.hosts import SimulatedHosts

TRAIN = Path(__file__).with_name("_train.py")
BIN = Path(sys.executable).parent


def _env(config: dict[str, object], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_", "OMPI_", "MP_CONFIG"))}
    env.update(MP_CONFIG=json.dumps(config), OMP_NUM_THREADS="1", **extra)
    return env


def _records(out: Path, n: int) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _hydra(hosts: SimulatedHosts, *args: str) -> list[str]:
    return [str(BIN / "mpiexec"), "-launcher", "ssh", "-launcher-exec", str(hosts.ssh), *args]
