"""mp-launch end to end: configs reach the ranks, and one failing rank stops the whole job quickly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp.launch import main as launch_main

LAUNCH = [sys.executable, "-m", "mp.launch"]


def _run(args: list[str], timeout: float = 90) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_config_reaches_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, mp as smp\n"
        "smp.init()\n"
        "line = f'rank={smp.rank()} pp={smp.pp_size()} mb={smp.state.cfg.microbatches} arg={sys.argv[1]}'\n"
        f"open(r'{tmp_path}/out-' + str(smp.rank()), 'w').write(line)\n"
        "smp.shutdown()\n"
    )
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"pipeline_parallel_degree": 2, "microbatches": 4}))
    proc, _ = _run(["-n", "2", "--config", str(cfg), str(script), "hello"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(p.read_text() for p in tmp_path.glob("out-*"))
    assert lines == ["rank=0 pp=2 mb=4 arg=hello", "rank=1 pp=2 mb=4 arg=hello"]


def test_exception_on_rank_2_stops_all_ranks_with_its_traceback(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import time\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 2:\n"
        "    raise RuntimeError('rank two is broken')\n"
        "time.sleep(600)\n"
    )
    proc, took = _run(["-n", "4", str(script)])
    assert proc.returncode != 0
    assert took < 30
    assert "rank 2 failed first" in proc.stderr
    assert "RuntimeError: rank two is broken" in proc.stderr
    assert 'fail.py", line 4' in proc.stderr


def test_sigkill_of_rank_1_stops_all_ranks(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, time\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n"
    )
    proc, took = _run(["-n", "4", str(script)])
    assert proc.returncode != 0
    assert took < 30
    assert "killed by signal 9" in proc.stderr


def test_nonzero_sys_exit_is_a_failure(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, time\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 0:\n    sys.exit(3)\ntime.sleep(600)\n"
    )
    proc, took = _run(["-n", "2", str(script)])
    assert proc.returncode == 3 and took < 30
    assert "sys.exit(3)" in proc.stderr


def test_module_mode(tmp_path: Path) -> None:
    (tmp_path / "jobmod.py").write_text("from mpi4py import MPI\nprint('ranks', MPI.COMM_WORLD.Get_size())\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [*LAUNCH, "-n", "2", "-m", "jobmod"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ranks") == 2 and proc.stdout.count("2") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2"], "no script given"),
        (["-n", "0", "x.py"], "at least 1"),
        (["-n", "2", "does_not_exist.py"], "does not exist"),
        (["-n", "2", "--config", "{not json", "x.py"], "not valid JSON"),
        (["-n", "2", "--config", "missing.json", "x.py"], "neither a JSON object nor an existing file"),
        (["-n", "4", "--hosts", "a:1,b:1", "x.py"], "2 slots for -n 4"),
    ],
)
def test_bad_arguments_are_explained(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    with pytest.raises(SystemExit, match=message):
        launch_main(argv)
