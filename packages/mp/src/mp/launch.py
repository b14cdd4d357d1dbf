"""`mp-launch`: run a training script on N ranks under mpiexec, and stop them all when one fails.

    mp-launch -n 4 [--hosts a:4,b:4 | --hostfile FILE] [--config cfg.json] [--bind auto|none] train.py args...
    mp-launch -n 4 -m package.module args...

Every rank runs the script through `mp._rank_main`, which reports an uncaught exception (or a
non-zero `sys.exit`) with the rank's traceback and then aborts the MPI job, so the other ranks stop
within seconds instead of waiting forever in a collective. A rank killed by a signal is noticed by
mpiexec itself, which tears the job down. mp-launch exits with the failing rank's code and prints
which rank failed first and why.

On one host with at least as many cores as ranks, each rank is bound to cores of its own (`--bind
auto`, the default), taken from the CPUs mp-launch itself may use: a rank's threads then stay on its
cores, and short-lived helper threads (MPI progress, gloo's loops) no longer wake up on, and preempt,
another rank's compute.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FAILURE_DIR_ENV = "MP_LAUNCH_FAILURE_DIR"
RANK_MAIN = Path(__file__).with_name("_rank_main.py")
REMOTE_LAUNCH = Path(__file__).with_name("_remote_launch.py")
BIND_CHOICES = ("auto", "none")
HEARTBEAT_ENV = "MP_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
STOPPED_MARGIN = 5.0
"""mp-launch's own probe ends a rank stopped (SIGSTOP, state T) on its host this long after the ranks'
heartbeat (mp_comm.heartbeat, MP_HEARTBEAT_TIMEOUT) would have: it is the backstop for a rank stopped
before smp.init started the heartbeat, while the heartbeat's report, which names every rank's wait,
comes first. A slow rank keeps running (state R or S) and is never ended by either."""


def default_stopped_timeout(environ: dict[str, str] | None = None) -> float:
    """MP_HEARTBEAT_TIMEOUT (default 30 s) plus the margin; 0 (off) when the heartbeat is off."""
    raw = (os.environ if environ is None else environ).get(HEARTBEAT_ENV, "").strip()
    try:
        heartbeat = float(raw) if raw else DEFAULT_HEARTBEAT_TIMEOUT
    except ValueError:
        raise LaunchError(
            f"{HEARTBEAT_ENV}={raw!r} is not a number of seconds; expected a number >= 0 "
            f"(default {DEFAULT_HEARTBEAT_TIMEOUT:g}, 0 turns hang detection off)."
        ) from None
    return heartbeat + STOPPED_MARGIN if heartbeat > 0 else 0.0


class LaunchError(SystemExit):
    """A launcher argument is wrong; the message says which and how to fix it."""

    def __init__(self, message: str) -> None:
        super().__init__(f"mp-launch: error: {message}")


def find_mpiexec(explicit: str | None = None) -> str:
    """The mpiexec beside this Python (the MPICH wheel installs one there), else the one on PATH."""
    if explicit:
        if shutil.which(explicit) is None:
            raise LaunchError(f"--mpiexec {explicit!r} is not an executable; give the path of an mpiexec.")
        return explicit
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        raise LaunchError("no mpiexec found; install one with `pip install mpich` (a dependency of mp).")
    return found


def _parse_hosts(spec: str, nprocs: int, origin: str | None = None) -> str:
    where = origin or f"--hosts {spec!r}"
    total = 0
    for item in spec.split(","):
        host, _, count = item.partition(":")
        if not host or (count and not count.isdigit()):
            raise LaunchError(f"{where}: expected 'host:slots,host:slots', e.g. 'a:4,b:4'.")
        total += int(count) if count else 1
    if total < nprocs:
        raise LaunchError(f"{where} has {total} slots for -n {nprocs}; add hosts or slots.")
    return spec


def host_ranks(spec: str, nprocs: int) -> dict[str, list[int]]:
    """The ranks Hydra places on each host of a --hosts spec: each host's slots in turn, in the spec's
    order, round again while ranks are left (``a:2,b:2`` with -n 4: a 0 1, b 2 3)."""
    items = (item.partition(":") for item in spec.split(","))
    slots = [(host, int(count) if count else 1) for host, _, count in items]
    placed: dict[str, list[int]] = {host: [] for host, _ in slots}
    rank = 0
    while rank < nprocs and any(n > 0 for _, n in slots):
        for host, n in slots:
            take = min(n, nprocs - rank)
            placed[host].extend(range(rank, rank + take))
            rank += take
    return {host: ranks for host, ranks in placed.items() if ranks}


def read_hostfile(path: str) -> str:
    """A hostfile as a --hosts spec. Lines are MPICH's ``host`` or ``host:slots`` or DeepSpeed's (and
    Open MPI's) ``host slots=N``; ``#`` starts a comment."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(
            f"--hostfile {path!r} cannot be read ({exc.strerror}); give a file of hosts."
        ) from None
    items: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *options = line.split()
        slots = ""
        for option in options:
            key, _, value = option.partition("=")
            if key in ("slots", "max_slots") and value.isdigit() and not slots:
                slots = value
            elif key not in ("slots", "max_slots"):
                raise LaunchError(
                    f"--hostfile {path!r} line {number}: {raw.strip()!r}; expected 'host', 'host:slots' "
                    "or 'host slots=N'."
                )
        if slots and ":" in host:
            raise LaunchError(f"--hostfile {path!r} line {number}: {raw.strip()!r} gives the slots twice.")
        items.append(f"{host}:{slots}" if slots else host)
    if not items:
        raise LaunchError(f"--hostfile {path!r} names no host; write one 'host:slots' line per host.")
    return ",".join(items)


def core_groups(cpus: Iterable[int] | None = None) -> list[list[int]]:
    """The CPUs among `cpus` (default: those this process may run on) grouped by physical core, in CPU
    order: a core's hardware threads stay together. A CPU whose topology Linux does not publish counts
    as a core of its own."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # not Linux: no binding by mp-launch anyway
            cpus = range(os.cpu_count() or 1)
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (
                (topology / "physical_package_id").read_text().strip(),
                (topology / "core_id").read_text().strip(),
            )
        except OSError:
            key = ("cpu", str(cpu))
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def physical_cores(cpus: Iterable[int] | None = None) -> int:
    """Distinct physical cores among `cpus` (default: the CPUs this process may run on)."""
    return max(1, len(core_groups(cpus)))


def rank_cpu_sets(cores_per_rank: int, nprocs: int, groups: list[list[int]]) -> list[list[int]]:
    """The CPUs of each rank: `cores_per_rank` consecutive whole cores each, from `groups`."""
    k = cores_per_rank
    return [[cpu for core in groups[r * k : (r + 1) * k] for cpu in core] for r in range(nprocs)]


def is_hydra(mpiexec: str) -> bool:
    """Whether `mpiexec` is MPICH's Hydra (whose binding flags mp-launch speaks): asks `mpiexec
    --version`."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in out.stdout + out.stderr


class Mpiexec:
    """The mpiexec of one launch: its path, and whether it is Hydra, asked once (on first use) and kept
    for the launch's binding, remote watch and --tag-output."""

    def __init__(self, path: str) -> None:
        self.path = path

    @functools.cached_property
    def hydra(self) -> bool:
        return is_hydra(self.path)


def binding(bind: str, nprocs: int, *, hosts: str | None, cores: int, hydra: bool) -> int:
    """Cores per rank that `--bind` asks for on this launch; 0 for no binding.

    `auto` binds only where it is known to help and to be right: one host (mp-launch cannot see other
    hosts' cores), at least one core per rank, and MPICH's Hydra as the launcher (other mpiexecs have
    their own defaults: Open MPI binds by itself).
    """
    if bind not in BIND_CHOICES:
        raise LaunchError(f"--bind {bind!r}: expected one of {', '.join(BIND_CHOICES)}.")
    if bind == "none" or hosts or not hydra or not 0 < nprocs <= cores:
        return 0
    return cores // nprocs


def placement(
    bind: str, nprocs: int, mpiexec: Mpiexec, *, hosts: str | None = None
) -> list[list[int]] | None:
    """Each rank's CPUs under `--bind` for this launch, from this process's own CPU set; None for no
    binding (see `binding` for when that is)."""
    groups = core_groups()
    cores_per_rank = binding(
        bind, nprocs, hosts=hosts, cores=len(groups), hydra=bind != "none" and mpiexec.hydra
    )
    return rank_cpu_sets(cores_per_rank, nprocs, groups) if cores_per_rank else None


def bind_arguments(cpu_sets: list[list[int]]) -> list[str]:
    """Hydra's flags that pin rank r to `cpu_sets[r]`.

    Explicit CPU lists, not `-bind-to core:K`: Hydra hands out cores from the whole machine, ignoring
    the CPUs mp-launch itself was confined to (`taskset`, a batch system's CPU set), so two jobs kept
    apart that way would be stacked on the same cores.
    """
    return ["-bind-to", "user:" + ",".join("+".join(map(str, cpus)) for cpus in cpu_sets)]


def _config_env(config: str | None) -> dict[str, str]:
    if config is None:
        return {}
    text = config.strip()
    if text.startswith("{"):
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise LaunchError(
                f"--config is not valid JSON ({exc}); pass a JSON object or a file path."
            ) from None
        return {"MP_CONFIG": text}
    path = Path(config)
    if not path.is_file():
        raise LaunchError(f"--config {config!r} is neither a JSON object nor an existing file.")
    return {"MP_CONFIG": str(path.resolve())}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mp-launch",
        description="Run a training script on N ranks under mpiexec; any rank failing stops all of them.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", help="hosts and slots, e.g. 'a:4,b:4' (default: this host)")
    hosts.add_argument(
        "--hostfile", help="a file of hosts, one per line: 'host:slots' (MPICH) or 'host slots=N' (DeepSpeed)"
    )
    parser.add_argument(
        "--launcher-exec",
        help="the program that starts processes on other hosts, instead of ssh (Hydra's -launcher-exec)",
    )
    parser.add_argument("--config", help="the smp config: a JSON file or an inline JSON object")
    parser.add_argument("--mpiexec", help="the mpiexec to use (default: the one beside this Python)")
    parser.add_argument(
        "--bind",
        default="auto",
        help="auto (default): on one host with a core or more per rank, bind each rank to cores//n cores "
        "of its own (and run that many torch threads); none: leave placement to the OS",
    )
    parser.add_argument(
        "--stopped-timeout",
        type=float,
        default=None,
        help="end the job when a rank on this host stays stopped (SIGSTOP, state T) this many seconds "
        f"(default: ${HEARTBEAT_ENV}, {DEFAULT_HEARTBEAT_TIMEOUT:g} unless set, plus {STOPPED_MARGIN:g}; "
        "0 turns it off)",
    )
    parser.add_argument("--tag-output", action="store_true", help="prefix every output line with its rank")
    parser.add_argument(
        "--memory-report",
        action="store_true",
        help="each rank prints its memory (parameters, gradients, optimizer state, peak activations) after "
        "the first step (sets MP_MEMORY_REPORT=1, see smp.memory_report)",
    )
    parser.add_argument("-m", dest="module", help="run a module (like python -m) instead of a script")
    parser.add_argument("script_and_args", nargs=argparse.REMAINDER, help="script path and its arguments")
    return parser


def hosts_spec(args: argparse.Namespace) -> str | None:
    """The --hosts or --hostfile of a launch as Hydra's -hosts value (checked), or None for this host."""
    if getattr(args, "hostfile", None):
        origin = f"--hostfile {args.hostfile!r}"
        return _parse_hosts(read_hostfile(args.hostfile), args.nprocs, origin)
    if args.hosts:
        return _parse_hosts(args.hosts, args.nprocs)
    return None


def remote_launcher(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """The program Hydra will start other hosts' proxies with, where mp-launch can watch it: the
    --launcher-exec given, else ssh on a launch over hosts outside a Slurm allocation (inside one,
    Hydra starts them with srun and Slurm reports a lost node itself)."""
    given = getattr(args, "launcher_exec", None)
    if given:
        found: str | None = shutil.which(given)
        if found is None:
            raise LaunchError(f"--launcher-exec {given!r} is not an executable; give its path.")
        return found
    env = os.environ if environ is None else environ
    if not (args.hosts or getattr(args, "hostfile", None)) or "SLURM_JOB_ID" in env:
        return None
    return shutil.which("ssh")


def build_command(
    args: argparse.Namespace,
    mpiexec: str,
    cpu_sets: list[list[int]] | None = None,
    remote: RemoteWatch | None = None,
) -> list[str]:
    if args.nprocs < 1:
        raise LaunchError(f"-n {args.nprocs}: the number of ranks must be at least 1.")
    cmd = [mpiexec, "-n", str(args.nprocs)]
    spec = hosts_spec(args)
    if spec:
        cmd += ["-hosts", spec]
    if remote is not None:
        cmd += remote.mpiexec_arguments()
    elif getattr(args, "launcher_exec", None):
        cmd += ["-launcher", "ssh", "-launcher-exec", remote_launcher(args) or args.launcher_exec]
    if cpu_sets:
        cmd += bind_arguments(cpu_sets)
    # The runner is started as a file, not as `-m mp._rank_main`: that would import the whole mp
    # package (torch included) in every rank before the user's script even starts.
    cmd += [sys.executable, str(RANK_MAIN)]
    rest = list(args.script_and_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if args.module:
        cmd += ["-m", args.module, *rest]
    else:
        if not rest:
            raise LaunchError("no script given; usage: mp-launch -n 4 train.py [args...]")
        if not Path(rest[0]).is_file():
            raise LaunchError(f"script {rest[0]!r} does not exist.")
        cmd += rest
    return cmd


def _report_failures(failure_dir: Path) -> int | None:
    reports = sorted(
        [*failure_dir.glob("rank-*.json"), *failure_dir.glob("hang-*.json")], key=lambda p: p.stat().st_mtime
    )
    if not reports:
        return None
    if reports[0].name.startswith("hang-"):
        return _report_hang(json.loads(reports[0].read_text()))
    reports = [p for p in reports if p.name.startswith("rank-")]
    first = json.loads(reports[0].read_text())
    others = [json.loads(p.read_text())["rank"] for p in reports[1:]]
    print(
        f"\nmp-launch: rank {first['rank']} failed first (exit code {first['code']}); all ranks were stopped."
        + (f" Ranks {others} failed too." if others else ""),
        file=sys.stderr,
    )
    print(f"--- rank {first['rank']} ---\n{first['traceback']}", file=sys.stderr, end="")
    return int(first["code"]) or 1


def _report_hang(entry: dict[str, Any]) -> int:
    """A rank's heartbeat found peers silent (mp_comm.heartbeat): name them, then its full report."""
    names = ", ".join(entry["names"])
    print(
        f"\nmp-launch: {names} stopped answering (no heartbeat; noticed by rank {entry['rank']}); all ranks "
        f"were stopped.\n{entry['report']}",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stopped_timeout is None:
        args.stopped_timeout = default_stopped_timeout()
    mpiexec = Mpiexec(find_mpiexec(args.mpiexec))
    cpu_sets = placement(args.bind, args.nprocs, mpiexec, hosts=args.hosts or args.hostfile)
    env = dict(os.environ)
    env.update(_config_env(args.config))
    if args.memory_report:
        env["MP_MEMORY_REPORT"] = "1"  # read by mp.memory_report in every rank
    if cpu_sets and "OMP_NUM_THREADS" not in env and "MP_NUM_THREADS" not in env:
        # A rank runs a thread per core of its own (smp.init would otherwise count its hardware threads).
        env["MP_NUM_THREADS"] = str(len(core_groups(cpu_sets[0])))
    spec = hosts_spec(args)
    with tempfile.TemporaryDirectory(prefix="mp-launch-") as tmp:
        env[FAILURE_DIR_ENV] = tmp
        real_launcher = remote_launcher(args) if mpiexec.hydra else None
        remote = RemoteWatch(Path(tmp), real_launcher) if spec and real_launcher else None
        cmd = build_command(args, mpiexec.path, cpu_sets, remote)
        # mpiexec's own output passes through us so that its report of a dead process (PID and host
        # only) can be turned into the rank's name; the ranks' output is forwarded line by line.
        tagged = None
        if args.tag_output:  # the ranks' output reaches us rank by rank, tagged here line by line
            if not mpiexec.hydra:
                raise LaunchError(
                    f"--tag-output needs MPICH's Hydra mpiexec, and --mpiexec {mpiexec.path!r} is another; "
                    "drop --tag-output, or use the mpiexec that `pip install mpich` brings."
                )
            tagged = _TaggedOutput(Path(tmp), args.nprocs)
            cmd[1:1] = tagged.mpiexec_arguments()
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE)
        watcher = _DeathWatch(proc, Path(tmp), args.stopped_timeout)

        def forward(signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            watcher.forward()
            rc = proc.wait()
        finally:
            if tagged is not None:
                tagged.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
        reported = _report_failures(Path(tmp))
        if rc != 0 and reported is None:
            who = watcher.describe()
            lost = remote.lost() if remote is not None and spec else []
            if lost and not watcher.first_before(lost[0][2]):
                host, code, _ = lost[0]
                ranks = ", ".join(map(str, host_ranks(spec or "", args.nprocs).get(host, [])))
                who = (
                    f": host {host} (ranks {ranks}) was lost first (the launcher's connection to it ended: "
                    f"{code_text(code)}; every process there ended, or the host went down)"
                )
            how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            if watcher.stopped is not None:
                how = "a rank stopped running"
            elif rc == 9:
                how = "a rank was killed by signal 9 (SIGKILL), e.g. by the out-of-memory killer"
            print(f"\nmp-launch: the job failed ({how}){who}; all ranks were stopped.", file=sys.stderr)
    if rc != 0:
        return rc if rc > 0 else (reported or 1)
    return 0


class _TaggedOutput:
    """`--tag-output`: every line a rank writes, whole, once prefixed with ``[rank] ``.

    Hydra's own ``-prepend-rank`` prefixes each chunk it reads from a rank, so a rank writing
    unbuffered (``python -u``, ``PYTHONUNBUFFERED=1``: one write per `print` argument) came out as
    tagged fragments. Instead Hydra writes each rank's stdout and stderr to a file of its own
    (``-outfile-pattern``/``-errfile-pattern``, opened by mpiexec on this host, ranks on other hosts
    included); those files are FIFOs that a thread here reads, keeping each rank's partial line until
    its newline comes.
    """

    MAX_LINE = 1 << 16  # a line longer than this without a newline is written in pieces of this size

    def __init__(self, folder: Path, nprocs: int) -> None:
        self.folder = folder
        _enough_descriptors(2 * nprocs + 64)
        self._fds: dict[int, tuple[int, Any]] = {}  # fd -> (rank, our stdout or stderr)
        self._pending: dict[int, bytes] = {}
        for stream, out in (("out", sys.stdout), ("err", sys.stderr)):
            for rank in range(nprocs):
                path = folder / f"{stream}-{rank}"
                os.mkfifo(path)
                # Opened without blocking before mpiexec opens it to write: a FIFO no writer has opened
                # yet reads as empty (poll reports nothing), not as ended.
                self._fds[os.open(path, os.O_RDONLY | os.O_NONBLOCK)] = (rank, out)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mp-launch-tag-output", daemon=True)
        self._thread.start()

    def mpiexec_arguments(self) -> list[str]:
        return [
            "-outfile-pattern",
            str(self.folder / "out-%r"),
            "-errfile-pattern",
            str(self.folder / "err-%r"),
        ]

    def _run(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        open_fds = set(self._fds)
        while open_fds and not self._done.is_set():
            for fd, _ in poller.poll(100):
                if not self._read(fd):
                    poller.unregister(fd)
                    open_fds.discard(fd)
        # mpiexec has exited: what it wrote is in the FIFOs' buffers; read it to the end.
        for fd in open_fds:
            while self._read(fd):
                pass
        for fd, rest in self._pending.items():
            if rest:
                self._write(fd, rest + b"\n")
        for fd in self._fds:
            os.close(fd)

    def _read(self, fd: int) -> bool:
        """Read what is there and write the complete lines; False at the end or when nothing was read."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            return False
        data = self._pending.get(fd, b"") + chunk
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) >= self.MAX_LINE:
            end = len(data)
        if end:
            self._write(fd, data[:end])
        self._pending[fd] = data[end:]
        return True

    def _write(self, fd: int, lines: bytes) -> None:
        rank, out = self._fds[fd]
        tag = b"[%d] " % rank
        parts = lines.split(b"\n")
        text = b"".join(tag + line + b"\n" for line in parts[:-1])
        if parts[-1]:  # a piece of an overlong line
            text += tag + parts[-1] + b"\n"
        with contextlib.suppress(OSError, ValueError):  # our own stdout closed: the job goes on
            out.buffer.write(text)
            out.buffer.flush()

    def close(self) -> None:
        """After mpiexec has exited: write what is left and stop."""
        self._done.set()
        self._thread.join()


def _enough_descriptors(needed: int) -> None:
    """Raise this process's limit on open files to `needed` where the hard limit allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


_DEAD = re.compile(rb"PID (\d+) RUNNING AT (\S+)")
_CODE = re.compile(rb"EXIT CODE: (\d+)")


class _DeathWatch:
    """Names the rank that died first without a report (kill -9, the OOM killer).

    mpiexec tears the job down when a process dies, but its banner (MPICH hydra: ``PID 1234 RUNNING AT
    host``, ``EXIT CODE: 9``) may name one of the processes it killed afterwards. So a thread watches
    the ranks of this host (registered by mp._rank_main in the failure folder) through pidfds and notes
    the first to exit: the others are killed only after mpiexec has heard of that death. The banner's
    exit code is used when its PID is that rank's. Ranks on other hosts are not watched.
    """

    def __init__(
        self, proc: subprocess.Popen[bytes], failure_dir: Path, stopped_timeout: float = 0.0
    ) -> None:
        self.proc = proc
        self.failure_dir = failure_dir
        self.stopped_timeout = stopped_timeout
        self.stopped: tuple[int, int, float] | None = None  # (rank, pid, seconds) of a rank ended for it
        self.first: list[tuple[int, int]] = []  # (rank, pid) of the ranks seen dead at the first look
        self.first_at: float | None = None  # when (time.time()) they were seen dead
        self.banner: tuple[int, str, int | None] | None = None  # (pid, host, code)
        self._thread = threading.Thread(target=self._watch, name="mp-launch-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        watched: dict[int, tuple[int, int]] = {}  # fd -> (rank, pid)
        seen: set[str] = set()
        host = socket.gethostname()
        since: dict[int, float] = {}  # pid -> when it was first seen stopped
        next_look = 0.0
        while self.proc.poll() is None and not self.first:
            for path in self.failure_dir.glob("pid-*.json"):
                if path.name in seen:
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    entry = json.loads(path.read_text())
                    seen.add(path.name)
                    if entry["host"] == host:
                        rank, pid = int(entry["rank"]), int(entry["pid"])
                        try:
                            fd = os.pidfd_open(pid)
                        except ProcessLookupError:  # gone before it could be watched: it died first
                            self.first.append((rank, pid))
                            continue
                        watched[fd] = (rank, pid)
                        poller.register(fd, select.POLLIN)
            # Several found dead at one look cannot be told apart (mpiexec kills the rest at once, and a
            # rank may register only after it was killed): all of them are named.
            ready = [watched[fd] for fd, _ in poller.poll(0 if self.first else 20)]
            self.first = sorted({*self.first, *ready})
            if self.first and self.first_at is None:
                self.first_at = time.time()
            if self.stopped_timeout > 0 and not self.first and time.monotonic() >= next_look:
                next_look = time.monotonic() + 0.5
                self._look_for_stopped(watched.values(), since)
        for fd in watched:
            os.close(fd)

    def _look_for_stopped(self, ranks: Iterable[tuple[int, int]], since: dict[int, float]) -> None:
        """The liveness probe: a rank in state T (stopped) for `stopped_timeout` seconds ends the job."""
        now = time.monotonic()
        for rank, pid in ranks:
            if _state(pid) != "T":
                since.pop(pid, None)
                continue
            first = since.setdefault(pid, now)
            if now - first >= self.stopped_timeout:
                self.stopped = (rank, pid, now - first)
                print(
                    f"\nmp-launch: rank {rank} (PID {pid} on host {socket.gethostname()}) has been stopped "
                    f"(SIGSTOP) for {now - first:.0f} s; ending the job ({HEARTBEAT_ENV} + "
                    f"{STOPPED_MARGIN:g} s).",
                    file=sys.stderr,
                    flush=True,
                )
                self._dump_others(ranks, pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # mpiexec then tears the rest of the job down
                return

    def _dump_others(self, ranks: Iterable[tuple[int, int]], stopped: int) -> None:
        """Ask the other ranks what they were doing (SIGUSR1: mp._rank_main dumps every thread's stack)
        and print the innermost frames of each rank's threads."""
        others = sorted((r, p) for r, p in ranks if p != stopped)
        for _, pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        for rank, _ in others:
            path = self.failure_dir / f"stacks-{rank}.txt"
            with contextlib.suppress(OSError):
                print(f"--- rank {rank} was doing ---\n{_summary(path.read_text())}", file=sys.stderr)

    def forward(self) -> None:
        """Copy mpiexec's stdout to ours line by line, noting its report of a dead process."""
        assert self.proc.stdout is not None
        out = sys.stdout.buffer
        for line in iter(self.proc.stdout.readline, b""):
            out.write(line)
            out.flush()
            if self.banner is None and (hit := _DEAD.search(line)):
                self.banner = int(hit.group(1)), hit.group(2).decode(errors="replace"), None
            elif self.banner is not None and self.banner[2] is None and (hit := _CODE.search(line)):
                self.banner = (self.banner[0], self.banner[1], int(hit.group(1)))

    def first_before(self, when: float) -> bool:
        """Whether a rank of this host was seen dead before `when` (time.time())."""
        self._thread.join(1.0)
        return self.first_at is not None and self.first_at < when

    def describe(self) -> str:
        """``: rank R (PID P on host H) died first, killed by signal 9 (SIGKILL)``, or '' if unknown."""
        self._thread.join(1.0)
        if self.stopped is not None:
            rank, pid, took = self.stopped
            return (
                f": rank {rank} (PID {pid} on host {socket.gethostname()}) was stopped (SIGSTOP) for "
                f"{took:.0f} s and was ended by mp-launch"
            )
        host = socket.gethostname()
        if len(self.first) == 1:
            rank, pid = self.first[0]
            how = ""
            if self.banner is not None and self.banner[0] == pid and self.banner[2]:
                with contextlib.suppress(ValueError):
                    code = self.banner[2]
                    how = f", killed by signal {code} ({signal.Signals(code).name})"
            return f": rank {rank} (PID {pid} on host {host}) died first{how}"
        if self.first:
            named = ", ".join(f"rank {rank} (PID {pid})" for rank, pid in self.first)
            return f": {named} on host {host} were found dead together, one of them first"
        if self.banner is not None:
            pid, host, _ = self.banner
            return f": mpiexec reports PID {pid} on host {host}"
        return ""


class RemoteWatch:
    """Watches the proxies Hydra starts on other hosts: mpiexec's ``-launcher-exec`` becomes a shim that
    runs the real launcher through mp/_remote_launch.py, which records in the failure folder when and how
    each one ended. Hydra's report of a proxy that went away (``assert (!closed) failed``) names no host;
    these records do."""

    WAIT = 2.0  # seconds to wait, after mpiexec ended, for a launcher to write how it ended

    def __init__(self, folder: Path, launcher: str) -> None:
        self.folder = folder
        self.shim = folder / "remote-launch"
        run = shlex.join([sys.executable, "-I", str(REMOTE_LAUNCH), str(folder), launcher])
        self.shim.write_text(f'#!/bin/sh\nexec {run} "$@"\n')
        self.shim.chmod(0o700)

    def mpiexec_arguments(self) -> list[str]:
        return ["-launcher", "ssh", "-launcher-exec", str(self.shim)]

    def lost(self) -> list[tuple[str, int, float]]:
        """(host, exit code, when) of each launcher that ended with a failure, the first first."""
        deadline = time.monotonic() + self.WAIT
        while True:
            records = []
            for path in self.folder.glob("remote-*.json"):
                with contextlib.suppress(OSError, ValueError):
                    records.append(json.loads(path.read_text()))
            if all(r.get("code") is not None for r in records) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        failed = [
            (_launched_host(r["args"]), int(r["code"]), float(r["ended"]))
            for r in records
            if r.get("code") not in (None, 0)
        ]
        return sorted(failed, key=lambda item: item[2])


def _launched_host(args: list[str]) -> str:
    """The host in a launcher's command line as Hydra writes it for ssh: ``-x HOST "proxy ..."``."""
    rest = [a for a in args if a != "-x"]
    return rest[0] if rest else "?"


def code_text(code: int) -> str:
    """How a launcher ended, in words: ssh ends with 255 when its connection breaks."""
    if code < 0:
        return f"killed by signal {-code}"
    if code == 255:
        return "ssh exit status 255, the connection was closed"
    return f"exit status {code}"


def _summary(stacks: str, frames: int = 4) -> str:
    """faulthandler's dump cut to the innermost `frames` frames of each thread."""
    out: list[str] = []
    kept = 0
    for line in stacks.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            out.append(line)
            kept = 0
        elif line.startswith("  File ") and kept < frames:
            out.append(line)
            kept += 1
    return "\n".join(out)


def _state(pid: int) -> str:
    """A process's state letter from /proc (R running, S sleeping, T stopped, ...); '' if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
