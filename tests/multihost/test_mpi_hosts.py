"""MPI jobs across two simulated hosts: hydra over ssh starts the ranks, smp.init finds the hosts, and
training equals one process; a rank that cannot reach rank 0's address ends the job with a named error."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.multihost._jobs import TRAIN, _env, _hydra, _records
from tests.multihost.hosts import SimulatedHosts, free_subnet


def test_hydra_over_ssh_trains_across_two_hosts_equal_to_one_process(
    hosts: SimulatedHosts, tmp_path: Path
) -> None:
    cmd = _hydra(hosts, "-hosts", "h1:2,h2:2", sys.executable, str(TRAIN), str(tmp_path))
    proc = hosts.run(hosts.hosts[0], cmd, env=_env({"pipeline_parallel_degree": 2, "microbatches": 2}))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = _records(tmp_path, 4)
    # Two ranks per host, in rank order; each host has its own address on the job's network.
    assert [r["host"] for r in records] == ["h1", "h1", "h2", "h2"]
    assert [(r["local_rank"], r["local_size"]) for r in records] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    h1, h2 = (h.address for h in hosts.hosts)
    assert [r["address"] for r in records] == [h1, h1, h2, h2]
    # Seed 003's default placement ("cluster"): the pipeline's stages are neighbours, within a host.
    assert [r["pp_group"] for r in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_group"] for r in records] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for r in records:
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r


def test_a_rank_that_cannot_reach_rank_0_ends_the_job_naming_the_address(
    hosts: SimulatedHosts, tmp_path: Path
) -> None:
    # h1 gets a second interface that h2 has no route to; MP_IFNAME makes rank 0 offer only it.
    h1 = hosts.hosts[0]
    if "mpiso0" not in h1.extra:
        hosts.add_isolated_interface(h1, "mpiso0", free_subnet("10.78") + ".1")
    isolated = h1.extra["mpiso0"]
    cmd = _hydra(hosts, "-hosts", "h1:1,h2:1", sys.executable, str(TRAIN), str(tmp_path))
    env = _env({"pipeline_parallel_degree": 2}, MP_IFNAME="mpiso0", MP_PREFLIGHT_TIMEOUT="5")
    start = time.monotonic()
    proc = hosts.run(h1, cmd, env=env, timeout=120)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "NetworkError" in out and isolated in out and "rank 1 on h2" in out, out[-3000:]
    assert "MP_IFNAME" in out, out[-3000:]  # the fix is named
    assert took < 60, f"the job took {took:.0f} s to fail (bound 5 s + start-up)"
    # Every rank raised it, not only the one that failed to connect.
    assert out.count("NetworkError") >= 2, out[-3000:]
