"""mp-launch end to end: configs reach the ranks, and one failing rank stops the whole job quickly."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mp.launch import (
    RemoteWatch,
    binding,
    build_command,
    build_parser,
    core_groups,
    find_mpiexec,
    host_ranks,
    is_hydra,
    physical_cores,
    rank_cpu_sets,
    read_hostfile,
    remote_launcher,
)
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
    # a rank is named with its PID and host (the first seen dead on this host: usually rank 1, but
    # under load possibly one mpiexec killed right after it; see docs/faults.md)
    assert re.search(r"rank \d \(PID \d+", proc.stderr), proc.stderr
    assert f"host {socket.gethostname()}" in proc.stderr, proc.stderr


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


def test_tag_output_tags_whole_lines_of_unbuffered_ranks(tmp_path: Path) -> None:
    # Unbuffered (PYTHONUNBUFFERED=1): each print argument is a write of its own, and Hydra's
    # -prepend-rank tagged each of those writes ('[1]  [1] 1[1]  [1] line...').
    script = tmp_path / "chatty.py"
    script.write_text(
        "import os, sys\n"
        "r = os.environ['PMI_RANK']\n"
        "for i in range(150):\n"
        "    print('line', i, 'of rank', r, 'x' * (i % 41))\n"
        "    print('err', i, 'of rank', r, file=sys.stderr)\n"
        "sys.stdout.write('no newline at the end of rank ' + r)\n"
    )
    proc = subprocess.run(
        [*LAUNCH, "-n", "3", "--bind", "none", "--tag-output", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for stream, pattern, last in (
        (
            proc.stdout,
            r"\[(\d)\] line (\d+) of rank (\d) (x*)",
            r"\[(\d)\] no newline at the end of rank (\d)",
        ),
        (proc.stderr, r"\[(\d)\] err (\d+) of rank (\d)", None),
    ):
        seen: dict[str, list[int]] = {"0": [], "1": [], "2": []}
        ends = []
        for line in stream.splitlines():
            if last is not None and (end := re.fullmatch(last, line)):
                assert end[1] == end[2], line
                ends.append(end[1])
                continue
            hit = re.fullmatch(pattern, line)
            assert hit is not None, f"a line broken or tagged twice: {line!r}"
            assert hit[1] == hit[3], f"rank {hit[3]}'s line tagged with rank {hit[1]}: {line!r}"
            if hit.lastindex == 4:
                assert len(hit[4]) == int(hit[2]) % 41, line
            seen[hit[1]].append(int(hit[2]))
        assert all(numbers == list(range(150)) for numbers in seen.values()), seen
        if last is not None:
            assert sorted(ends) == ["0", "1", "2"], stream[-500:]


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("h1:2\nh2:2\n", "h1:2,h2:2"),  # MPICH
        ("# hosts\nh1 slots=4\n\nh2 slots=4 max_slots=8  # second\n", "h1:4,h2:4"),  # DeepSpeed, Open MPI
        ("node-a\nnode-b\n", "node-a,node-b"),  # one slot each
    ],
)
def test_hostfiles_become_hydras_hosts(text: str, spec: str, tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text(text)
    assert read_hostfile(str(tmp_path / "hosts")) == spec
    (tmp_path / "x.py").write_text("")
    argv = ["-n", "2", "--hostfile", str(tmp_path / "hosts"), str(tmp_path / "x.py")]
    args = build_parser().parse_args(argv)
    cmd = build_command(args, "mpiexec")
    assert cmd[cmd.index("-hosts") + 1] == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("h1 cores=2\n", "line 1: 'h1 cores=2'; expected 'host', 'host:slots' or 'host slots=N'"),
        ("h1:2 slots=2\n", "gives the slots twice"),
        ("# nothing\n", "names no host"),
        ("h1:1\n", "has 1 slots for -n 2"),
    ],
)
def test_bad_hostfiles_are_explained(text: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text(text)
    (tmp_path / "x.py").write_text("")
    with pytest.raises(SystemExit, match=re.escape(message)):
        launch_main(["-n", "2", "--hostfile", str(tmp_path / "hosts"), str(tmp_path / "x.py")])
    with pytest.raises(SystemExit, match="cannot be read"):
        launch_main(["-n", "2", "--hostfile", str(tmp_path / "missing"), str(tmp_path / "x.py")])


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


@pytest.mark.parametrize(
    "case",
    [
        ("auto", 2, None, 2, True, 1),  # this CI host: a core each
        ("auto", 4, None, 16, True, 4),  # bigger hosts: an equal share of whole cores each
        ("auto", 3, None, 16, True, 5),  # the remainder stays free
        ("auto", 4, None, 2, True, 0),  # more ranks than cores: binding would stack ranks on a core
        ("auto", 2, "a:1,b:1", 8, True, 0),  # other hosts' cores are unknown here
        ("auto", 2, None, 8, False, 0),  # not MPICH's Hydra: its own defaults apply
        ("none", 2, None, 8, True, 0),
    ],
)
def test_binding_gives_each_rank_a_share_of_whole_cores_where_that_is_safe(
    case: tuple[str, int, str | None, int, bool, int],
) -> None:
    bind, nprocs, hosts, cores, hydra, expected = case
    assert binding(bind, nprocs, hosts=hosts, cores=cores, hydra=hydra) == expected


def test_binding_refuses_an_unknown_mode_by_name() -> None:
    with pytest.raises(SystemExit, match=r"--bind 'cores': expected one of auto, none"):
        binding("cores", 2, hosts=None, cores=4, hydra=True)


def test_each_rank_gets_whole_cores_as_an_explicit_cpu_list(tmp_path: Path) -> None:
    smt = [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12]]  # a core's hardware threads stay together
    sets = rank_cpu_sets(2, 2, smt)
    assert sets == [[0, 8, 1, 9], [2, 10, 3, 11]]  # the fifth core stays free
    (tmp_path / "x.py").write_text("")
    args = build_parser().parse_args(["-n", "2", str(tmp_path / "x.py")])
    cmd = build_command(args, "mpiexec", sets)
    assert cmd[:5] == ["mpiexec", "-n", "2", "-bind-to", "user:0+8+1+9,2+10+3+11"]
    assert "-bind-to" not in build_command(args, "mpiexec", None)


FAKE_MPIEXEC = """#!/bin/sh
if [ "$1" = "--version" ]; then
    echo asked >> "{folder}/versions"
    echo "HYDRA build details:"
    exit 0
fi
echo "$@" > "{folder}/launched"
"""


def test_one_launch_asks_mpiexec_for_its_version_once(tmp_path: Path) -> None:
    """--bind auto, the remote watch and --tag-output each depend on whether mpiexec is Hydra: a launch
    runs `mpiexec --version` once (mp.launch.Mpiexec) and uses that answer for all three."""
    fake = tmp_path / "mpiexec"
    fake.write_text(FAKE_MPIEXEC.format(folder=tmp_path))
    fake.chmod(0o755)
    (tmp_path / "x.py").write_text("")
    assert launch_main(["-n", "1", "--mpiexec", str(fake), "--tag-output", str(tmp_path / "x.py")]) == 0
    assert (tmp_path / "versions").read_text().splitlines() == ["asked"]
    launched = (tmp_path / "launched").read_text().split()
    # the answer (Hydra) was used: the rank bound to cores of its own, its output through mp-launch
    assert "-bind-to" in launched and "-outfile-pattern" in launched, launched


def test_core_groups_keep_hardware_threads_of_one_core_together() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    groups = core_groups(cpus)
    assert sorted(c for g in groups for c in g) == cpus
    assert physical_cores(cpus) == len(groups) <= len(cpus)
    assert core_groups([10**6 + 1, 10**6]) == [[10**6], [10**6 + 1]]  # no topology published: a core each


_AFFINITY_SCRIPT = (
    "import json, os, sys, torch\n"
    "import mp as smp\nsmp.init({'pipeline_parallel_degree': 1})\n"
    "info = smp.state.world.info\n"
    "row = {'rank': smp.rank(), 'cpus': sorted(os.sched_getaffinity(0))}\n"
    "row.update(threads=torch.get_num_threads(), bound=info.bound, oversubscribed=info.oversubscribed)\n"
    # one write per line: print() writes the text and its newline apart, and mpiexec may put the other
    # rank's line between them
    "sys.stdout.write('placement ' + json.dumps(row) + '\\n'); sys.stdout.flush()\n"
    "smp.shutdown()\n"
)


def _placements(out: str) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("placement ")]
    return {row["rank"]: row for row in rows}


@pytest.mark.skipif(
    physical_cores() < 2 or not is_hydra(find_mpiexec()),
    reason="binding needs MPICH's mpiexec and two cores",
)
def test_ranks_launched_on_one_host_run_on_cores_of_their_own(tmp_path: Path) -> None:
    script = tmp_path / "where.py"
    script.write_text(_AFFINITY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MP_NUM_THREADS")}
    share = physical_cores() // 2
    bound = subprocess.run(
        [*LAUNCH, "-n", "2", str(script)], capture_output=True, text=True, timeout=90, env=env
    )
    assert bound.returncode == 0, bound.stdout + bound.stderr
    ranks = _placements(bound.stdout)
    assert sorted(ranks) == [0, 1], bound.stdout
    cpus0, cpus1 = set(ranks[0]["cpus"]), set(ranks[1]["cpus"])
    assert not cpus0 & cpus1, f"both ranks may run on CPUs {sorted(cpus0 & cpus1)}"
    assert physical_cores(cpus0) == physical_cores(cpus1) == share
    for row in ranks.values():
        assert row["threads"] == share  # torch's threads: the rank's cores, not cores // ranks again
        assert row["bound"] and not row["oversubscribed"], row  # a core each is not oversubscribed

    # mp-launch confined to its last core (as `taskset` would): the rank runs there, not on the first.
    last = max(os.sched_getaffinity(0))
    confined = subprocess.run(
        [*LAUNCH, "-n", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, {last}),
    )
    assert confined.returncode == 0, confined.stdout + confined.stderr
    assert _placements(confined.stdout)[0]["cpus"] == [last], confined.stdout

    unbound = [*LAUNCH, "-n", "2", "--bind", "none", str(script)]
    free = subprocess.run(unbound, capture_output=True, text=True, timeout=90, env=env)
    assert free.returncode == 0, free.stdout + free.stderr
    everywhere = sorted(os.sched_getaffinity(0))
    rows = _placements(free.stdout).values()
    assert len(rows) == 2 and all(row["cpus"] == everywhere and not row["bound"] for row in rows), free.stdout


@pytest.mark.parametrize(
    ("spec", "n", "placed"),
    [
        ("h1:2,h2:2", 4, {"h1": [0, 1], "h2": [2, 3]}),
        ("h1,h2", 4, {"h1": [0, 2], "h2": [1, 3]}),  # Hydra goes round again
        ("h1:4,h2:4", 5, {"h1": [0, 1, 2, 3], "h2": [4]}),
        ("h1:4,h2:4", 2, {"h1": [0, 1]}),
    ],
)
def test_host_ranks_follow_hydras_placement(spec: str, n: int, placed: dict[str, list[int]]) -> None:
    assert host_ranks(spec, n) == placed


def test_the_remote_launcher_is_watched_only_on_launches_over_hosts_outside_slurm(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("")
    script = str(tmp_path / "x.py")
    local = build_parser().parse_args(["-n", "2", script])
    hosts = build_parser().parse_args(["-n", "2", "--hosts", "a:1,b:1", script])
    assert remote_launcher(local, {}) is None
    assert remote_launcher(hosts, {"SLURM_JOB_ID": "7"}) is None  # Hydra starts them with srun there
    assert remote_launcher(hosts, {}) == __import__("shutil").which("ssh")
    given = build_parser().parse_args(["-n", "2", "--launcher-exec", "true", script])
    assert remote_launcher(given, {"SLURM_JOB_ID": "7"}) == __import__("shutil").which("true")
    watch = RemoteWatch(tmp_path, "/bin/true")
    cmd = build_command(hosts, "mpiexec", None, watch)
    assert cmd[cmd.index("-launcher-exec") + 1] == str(watch.shim)


def test_a_remote_launcher_that_ends_badly_names_its_host(tmp_path: Path) -> None:
    """The shim mpiexec is given runs the real launcher with Hydra's arguments and records how it
    ended: the host whose connection ended first is the one named."""
    fake = tmp_path / "fake-ssh"
    fake.write_text('#!/bin/sh\n[ "$2" = h3 ] && sleep 0.3\n[ "$2" = h1 ] && exit 0\nexit 255\n')
    fake.chmod(0o755)
    watch = RemoteWatch(tmp_path, str(fake))
    for host in ("h1", "h2", "h3"):
        done = subprocess.run([str(watch.shim), "-x", host, '"hydra_pmi_proxy" --proxy-id 1'], check=False)
        assert done.returncode == (0 if host == "h1" else 255)
    lost = watch.lost()
    assert [(host, code) for host, code, _ in lost] == [("h2", 255), ("h3", 255)]
    assert lost[0][2] < lost[1][2]
