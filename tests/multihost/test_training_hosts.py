"""Training across two simulated hosts: a pipeline whose stages sit on different hosts equals one
process (also over a slow, lossy link: tc netem, or a relay doing the same where the kernel lacks it);
its checkpoint, written to a folder both hosts share, resumes on one host; and a host that dies or
drops off the network ends the job within its bound, named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost._jobs import BIN, TRAIN, _env, _hydra, _records
from tests.multihost.hosts import SimulatedHosts

SPREAD = {"pipeline_parallel_degree": 2, "microbatches": 2, "placement_strategy": "spread"}


@pytest.fixture
def lossy(hosts: SimulatedHosts) -> Iterator[Path | None]:
    """5 ms more delay and 1% loss on every frame each way between h2 and the others: tc netem on
    every host where the kernel has it (yields None), else h2's cable cut and joined again by a relay in
    user space that does the same (yields the file of its counts, written when it stops)."""
    try:
        hosts.exec_tc(
            hosts.hosts[0], "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "5ms", "loss", "1%"
        )
    except RuntimeError as exc:
        if "qdisc kind is unknown" not in str(exc):
            raise
        with hosts.slow_cable(hosts.hosts[1], delay_ms=5.0, loss=0.01) as stats:
            yield stats
        return
    for host in hosts.hosts[1:]:
        hosts.exec_tc(host, "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "5ms", "loss", "1%")
    try:
        yield None
    finally:
        for host in hosts.hosts:
            hosts.exec_tc(host, "qdisc", "del", "dev", "eth0", "root", check=False)


_ROUND_TRIP = """
import socket, statistics, sys, time
def once():
    t = time.monotonic()
    socket.create_connection((sys.argv[1], 22), timeout=10).close()
    return time.monotonic() - t
once()  # the first one also resolves the peer's MAC address
print(statistics.median(once() for _ in range(7)))
"""


def test_pipeline_across_hosts_on_a_lossy_link(
    hosts: SimulatedHosts, lossy: Path | None, tmp_path: Path
) -> None:
    h1, h2 = hosts.hosts[:2]
    rtt = float(hosts.run(h1, [sys.executable, "-c", _ROUND_TRIP, h2.address]).stdout)
    assert rtt >= 0.010, f"a TCP handshake h1 -> h2 took {rtt * 1e3:.1f} ms (median): the link is not slowed"
    cmd = _hydra(hosts, "-hosts", "h1:2,h2:2", sys.executable, str(TRAIN), str(tmp_path))
    proc = hosts.run(hosts.hosts[0], cmd, env=_env(SPREAD))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for r in _records(tmp_path, 4):
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r
    if lossy is not None:  # the relay's counts: frames really were lost on the way
        counts = json.loads(lossy.read_text())
        assert counts["dropped"] > 0 and counts["forwarded"] > 50 * counts["dropped"], counts


def test_pipeline_across_hosts_then_resume_on_one_host_and_on_both(
    hosts: SimulatedHosts, tmp_path: Path
) -> None:
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    first.mkdir()
    second.mkdir()
    cmd = _hydra(hosts, "-hosts", "h1:2,h2:2", sys.executable, str(TRAIN), str(first), "--save", str(ckpt))
    proc = hosts.run(hosts.hosts[0], cmd, env=_env(SPREAD))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = _records(first, 4)
    # "spread": each pipeline has a stage on each host, the replicas of a stage share a host.
    assert [r["pp_group"] for r in records] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["host"] for r in records] == ["h1", "h1", "h2", "h2"]
    for r in records:
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r
    # The partial checkpoint, written by both hosts into the shared folder, resumes on h1 alone, under
    # another placement; the steps after it equal plain PyTorch trained through both runs.
    config = {"pipeline_parallel_degree": 2, "microbatches": 2}
    cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, str(TRAIN), str(second), "--resume", str(ckpt)]
    proc = hosts.run(hosts.hosts[0], cmd, env=_env(config))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for r in _records(second, 4):
        assert r["host"] == "h1"
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r
    # And on both hosts again, as the job that wrote it.
    third = tmp_path / "third"
    third.mkdir()
    cmd = _hydra(hosts, "-hosts", "h1:2,h2:2", sys.executable, str(TRAIN), str(third), "--resume", str(ckpt))
    proc = hosts.run(hosts.hosts[0], cmd, env=_env(SPREAD))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for r in _records(third, 4):
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r


def _run_until_step(hosts: SimulatedHosts, tmp_path: Path, step: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [str(BIN / "mp-launch"), "-n", "4", "--hosts", "h1:2,h2:2", "--launcher-exec", str(hosts.ssh)]
    cmd += [str(TRAIN), str(tmp_path), "--forever", *extra]
    env = _env(SPREAD, MP_HEARTBEAT_TIMEOUT="5")
    proc = hosts.popen(hosts.hosts[0], cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if line.strip() == f"step {step}":
            return proc
        if not line:
            break
    proc.kill()
    pytest.fail("the job did not reach step {step}:\n" + "".join(seen)[-3000:])


def _finish(proc: subprocess.Popen[str], limit: float) -> tuple[str, float]:
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit + 60)
    finally:
        proc.kill()
    return out, time.monotonic() - start


def test_a_host_whose_processes_are_all_killed_ends_the_job(hosts: SimulatedHosts, tmp_path: Path) -> None:
    ckpt, run, resumed = tmp_path / "ckpt", tmp_path / "run", tmp_path / "resumed"
    run.mkdir()
    resumed.mkdir()
    # A checkpoint every 2 steps into the folder both hosts share; h2 dies after step 5 is printed (the
    # save of step 6 may be under way).
    proc = _run_until_step(hosts, run, 5, "--save", str(ckpt), "--save-every", "2")
    h2 = hosts.hosts[1]
    for pid in hosts.pids(h2):  # the ranks and Hydra's proxy: everything of the job on h2
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"sshd" not in cmdline:
            os.kill(pid, signal.SIGKILL)
    out, took = _finish(proc, 10)
    assert proc.returncode != 0, out[-3000:]
    assert took < 10, f"the job took {took:.1f} s to end:\n{out[-3000:]}"
    # Whoever notices first reports, naming the host and its ranks: a rank on h1 whose gloo peer went
    # away (gloo names it by address, "Connection closed/reset by peer"; mp adds which host and ranks that
    # is), or Hydra, whose proxy on h2 died with the rest ("assert (!closed) failed", which names no host;
    # mp-launch's watcher of the ssh it started there does).
    by_rank = f"mp: {h2.address} is host h2 (ranks 2, 3)" in out
    by_launcher = "assert (!closed)" in out and "host h2 (ranks 2, 3) was lost first" in out
    assert by_rank or by_launcher, out[-3000:]
    # The last complete checkpoint survives: h1 alone resumes from it (step 4, or a later one where the
    # job ran on before the kill), and the steps after it equal plain PyTorch trained through them.
    config = {"pipeline_parallel_degree": 2, "microbatches": 2}
    cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, str(TRAIN), str(resumed), "--resume", str(ckpt)]
    done = hosts.run(hosts.hosts[0], cmd, env=_env(config))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for r in _records(resumed, 4):
        assert r["first_step"] >= 4 and r["first_step"] % 2 == 0, r  # a save of the run, at least step 4
        assert r["param_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r


def test_a_host_cut_off_the_network_is_named_within_the_heartbeat_timeout(
    hosts: SimulatedHosts, tmp_path: Path
) -> None:
    proc = _run_until_step(hosts, tmp_path, 3)
    cable = hosts.link(hosts.hosts[1])
    subprocess.run(["ip", "link", "set", cable, "down"], check=True)
    try:
        out, took = _finish(proc, 5 + 10)
    finally:
        subprocess.run(["ip", "link", "set", cable, "up"], check=True)
    assert proc.returncode != 0, out[-3000:]
    assert took < 5 + 10, f"the job took {took:.1f} s to end:\n{out[-3000:]}"
    assert "stopped answering" in out and "host h2" in out, out[-3000:]
    assert "rank 2 " in out or "rank 3 " in out, out[-3000:]


def test_hf_gpt2_tensor_parallel_within_hosts_pipelined_across(hosts: SimulatedHosts, tmp_path: Path) -> None:
    # The default placement puts a TP group on neighbouring ranks (one host) and the stages across hosts.
    config = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}
    script = Path(__file__).with_name("_train_gpt2.py")
    cmd = _hydra(hosts, "-hosts", "h1:2,h2:2", sys.executable, str(script), str(tmp_path))
    proc = hosts.run(hosts.hosts[0], cmd, env=_env(config))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = _records(tmp_path, 4)
    assert [r["tp_group"] for r in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp_group"] for r in records] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["host"] for r in records] == ["h1", "h1", "h2", "h2"]
    for r in records:
        assert not r["key_mismatch"] and r["state_gap"] <= 1e-5 and r["loss_gap"] <= 1e-5, r
