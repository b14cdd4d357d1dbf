"""Hosts simulated on one machine, for the multi-host tests (and by hand: `python -m tests.multihost.hosts`).

Each host is a network namespace with its own address on a bridge (a veth pair), its own name (its
/etc/hosts from /etc/netns/NS/hosts, and a UTS namespace for each process started in it) and a real
sshd with a key made for the run, so that MPI's hydra reaches it over ssh as it reaches a real node.
Traffic stays on these addresses and loopback. `teardown` removes everything it made, processes
included. Needs root, iproute2 and Debian's openssh-server.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
CABLE = Path(__file__).with_name("_cable.py")
# The cgroup (v1) controllers mounted again under the fresh /sys of `ip netns exec`, for slurmd.
_CGROUP_V1 = (
    "mount -t tmpfs cgroups /sys/fs/cgroup && for c in cpuset memory freezer devices cpu cpuacct; do "
    "mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 1; done"
)


class HostsUnavailable(RuntimeError):
    """This machine cannot simulate hosts (not root, no network namespaces, no sshd)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def missing_requirements() -> str | None:
    """Why hosts cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r} (Debian: iproute2, util-linux, openssh-client)"
    if not Path(SSHD).exists():
        return f"simulated hosts need {SSHD} (Debian: apt-get install openssh-server)"
    return None


def free_subnet(prefix: str = "10.77", skip: int = 0) -> str:
    """The first ``prefix.N`` /24 that no interface here has an address in (skipping the first `skip`)."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    for n in range(skip, 256):
        if f" {prefix}.{n}." not in used:
            return f"{prefix}.{n}"
    raise HostsUnavailable(f"every {prefix}.N.0/24 is in use on this machine")


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    extra: dict[str, str] = field(default_factory=dict)
    """Further interfaces made for this host: name -> address."""


@dataclass
class SimulatedHosts:
    """Hosts h1..hN on a bridge. Use `start()` (or the context manager `simulated_hosts`)."""

    count: int = 2
    subnet: str = ""
    """The hosts' /24, "A.B.C" (default: the first 10.77.N.0/24 no interface of this machine uses, so that
    runs side by side, or a run beside leftovers, never share addresses)."""
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mp-hosts-")))
    _sshd: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)
    _pidfiles: list[Path] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"mpbr{self.tag}"

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def start(self) -> SimulatedHosts:
        why = missing_requirements()
        if why is not None:
            raise HostsUnavailable(why)
        try:
            self._make_network()
            self._make_ssh()
        except BaseException:
            self.teardown()
            raise
        return self

    # -- network ---------------------------------------------------------------------------------------

    def _make_network(self) -> None:
        if not self.subnet:
            self.subnet = free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(1, self.count + 1):
            host = Host(f"h{i}", f"mp-h{i}-{self.tag}", f"{self.subnet}.{i}")
            _run("ip", "netns", "add", host.namespace)
            self.hosts.append(host)
            outer = f"mpv{self.tag}{i}"
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            self._links.append(outer)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            self.exec_ip(host, "addr", "add", f"{host.address}/24", "dev", "eth0")
            self.exec_ip(host, "link", "set", "eth0", "up")
            self.exec_ip(host, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost"] + [f"{h.address} {h.name}" for h in self.hosts]
        for host in self.hosts:
            folder = Path("/etc/netns") / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def exec_ip(self, host: Host, *args: str) -> None:
        _run("ip", "-n", host.namespace, *args)

    def exec_tc(self, host: Host, *args: str, check: bool = True) -> None:
        """tc in `host`'s namespace (tc netem shapes its links)."""
        _run("ip", "netns", "exec", host.namespace, "tc", *args, check=check)

    def add_isolated_interface(self, host: Host, name: str, address: str) -> None:
        """Give `host` a further interface whose network no other host reaches (one end of a veth pair
        whose other end stays in the host too: not every kernel has the dummy device)."""
        self.exec_ip(host, "link", "add", name, "type", "veth", "peer", "name", f"{name}p")
        self.exec_ip(host, "addr", "add", f"{address}/24", "dev", name)
        self.exec_ip(host, "link", "set", f"{name}p", "up")
        self.exec_ip(host, "link", "set", name, "up")
        host.extra[name] = address

    def link(self, host: Host) -> str:
        """The name of `host`'s cable on the bridge (for `ip link set ... down`, tc netem)."""
        return f"mpv{self.tag}{self.hosts.index(host) + 1}"

    @contextlib.contextmanager
    def slow_cable(self, host: Host, delay_ms: float, loss: float) -> Iterator[Path]:
        """`host`'s cable to the bridge made slow and lossy by a relay in user space (tests/multihost/
        _cable.py): every frame, either way, `delay_ms` later, and each dropped with probability `loss`,
        as netem would on both ends of the link, for kernels without it. Yields the file where the relay
        writes how many frames it forwarded and dropped. The offloads of the interfaces on the way stay
        off afterwards."""
        i = self.hosts.index(host) + 1
        outer, inner, bridge_side = self.link(host), f"mpl{self.tag}{i}a", f"mpl{self.tag}{i}b"
        # A packet socket sends a frame as it is: no interface on the way may leave segments merged
        # (GSO) or checksums to be filled in later (veth's offloads).
        plain = [("", [outer, inner, bridge_side])] + [(h.namespace, ["eth0"]) for h in self.hosts]
        _run("ip", "link", "add", inner, "type", "veth", "peer", "name", bridge_side)
        stats = self.workdir / f"cable-{host.name}.json"
        relay: subprocess.Popen[str] | None = None
        try:
            for namespace, names in plain:
                where = ["ip", "netns", "exec", namespace] if namespace else []
                _run(*where, sys.executable, str(CABLE), "--plain", *names)
            _run("ip", "link", "set", bridge_side, "master", self.bridge)
            _run("ip", "link", "set", outer, "nomaster")
            for name in (inner, bridge_side):
                _run("ip", "link", "set", name, "up")
            relay = subprocess.Popen(
                [sys.executable, str(CABLE), outer, inner, str(delay_ms), str(loss), str(stats)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert relay.stdout is not None
            if relay.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the cable relay for {host.name} did not start (exit {relay.wait()})")
            yield stats
        finally:
            if relay is not None:
                relay.terminate()
                relay.wait(timeout=10)
            _run("ip", "link", "del", inner, check=False)
            _run("ip", "link", "set", outer, "master", self.bridge, check=False)

    # -- processes -------------------------------------------------------------------------------------

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """`argv` as run on `host`: in its network namespace, under its own host name."""
        inner = f"hostname {shlex.quote(host.name)} && exec {shlex.join(argv)}"
        return ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c", inner]

    def run(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        cwd: str | Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(host, argv), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
        )

    def popen(
        self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(host, argv), env=env, text=True, **kwargs)  # type: ignore[call-overload]

    def pids(self, host: Host) -> list[int]:
        out = _run("ip", "netns", "pids", host.namespace, check=False).stdout
        return [int(p) for p in out.split()]

    # -- ssh -------------------------------------------------------------------------------------------

    def _make_ssh(self) -> None:
        key = self.workdir / "id_ed25519"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        hostkey = self.workdir / "host_ed25519"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey))
        shutil.copy(f"{key}.pub", self.workdir / "authorized_keys")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
        for host in self.hosts:
            config = self.workdir / f"sshd_{host.name}.conf"
            config.write_text(
                "\n".join(
                    [
                        f"ListenAddress {host.address}",
                        "Port 22",
                        f"HostKey {hostkey}",
                        f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}",
                        "PermitRootLogin prohibit-password",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "StrictModes no",
                        f"PidFile {self.workdir / f'sshd_{host.name}.pid'}",
                        "MaxStartups 100",
                        "LogLevel ERROR",
                    ]
                )
                + "\n"
            )
            log = open(self.workdir / f"sshd_{host.name}.log", "wb")  # noqa: SIM115 (owned by the process)
            proc = subprocess.Popen(
                self.command(host, [SSHD, "-D", "-e", "-f", str(config)]), stdout=log, stderr=log
            )
            self._sshd.append(proc)
        ssh_config = self.workdir / "ssh_config"
        ssh_config.write_text(
            "Host *\n"
            f"  IdentityFile {key}\n"
            "  User root\n"
            "  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 10\n"
        )
        wrapper = self.workdir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec ssh -F {ssh_config} "$@"\n')
        wrapper.chmod(0o755)
        deadline = time.monotonic() + 30
        for host in self.hosts:  # each sshd answers, from every other host
            while True:
                probe = self.run(self.hosts[0], [str(wrapper), host.name, "hostname"], timeout=30)
                if probe.returncode == 0 and probe.stdout.strip() == host.name:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {host.name} does not answer: {probe.stderr.strip()}")
                time.sleep(0.2)

    @property
    def ssh(self) -> Path:
        """An ssh command (hydra's -launcher-exec) that reaches every host as root with the run's key."""
        return self.workdir / "ssh"

    # -- slurm -----------------------------------------------------------------------------------------

    def start_slurm(self) -> dict[str, str]:
        """A Slurm cluster over the hosts (Debian's slurm-wlm and munge): one munged with a key of the
        run's, slurmctld on h1, a slurmd on each host. Returns the environment its clients (srun,
        sbatch, squeue) need. Stopped by `teardown`."""
        for tool in ("munged", "slurmctld", "slurmd", "srun"):
            if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
                raise HostsUnavailable(f"Slurm needs {tool!r} (Debian: apt-get install slurm-wlm munge)")
        folder = self.workdir / "slurm"
        folder.mkdir()
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        socket_path = folder / "munge.sock"
        munged = shutil.which("munged") or "/usr/sbin/munged"
        _run(
            munged,
            "--force",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={folder / 'munged.pid'}",
            f"--seed-file={folder / 'munged.seed'}",
            f"--log-file={folder / 'munged.log'}",
        )
        self._pidfiles.append(folder / "munged.pid")
        nodes = "\n".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for h in self.hosts
        )
        (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
        conf = folder / "slurm.conf"
        conf.write_text(
            f"""ClusterName=mptest{self.tag}
SlurmctldHost={self.hosts[0].name}({self.hosts[0].address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={folder}/ctld
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
        )
        env = {**os.environ, "SLURM_CONF": str(conf)}
        log = open(folder / "daemons.log", "wb")  # noqa: SIM115 (owned by the processes)
        self._sshd.append(
            subprocess.Popen(
                self.command(self.hosts[0], ["slurmctld", "-D", "-i"]), env=env, stdout=log, stderr=log
            )
        )
        for host in self.hosts:
            self._sshd.append(
                # `ip netns exec` mounts a fresh /sys without the cgroup file systems, which slurmd needs:
                # mount the v1 controllers there again, in the host's own mount namespace only.
                subprocess.Popen(
                    self.command(
                        host,
                        [
                            "sh",
                            "-c",
                            f"{_CGROUP_V1} && exec slurmd -D -N {host.name}",
                        ],
                    ),
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
        deadline = time.monotonic() + 60
        while True:
            info = self.run(self.hosts[0], ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, timeout=30)
            states = dict(line.split() for line in info.stdout.splitlines() if line.strip())
            if all(states.get(h.name) == "idle" for h in self.hosts):
                return env
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm's nodes did not come up: {info.stdout!r} {info.stderr!r}")
            time.sleep(0.5)

    # -- teardown --------------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Stop every process in the hosts and remove the namespaces, links, files made by `start`."""
        for proc in self._sshd:
            proc.terminate()
        for pidfile in self._pidfiles:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
        self._pidfiles.clear()
        for host in self.hosts:
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._sshd:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._sshd.clear()
        for host in self.hosts:
            _run("ip", "netns", "del", host.namespace, check=False)
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)
        for link in reversed(self._links):
            _run("ip", "link", "del", link, check=False)
        self.hosts.clear()
        self._links.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def simulated_hosts(count: int = 2, subnet: str = "") -> Iterator[SimulatedHosts]:
    hosts = SimulatedHosts(count=count, subnet=subnet).start()
    try:
        yield hosts
    finally:
        hosts.teardown()


if __name__ == "__main__":  # by hand: start two hosts, show how to reach them, wait for Ctrl-C
    with simulated_hosts() as made:
        print("hosts:", ", ".join(f"{h.name}={h.address} (netns {h.namespace})" for h in made.hosts))
        print(f"mpiexec -launcher ssh -launcher-exec {made.ssh} -hosts h1:2,h2:2 ... (run inside h1:)")
        print(shlex.join(made.command(made.hosts[0], ["bash"])))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
