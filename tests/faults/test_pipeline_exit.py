"""Jobs end with status 0 on every rank, and a rank that ends the job names itself (issue 47).

Issue 47: a 4-rank (pp=2 x dp=2) Trainer job under plain ``mpiexec`` exited 1 in 2 of 21 runs with no
line from any rank. Hydra prints nothing for an exit status of 1 (nor does Python for a SystemExit),
and an MPI_Abort can drop the ranks' last unforwarded lines, so the repeated job here runs with
``-print-all-exitcodes`` and each rank's output in a file of its own: a failure names the rank, its
exit status and its last lines. The job (``_pipeline_exit_job.py``) makes the Trainer's smp calls
without transformers' import cost: training steps with gradient clipping and the DP reducer, a
gathered forward-only step, the gathered state dict saved on rank 0, then exit without shutdown.
Each job costs ~16 CPU-s (4 ranks importing torch and starting mp), so 15 jobs, about 2 minutes on an
idle 2-core host, is the default: they catch a failure that hits ~10% of jobs with probability
1 - 0.9**15 = 79%. MP_PIPELINE_EXIT_RUNS sets the count (a soak: 100).

The silent exits with status 1 found under plain mpiexec are named by the rank itself: ``sys.exit(1)``
(mp_comm.world._name_exit, which also ends the job; a caught one ends nothing), ``os._exit`` (Hydra
then ends every rank without a word, with status 0 too), and mp's own two: the heartbeat's report and
a failed background save at exit, which only logged their reason (a script may turn logging off).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._harness import mpiexec, run_script

JOB = Path(__file__).with_name("_pipeline_exit_job.py")
RANKS = 4


def _job(folder: Path) -> str | None:
    """Run the job once; None if every rank exited 0 and said ok, else what went wrong, rank by rank."""
    folder.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        "MP_TEST_OUT": str(folder),
    }
    command = [
        mpiexec(),
        "-print-all-exitcodes",
        "-outfile-pattern",
        str(folder / "rank%r.out"),
        "-errfile-pattern",
        str(folder / "rank%r.err"),
        "-n",
        str(RANKS),
        sys.executable,
        str(JOB),
    ]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    took = time.monotonic() - start
    found = re.search(r"Exit codes: \[[^\]]*\] ([0-9,]+)", proc.stdout + proc.stderr)
    codes = [int(c) for c in found.group(1).split(",")] if found else []
    said_ok = [f"rank {r} ok" in _read(folder / f"rank{r}.out") for r in range(RANKS)]
    if proc.returncode == 0 and codes == [0] * RANKS and all(said_ok) and (folder / "model.pt").is_file():
        return None
    ends = ", ".join(f"rank {r}: {_status(c)}" for r, c in enumerate(codes)) or "unknown"
    lines = [f"mpiexec exited {proc.returncode} after {took:.1f} s; {ends}"]
    lines.append((proc.stdout + proc.stderr)[-1000:])
    for rank in range(RANKS):
        status = _status(codes[rank]) if rank < len(codes) else "unknown"
        lines.append(f"--- rank {rank}: {status}, said ok: {said_ok[rank]}")
        lines.append(_read(folder / f"rank{rank}.out")[-600:])
        lines.append(_read(folder / f"rank{rank}.err")[-1500:])
    return "\n".join(lines)


def _status(wait: int) -> str:
    """Hydra's -print-all-exitcodes gives wait statuses: 256 is exit status 1, 9 is SIGKILL."""
    return f"killed by signal {wait & 0x7F}" if wait & 0x7F else f"exit status {wait >> 8}"


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipelined_jobs_that_end_without_shutdown_exit_0_on_every_rank(tmp_path: Path) -> None:
    runs = int(os.environ.get("MP_PIPELINE_EXIT_RUNS", "15"))
    failures = []
    for attempt in range(runs):
        report = _job(tmp_path / f"job{attempt}")
        if report is not None:
            failures.append(f"=== job {attempt + 1}/{runs}\n{report}")
    assert not failures, f"{len(failures)} of {runs} jobs did not end cleanly:\n" + "\n".join(failures)


EXITS = """
import sys, time
import mp as smp

smp.init({"ddp": True})
if smp.rank() == 1:
    sys.exit(3)
time.sleep(150)  # mpiexec alone would leave this rank running after rank 1 exits
"""


def test_a_rank_that_calls_sys_exit_non_zero_is_named_and_ends_the_job(tmp_path: Path) -> None:
    """Python reports no SystemExit, and Hydra prints nothing for a non-zero exit status and leaves the
    other ranks running: the job used to end with no line at all, or wait. mp names the rank and where
    it called sys.exit, and ends the job with its status after the rank's teardown."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    output, code, took = run_script(script, 2, env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert code == 3, output
    assert f"[rank 1] mp: sys.exit(3) at {script}:7 in <module>" in output, output
    assert "[rank 0] mp:" not in output, output
    assert took < 120, f"the job took {took:.0f} s to end"


CAUGHT = """
import sys
import mp as smp

smp.init({"ddp": True})
try:
    sys.exit(2)  # a library's exit that the script catches (argparse's, say): the rank goes on
except SystemExit:
    pass
smp.barrier()
print(f"rank {smp.rank()} went on", flush=True)
"""


def test_a_sys_exit_that_the_script_catches_ends_nothing(tmp_path: Path) -> None:
    script = tmp_path / "caught.py"
    script.write_text(CAUGHT)
    output, code, _ = run_script(script, 2, env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert code == 0, output
    assert "rank 0 went on" in output and "rank 1 went on" in output, output
    assert "mp:" not in output, output


# mp's other exits that end a rank with status 1 print their line themselves: logging may drop it (a
# script that configures logging its own way, or turns it off, as here), and Hydra adds nothing.
SILENT_PEER = """
import logging, os, signal, time
import mp as smp

smp.init({"ddp": True})
logging.disable(logging.CRITICAL)
if smp.rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(150)
"""


def test_the_rank_whose_heartbeat_ends_the_job_prints_why(tmp_path: Path) -> None:
    """Under plain mpiexec the heartbeat's report was only logged before MPI_Abort(1)."""
    script = tmp_path / "silent.py"
    script.write_text(SILENT_PEER)
    env = {"OMP_NUM_THREADS": "1", "MP_HEARTBEAT_TIMEOUT": "3"}
    output, code, took = run_script(script, 2, env=env, timeout=180)
    assert code != 0, output
    peer = r"rank 1 \(pp_rank 0, tp_rank 0, rdp_rank 1; host \S+, PID \d+\)"
    named = rf"\[rank 0\] mp: {peer} has sent no heartbeat"
    assert re.search(named, output), output
    assert took < 120, f"the job took {took:.0f} s to end"


UNSAVED = """
import logging, os, resource, signal
import torch
import mp as smp

smp.init({"ddp": True})
logging.disable(logging.CRITICAL)
if smp.rank() == 0:  # the rank that writes user_content cannot: the save fails on every rank
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
big = {"w": torch.ones(1 << 20)}
smp.save_checkpoint(os.environ["MP_TEST_OUT"], "last", user_content=big, async_save=True)
print(f"rank {smp.rank()} script ended", flush=True)
"""


def test_a_rank_whose_last_background_save_failed_prints_why_it_exits_1(tmp_path: Path) -> None:
    """At exit a failed async save ends the rank with os._exit(1); its reason was only logged."""
    script = tmp_path / "unsaved.py"
    script.write_text(UNSAVED)
    env = {"OMP_NUM_THREADS": "1", "MP_TEST_OUT": str(tmp_path / "ckpt")}
    output, code, _ = run_script(script, 2, env=env, timeout=180)
    assert code == 1, output
    for rank in (0, 1):
        assert f"rank {rank} script ended" in output, output
        said = rf"\[rank {rank}\] mp: smp\.save_checkpoint\(.*'last'\) failed .*\nrank 0: CheckpointWrite"
        assert re.search(said, output), output
    assert output.count("The process exits with status 1: its last checkpoint was not saved") == 2, output


OS_EXIT = """
import os, sys, time
import mp as smp

smp.init({"ddp": True})
smp.barrier()
if smp.rank() == 1:
    os._exit(int(sys.argv[1]))
time.sleep(150)  # Hydra ends this rank once rank 1 is gone without MPI_Finalize
print("rank 0 slept", flush=True)
"""


@pytest.mark.parametrize("status", [1, 0])
def test_a_rank_that_calls_os_exit_names_itself(tmp_path: Path, status: int) -> None:
    """os._exit skips MPI_Finalize: Hydra ends the other ranks without a word and returns the status
    (1: the silent exit of issue 47; 0: a job that ends early and looks fine). The rank names itself."""
    script = tmp_path / "os_exit.py"
    script.write_text(OS_EXIT)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [mpiexec(), "-n", "2", sys.executable, str(script), str(status)]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=environ)
    output, took = proc.stdout + proc.stderr, time.monotonic() - start
    assert proc.returncode == status, output
    assert f"[rank 1] mp: os._exit({status}) at {script}:8 in <module>; this rank ends now" in output, output
    assert "rank 0 slept" not in output, output
    assert took < 120, f"the job took {took:.0f} s to end"
