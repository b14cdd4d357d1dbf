"""Starting the world: launcher detection, thread counts, backend checks (no processes needed)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mp_comm import Launcher, WorldError, WorldInfo, detect_launcher, init_world
from mp_comm.errors import NetworkError
from mp_comm.network import preflight_timeout, rendezvous_candidates
from mp_comm.transport import TransportConfig
from mp_comm.world import _placement, _set_thread_count, _slurm_coordinates, _usable_cores, first_slurm_host
from tests._harness import run_script


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, Launcher.MPI),
        ({"OMPI_COMM_WORLD_RANK": "1"}, Launcher.MPI),
        ({"PMIX_RANK": "0"}, Launcher.MPI),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, Launcher.TORCHRUN),
        ({"RANK": "0"}, Launcher.SINGLE),
        ({}, Launcher.SINGLE),
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"}, Launcher.SLURM),
        # an sbatch script itself: the allocation's variables, no step's
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, Launcher.SINGLE),
        # srun --mpi=pmi2 of an MPI program: MPI's variables win
        ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "PMI_RANK": "1"}, Launcher.MPI),
    ],
)
def test_detect_launcher(env: dict[str, str], expected: Launcher) -> None:
    assert detect_launcher(env) is expected


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("h[1-2]", "h1"),
        ("node[03-05,9],gpu1", "node03"),
        ("a1,b2", "a1"),
        ("gpu7,node[1-2]", "gpu7"),
        ("x", "x"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_slurm_coordinates_follow_the_steps_variables() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "3,2,1",
    }
    info = _slurm_coordinates(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node, info.num_nodes) == (
        3,
        6,
        0,
        1,
        2,
        3,
    )
    env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_NODEID"] = "2(x3)", "1"
    assert _slurm_coordinates(env).local_size == 2
    with pytest.raises(WorldError, match="SLURM_PROCID"):
        _slurm_coordinates({"SLURM_STEP_NUM_TASKS": "2"})


def test_rendezvous_candidates_follow_the_users_choice() -> None:
    assert rendezvous_candidates({"MASTER_ADDR": "127.0.0.1"}) == ["127.0.0.1"]
    assert rendezvous_candidates({"MP_IFNAME": "lo"}) == ["127.0.0.1"]
    with pytest.raises(
        NetworkError, match=r"MP_IFNAME='nosuch0' is not an interface.*this host has: lo \(127"
    ):
        rendezvous_candidates({"MP_IFNAME": "nosuch0"})
    with pytest.raises(NetworkError, match=r"MASTER_ADDR='no\.such\.host\.invalid' does not resolve"):
        rendezvous_candidates({"MASTER_ADDR": "no.such.host.invalid"})
    with pytest.raises(NetworkError, match="MP_PREFLIGHT_TIMEOUT='soon'"):
        preflight_timeout({"MP_PREFLIGHT_TIMEOUT": "soon"})


def _host(local_size: int, *, bound: bool = False) -> WorldInfo:
    return WorldInfo(
        rank=0,
        size=local_size,
        local_rank=0,
        local_size=local_size,
        node=0,
        num_nodes=1,
        launcher=Launcher.MPI,
        bound=bound,
    )


def test_thread_count_is_the_host_share_unless_the_user_set_it() -> None:
    before = torch.get_num_threads()
    try:
        _set_thread_count(_host(64), {})
        assert torch.get_num_threads() == 1  # more ranks than cores: never 0
        _set_thread_count(_host(2, bound=True), {})  # bound: the rank's own CPUs are its share
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        _set_thread_count(_host(1), {"MP_NUM_THREADS": "3"})
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        _set_thread_count(_host(1), {"OMP_NUM_THREADS": "2"})
        assert torch.get_num_threads() == 2  # left alone
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("masks", "expected"),
    [
        ([[0, 1], [0, 1]], (2, False)),  # unbound: every rank may run anywhere
        ([[0], [1]], (2, True)),  # mp-launch on 2 cores
        ([[0, 1], [2, 3], [4, 5]], (6, True)),
        ([[0], [0], [1], [1]], (2, False)),  # bound, but two ranks to a core
        ([[0, 1]], (2, False)),  # alone on the host: nothing to tell apart
    ],
)
def test_placement_tells_bound_ranks_from_ranks_that_share_cpus(
    masks: list[list[int]], expected: tuple[int, bool]
) -> None:
    assert _placement(masks) == expected


def test_transport_config_for_world_decides_oversubscription_from_the_host() -> None:
    cores = _usable_cores()

    def world(info: WorldInfo) -> SimpleNamespace:
        return SimpleNamespace(info=info)

    assert TransportConfig().for_world(world(_host(cores))).oversubscribed is False
    assert TransportConfig().for_world(world(_host(cores + 1))).oversubscribed is True
    assert TransportConfig(oversubscribed=False).for_world(world(_host(cores + 1))).oversubscribed is False
    # Ranks bound to a core each see one CPU apiece, but have the host's CPUs between them.
    bound = dataclasses.replace(_host(2, bound=True), host_cpus=2)
    assert TransportConfig().for_world(world(bound)).oversubscribed is False
    assert dataclasses.replace(_host(4, bound=True), host_cpus=2).oversubscribed


def test_bad_torchrun_environment_is_explained() -> None:
    with pytest.raises(WorldError, match="RANK='zero' is not an integer"):
        init_world(environ={"RANK": "zero", "WORLD_SIZE": "2"})


def test_unknown_backend_is_explained() -> None:
    with pytest.raises(WorldError, match="backend='mpi' is not supported"):
        init_world(backend="mpi", environ={})


def test_validate_runs_before_any_process_group() -> None:
    import torch.distributed as dist

    seen: list[WorldInfo] = []

    def refuse(info: WorldInfo) -> None:
        seen.append(info)
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        init_world(environ={}, validate=refuse)
    assert seen and seen[0].size == 1 and seen[0].launcher is Launcher.SINGLE
    assert not dist.is_initialized()


def test_uncaught_exception_under_plain_mpiexec_stops_every_rank(tmp_path: Path) -> None:
    """Without mp-launch: rank 1 raises while rank 0 waits for it in a collective; the job still ends
    (MPI_Abort from the world's excepthook) instead of rank 0 waiting forever."""
    script = tmp_path / "fail.py"
    script.write_text(
        "from mp_comm import init_world\n"
        "world = init_world()\n"
        "if world.rank == 1:\n"
        "    raise RuntimeError('rank one is broken')\n"
        "world.mpi_comm.Barrier()  # never completes: rank 1 does not come\n"
    )
    output, code, took = run_script(script, 2)
    assert code != 0, output
    assert "RuntimeError: rank one is broken" in output and 'fail.py", line 4' in output, output
    assert "[rank 1] mp: uncaught RuntimeError; aborting the MPI job" in output, output
    assert took < 120, f"the job took {took:.0f} s to stop"


def test_a_world_smaller_than_the_launcher_started_is_refused_with_the_fix(tmp_path: Path) -> None:
    """mpi4py on another MPI than the launcher's: each process would run alone and hang in its first
    collective. Here one process claims a 2-process PMI launch, as such a rank would see it."""
    import os
    import subprocess
    import sys

    script = tmp_path / "alone.py"
    script.write_text("from mp_comm import init_world\ninit_world()\n")
    env = {**os.environ, "PMI_RANK": "0", "PMI_SIZE": "2"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "the launcher started 2 processes (PMI_SIZE=2) but MPI.COMM_WORLD has 1" in proc.stderr, (
        proc.stderr
    )
    assert "MPI4PY_LIBMPI" in proc.stderr


def test_launched_size_check_reads_each_launchers_variable() -> None:
    from mp_comm.world import _check_launched_size

    _check_launched_size(4, {"PMI_SIZE": "4"}, "MPICH Version: 5")
    _check_launched_size(4, {}, "")  # no launcher variable: nothing to compare
    expected = r"OMPI_COMM_WORLD_SIZE=8.*has 1.*\(Open MPI v4\.1\.6, package: Debian\)"
    with pytest.raises(WorldError, match=expected):
        _check_launched_size(1, {"OMPI_COMM_WORLD_SIZE": "8"}, "Open MPI v4.1.6, package: Debian\n")


def _late_rank_zero(world: Any, delay: float, timeout: float) -> list[float]:
    """choose_job_address over two 'nodes' on loopback, rank 0 arriving `delay` s after rank 1; each
    phase's connection attempts record how much of their bound was left when they began."""
    import time

    from mp_comm import network

    left: list[float] = []
    reach = network._reach

    def spy(targets: list[tuple[str, int]], deadline: float) -> dict[int, tuple[str | None, str]]:
        left.append(deadline - time.monotonic())
        return reach(targets, deadline)

    comm = world.mpi_comm
    rank = comm.Get_rank()
    network._reach = spy
    try:
        if rank == 0:
            time.sleep(delay)
        network.choose_job_address(comm, rank, rank, 2, environ={"MP_IFNAME": "lo"}, timeout=timeout)
    finally:
        network._reach = reach
    return left


def test_a_late_rank_does_not_shorten_the_preflight_of_the_others(worlds: Any) -> None:
    # CI once failed a lossy-link job this way: ranks that start far apart (torch imported on a loaded
    # host) spent the bound waiting for rank 0, so the last phase had one 0.1 s try and a lost SYN ended it.
    results = worlds.run(2, _late_rank_zero, 3.0, 2.0)
    assert results[0] and results[1], results
    for rank, left in enumerate(results):
        assert all(x > 1.5 for x in left), (rank, left)
