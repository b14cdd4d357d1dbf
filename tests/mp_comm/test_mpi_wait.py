"""A rank waiting in an MPI collective gives its core away (mp_comm.mpi_wait), between real MPI ranks.

Rank 1 arrives 0.6 s late; rank 0's waiting thread must not burn that time on the CPU under the
default policy (MPICH's own blocking wait would spend all of it polling), and still get the right sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import torch

from mp_comm import collectives as C
from mp_comm.mpi_wait import ENV, WaitPolicy

LATE_S = 0.6


def _late_peer(world: Any) -> dict[str, float]:
    group = world.new_groups([[0, 1]])[0]
    try:
        x = torch.full((1 << 12,), float(world.rank + 1))
        C.all_reduce(x, group)  # both ranks ready: warms the path
        if world.rank == 1:
            time.sleep(LATE_S)
        cpu, wall = time.thread_time(), time.perf_counter()
        total = C.all_reduce(x, group)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        assert torch.equal(total, torch.full_like(x, 3.0))
        return {"cpu": cpu, "wall": wall}
    finally:
        world.destroy_groups([group])


def test_a_waiting_rank_sleeps_instead_of_spinning(worlds: Any) -> None:
    waiter = worlds.run(2, _late_peer, timeout=60)[0]
    assert waiter["wall"] >= LATE_S * 0.8, waiter  # it did wait for the late rank
    assert waiter["cpu"] < 0.25 * waiter["wall"], f"the waiting rank spun: {waiter}"


def test_an_unknown_policy_is_refused_naming_the_setting() -> None:
    code = "import mp_comm.mpi_wait"
    env = {**os.environ, ENV: "busy"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "MP_COMM_WAIT='busy'" in proc.stderr and "'yield'" in proc.stderr and "'spin'" in proc.stderr


def test_the_default_policy_yields() -> None:
    saved = os.environ.pop(ENV, None)
    try:
        assert WaitPolicy.from_env().mode == "yield"
    finally:
        if saved is not None:
            os.environ[ENV] = saved
