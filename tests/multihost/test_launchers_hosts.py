"""One script, no edit, started across two simulated hosts by each launcher a cluster offers: mp-launch
with a hostfile, plain `mpiexec -f hostfile`, and torchrun's
c10d rendezvous on each host. Every job trains equal to one process with the real host grouping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.multihost._jobs import BIN, TRAIN, _env, _records
from tests.multihost.hosts import SimulatedHosts

CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 2}


def _check(out: Path, launcher: str) -> None:
    records = _records(out, 4)
    assert [r["host"] for r in records] == ["h1", "h1", "h2", "h2"]
    assert [(r["local_rank"], r["local_size"]) for r in records] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert {r["launcher"] for r in records} == {launcher}
    for r in records:
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r


def test_mp_launch_with_a_deepspeed_hostfile(hosts: SimulatedHosts, tmp_path: Path) -> None:
    # (--hosts and MPICH-style hostfiles become the same -hosts argument: tests/mp/test_launch.py)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the job's hosts\nh1 slots=2\nh2 slots=2\n")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [str(BIN / "mp-launch"), "-n", "4", "--hostfile", str(hostfile), "--launcher-exec", str(hosts.ssh)]
    cmd += ["--tag-output", "--config", json.dumps(CONFIG), str(TRAIN), str(out)]
    proc = hosts.run(hosts.hosts[0], cmd, env=_env({}))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _check(out, "mpi")
    # --tag-output: the other host's ranks' lines reach mp-launch whole, tagged with their rank.
    for rank, host in enumerate(["h1", "h1", "h2", "h2"]):
        assert f"[{rank}] rank {rank} done on {host}\n" in proc.stdout, proc.stdout[-3000:]


def test_plain_mpiexec_with_a_hostfile(hosts: SimulatedHosts, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1:2\nh2:2\n")
    cmd = [str(BIN / "mpiexec"), "-launcher-exec", str(hosts.ssh), "-f", str(hostfile), "-n", "4"]
    cmd += [sys.executable, str(TRAIN), str(tmp_path)]
    proc = hosts.run(hosts.hosts[0], cmd, env=_env(CONFIG))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _check(tmp_path, "mpi")


def test_torchrun_on_each_host(hosts: SimulatedHosts, tmp_path: Path) -> None:
    # As on a cluster: the same torchrun command on every host, meeting at h1's c10d rendezvous.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:29400", "--rdzv-id", tmp_path.name]
    cmd += [str(TRAIN), str(tmp_path)]
    procs = [
        hosts.popen(host, cmd, env=_env(CONFIG), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for host in hosts.hosts
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=240)[0])
        finally:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _check(tmp_path, "torchrun")
    h1, h2 = (h.address for h in hosts.hosts)
    assert [r["address"] for r in _records(tmp_path, 4)] == [h1, h1, h2, h2]


def test_an_sbatch_script_that_calls_srun(
    hosts: SimulatedHosts, slurm: dict[str, str], tmp_path: Path
) -> None:
    # A real Slurm: the batch script runs once on h1 (where mp must not start a world: it is no task of
    # a step) and `srun` starts the 4 tasks; mp reads SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID,
    # SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE and SLURM_STEP_NODELIST.
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n#SBATCH --nodes=2 --ntasks=4 --ntasks-per-node=2\n"
        f"{sys.executable} -c 'import mp_comm; print(mp_comm.detect_launcher().value)'\n"
        f"srun {sys.executable} {TRAIN} {tmp_path}\n"
    )
    env = {**_env(CONFIG), **{k: v for k, v in slurm.items() if k.startswith("SLURM")}}
    cmd = ["sbatch", "--wait", f"--output={tmp_path}/job.out", str(script)]
    proc = hosts.run(hosts.hosts[0], cmd, env=env, timeout=280)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, proc.stderr[-2000:] + log[-4000:]
    assert log.splitlines()[0] == "single", log[-2000:]
    _check(tmp_path, "slurm")
