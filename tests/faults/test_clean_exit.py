"""Jobs that succeed exit 0, every time; a job that fails on one rank ends fast without a C++ terminate.

A script that ends without shutting mp down (as smp scripts do) used to die now and then at interpreter
exit: a gloo worker thread still releasing a finished collective's tensors took the GIL while Python
finalized, and CPython's forced unwind of that thread ended in ``terminate called without an active
exception`` (SIGABRT). Before the fix, 3 of 20 8-rank jobs (one allreduce, then exit) and 1 of 12
2-rank jobs of this file's script failed on this host; mp_comm.teardown now destroys the groups
(joining those threads) from atexit, after the transports and before MPI finalizes. The groups the
script still references (this script keeps all of them) survive that, with their threads: one 2-rank
job in 30 still aborted in CI on a loaded host, so the last exit stage (mp_comm.gloo_workers) waits
until their workers have let go of their last collective; the last test here shows that wait on a
worker starved as on a loaded host.

Cost: each job imports torch on every rank (about 2 s of CPU a rank); in the fresh-clone CI run of
2026-11-28 the 50 2-rank jobs took 368 s (7.4 s each) and the 5 8-rank jobs 71 s, the most of any test
file. The default (MP_CLEAN_EXIT_RUNS="2:30,8:5") runs 30 jobs at 2 ranks: against the 1-in-12 rate the
bug had there, 30 jobs miss it with probability (11/12)^30 = 7% (50: 1.3%), and the 8-rank jobs, where
it struck 3 in 20, add 5 more chances. MP_CLEAN_EXIT_RUNS="2:200,8:50" runs a soak (not for CI).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._harness import run_script

SCRIPT = Path(__file__).with_name("_exit_script.py")
TERMINATE = "terminate called"


def _runs() -> dict[int, int]:
    raw = os.environ.get("MP_CLEAN_EXIT_RUNS", "2:30,8:5")
    return {int(n): int(k) for n, k in (item.split(":") for item in raw.split(","))}


def _jobs(ranks: int, runs: int, env: dict[str, str]) -> list[str]:
    """Run the script `runs` times on `ranks` ranks; a description of each job that did not exit 0."""
    failures = []
    for attempt in range(runs):
        output, code, took = run_script(SCRIPT, ranks, env={"OMP_NUM_THREADS": "1", **env}, timeout=180)
        if code != 0 or TERMINATE in output or output.count(" ok") != ranks:
            failures.append(f"job {attempt + 1}/{runs}: exit {code} after {took:.1f} s\n{output[-2000:]}")
    return failures


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rank_jobs_that_end_without_shutdown_all_exit_0() -> None:
    runs = _runs().get(2, 0)
    failures = _jobs(2, runs, {"MP_TEST_PP": "2"})
    assert not failures, f"{len(failures)} of {runs} jobs did not exit cleanly:\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eight_rank_jobs_that_end_without_shutdown_all_exit_0() -> None:
    runs = _runs().get(8, 0)
    failures = _jobs(8, runs, {"MP_TEST_PP": "2", "MP_TEST_TP": "2"})
    assert not failures, f"{len(failures)} of {runs} jobs did not exit cleanly:\n" + "\n".join(failures)


def test_an_exception_on_one_rank_ends_the_job_fast_without_a_terminate() -> None:
    output, code, took = run_script(SCRIPT, 2, env={"MP_TEST_PP": "2", "MP_TEST_RAISE_RANK": "1"})
    assert code != 0, output
    assert "RuntimeError: planned failure on rank 1" in output, output
    assert TERMINATE not in output, output
    assert took < 60, f"the job took {took:.0f} s to end"


def test_teardown_at_exit_joins_the_gloo_threads() -> None:
    """The mechanism itself, deterministically: after the exit hooks no gloo thread is left, so none
    can outlive the interpreter (a group the script still references keeps its threads; they are idle)."""
    code = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        import mp as smp
        from mp_comm.teardown import run_exit_hooks

        def gloo_threads():
            names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
            return sum("gloo" in n for n in names)

        smp.init({"ddp": True})
        dist.all_reduce(torch.ones(2), group=smp.get_dp_process_group())
        before = gloo_threads()
        run_exit_hooks()
        print(before, gloo_threads(), smp.is_initialized(), dist.is_initialized())
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before, after, initialized, dist_up = proc.stdout.split()
    assert int(before) > 0 and int(after) == 0, proc.stdout
    assert (initialized, dist_up) == ("False", "False")


def test_exit_waits_for_a_gloo_worker_that_still_holds_a_finished_collective() -> None:
    """The last exit stage, deterministically: a gloo worker starved behind the main thread (as on a
    loaded host) still holds a collective's tensor after the caller let go of the work; it is seen busy,
    and the wait returns only once it has dropped the tensor (whose Python reference it releases under
    the GIL: after finalization began, that ended in ``terminate called``)."""
    code = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        from mp_comm.gloo_workers import WORKER_NAME, busy_workers, wait_for_workers

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == WORKER_NAME:  # it runs only while the main thread blocks
                    os.sched_setaffinity(int(tid), {cpu})
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        parked = wait_for_workers(timeout=60), busy_workers()
        tensor = torch.ones(4)
        for attempt in range(5):  # another process on this core may let the worker run early: retry
            work = dist.all_reduce(tensor, async_op=True)
            del work  # the worker holds the work's last reference now
            held, busy = tensor._use_count(), busy_workers()
            waited = wait_for_workers(timeout=60)
            if busy:
                break
        print(repr((parked, held, busy, waited, tensor._use_count(), busy_workers(), tensor.tolist())))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert TERMINATE not in proc.stderr, proc.stderr
    result = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    parked, held, busy, waited, released, after, values = result
    assert parked == (True, []), proc.stdout  # idle workers are recognized as parked
    assert held > 1 and busy, proc.stdout  # the worker still held the tensor, and was seen busy
    assert (waited, released, after) == (True, 1, []), proc.stdout  # the wait outlasted its hold
    assert values == [1.0, 1.0, 1.0, 1.0], proc.stdout
