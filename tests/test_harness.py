"""The test harness itself: results come back in rank order, failures and hangs fail fast."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import WorldFailure


def _allreduce(world: Any, scale: float) -> list[float]:
    x = torch.full((3,), float(world.rank + 1)) * scale
    dist.all_reduce(x)
    return x.tolist()


def _rank_and_size(world: Any) -> tuple[int, int, int]:
    return world.rank, world.size, world.info.local_size


def _fail_on_rank_1(world: Any) -> None:
    if world.rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness


def _hang(world: Any) -> None:
    time.sleep(3600)


def test_results_come_back_in_rank_order(worlds: Any) -> None:
    assert worlds.run(2, _rank_and_size) == [(0, 2, 2), (1, 2, 2)]
    assert worlds.run(2, _allreduce, 2.0) == [[6.0] * 3, [6.0] * 3]


def test_four_ranks(worlds: Any) -> None:
    assert worlds.run(4, _allreduce, scale=1.0) == [[10.0] * 3] * 4


def test_failure_on_one_rank_names_it_and_does_not_hang(worlds: Any) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailure, match=r"(?s)rank 1.*boom on rank one"):
        worlds.run(2, _fail_on_rank_1, timeout=60)
    assert time.monotonic() - start < 30
    assert worlds.run(2, _rank_and_size)[1] == (1, 2, 2)  # a fresh pool serves the next test


def test_hang_times_out(worlds: Any) -> None:
    with pytest.raises(WorldFailure, match="did not answer within 2s"):
        worlds.run(2, _hang, timeout=2)


def test_a_job_that_does_not_end_fails_with_its_processes_and_is_killed() -> None:
    import re
    import sys

    from tests._harness import mpiexec, run_job

    script = "import time; print('rank up', flush=True); time.sleep(600)"
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_job([mpiexec(), "-n", "2", sys.executable, "-c", script], timeout=6)
    assert time.monotonic() - start < 120
    report = str(failure.value)
    assert "the job did not end in 6 s" in report, report
    ranks = [int(p) for p in re.findall(r"^== PID (\d+) .*: \S+/python -c ", report, re.MULTILINE)]
    assert len(ranks) == 2, report  # both ranks named, with their state and stacks
    for pid in ranks:  # and killed
        for _ in range(50):
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # killed, not yet reaped by its proxy (killed too)
            except OSError:
                break  # gone
            time.sleep(0.1)
        else:
            raise AssertionError(f"PID {pid} still runs")
