"""Reused multi-process worlds for the tests.

Starting a fresh MPI world costs seconds on these machines (importing torch, starting gloo), so each
world size gets one pool, started on first use under mpiexec and kept for the whole session. A test
sends a module-level function; every rank runs fn(world, *args, **kwargs) and the per-rank results
come back in rank order. A failure on any rank, or a rank that does not answer within the timeout,
fails the test with that rank's traceback; the pool is then killed and restarted for the next test,
since its processes may be stuck in a collective.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 300.0  # starting n ranks imports torch n times: minutes on a starved 2-vCPU host
FAILURE_GRACE = 3.0  # after one rank fails, how long to wait for the others' own errors


class WorldFailure(AssertionError):
    """A distributed test body failed or timed out on at least one rank."""


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found; install it with `pip install mpich`")
    return found


def run_script(
    script: Path, n: int, *, env: dict[str, str] | None = None, timeout: float = 240.0
) -> tuple[str, int, float]:
    """Run a Python script on n ranks under plain ``mpiexec`` (no mp-launch, no test harness), with this
    interpreter's import path: (its stdout and stderr together, its exit code, seconds it took)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    start = time.monotonic()
    command = [mpiexec(), "-n", str(n), sys.executable, str(script)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    return proc.stdout + proc.stderr, proc.returncode, time.monotonic() - start


def run_job(
    command: list[str], *, env: dict[str, str] | None = None, timeout: float = 240.0
) -> tuple[str, int]:
    """Run a job (``mpiexec ...``) to its end: (its stdout and stderr together, its exit code).

    A job still running after ``timeout`` seconds fails the test with what it printed and, for every
    process of it that is still alive (mpiexec, its proxy, each rank), its state and stacks: py-spy's
    (Python and native frames) where py-spy is installed, else what /proc tells (state, kernel wait
    channel, threads). Then every one of them is killed. A hang in CI thus says where each rank was."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = [proc.pid, *_descendants(proc.pid)]
        stacks = "\n".join(_stacks(pid) for pid in alive)
        for pid in reversed(alive):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"the job did not end in {timeout:g} s: {' '.join(command)}\n--- its output (last 4000 "
            f"characters):\n{out[-4000:]}\n--- its processes still alive then:\n{stacks}"
        ) from None
    return out, proc.returncode


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), from /proc; hydra's ranks are session leaders, so a
    process group or session would miss them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def _stacks(pid: int) -> str:
    """One process's command line, state and stacks (see `run_job`): py-spy's Python and native frames,
    else (no py-spy, or Python already finalized: a rank in MPI_Finalize) gdb's native ones."""
    proc = Path(f"/proc/{pid}")
    try:
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        state = next(ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:"))
        tasks = sorted(proc.glob("task/*/wchan"))
        waits = sorted({t.read_text().strip() or "-" for t in tasks})
    except (OSError, StopIteration):
        return f"== PID {pid}: gone"
    status = state.split(":", 1)[1].strip()
    lines = [f"== PID {pid} ({status}; {len(tasks)} threads, waiting in {waits}): {cmdline}"]
    if "python" not in os.path.basename(cmdline.split(" ", 1)[0]):
        return lines[0]
    tools = (
        (shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy"), "py-spy"),
        (shutil.which("gdb"), "gdb"),
    )
    for tool, name in tools:
        if tool is None:
            continue
        command = (
            [tool, "dump", "--native", "--pid", str(pid)]
            if name == "py-spy"
            else [tool, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"]
        )
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            lines.append(f"({name} failed: {exc})")
            continue
        if name == "gdb":
            lines += [ln[:200] for ln in done.stdout.splitlines() if ln.startswith(("Thread ", "#"))]
            break
        if done.returncode == 0:
            lines.append(done.stdout)
            break
        lines.append(f"({name} failed: {(done.stderr.strip().splitlines() or ['?'])[0]})")
    return "\n".join(lines)


class Pool:
    """n ranks under one mpiexec, serving test functions until closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._task = 0
        authkey = secrets.token_bytes(16)
        # every rank connects at once: a backlog of 1 (the default) drops SYNs, and retries take seconds
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey, backlog=n)
        host, port = self._listener.address
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        # The pool's ranks live through hundreds of tests on a shared 2-core host, and twice in CI a rank of
        # a 4-rank pool stood still for 30 s (the default heartbeat timeout) at a pipeline model's
        # transport setup (MPI_Comm_dup) while its peers waited: the whole process, since even its
        # faulthandler watchdog (mp_comm.heartbeat's stacks) did not run. A hang here still ends at the
        # test's own timeout, with every rank's stacks (SIGUSR1); the heartbeat tests set their own.
        env.setdefault("MP_HEARTBEAT_TIMEOUT", "120")
        cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "tests._worker", host, str(port), authkey.hex()]
        self._proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
        self._conns: list[Connection] = []
        self._pids: dict[int, int] = {}
        ready: queue.Queue[tuple[int, Connection] | BaseException] = queue.Queue()
        threading.Thread(target=self._accept, args=(ready,), daemon=True).start()
        by_rank: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT
        while len(by_rank) < n:
            try:
                item = ready.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline or not self.alive():
                    self.kill()
                    raise WorldFailure(
                        f"the {n}-rank test world did not start (mpiexec rc={self._proc.poll()})"
                    ) from None
                continue
            if isinstance(item, BaseException):
                self.kill()
                raise WorldFailure(f"the {n}-rank test world did not start: {item!r}")
            by_rank[item[0]] = item[1]
        self._conns = [by_rank[r] for r in range(n)]

    def _accept(self, ready: queue.Queue[tuple[int, Connection] | BaseException]) -> None:
        try:
            for _ in range(self.n):
                conn = self._listener.accept()
                tag, rank, pid = conn.recv()
                assert tag == "ready", tag
                self._pids[rank] = pid
                ready.put((rank, conn))
        except BaseException as exc:  # the listener was closed because the start failed
            ready.put(exc)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        self._task += 1
        task = (self._task, fn.__module__, fn.__qualname__, args, kwargs)
        data = pickle.dumps(task)  # plain pickle: see tests/_worker.py
        for conn in self._conns:
            conn.send_bytes(data)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        pending = list(self._conns)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(pending, timeout=left):
                rank = by_conn[id(conn)]  # type: ignore[arg-type]
                pending.remove(conn)  # type: ignore[arg-type]
                try:
                    task_id, status, payload = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    errors[rank] = "rank died (its process exited or was killed)"
                    continue
                assert task_id == self._task
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
            if not self.alive() and pending:
                for conn in pending:
                    errors.setdefault(by_conn[id(conn)], "rank died (mpiexec exited)")
                break
        if errors or pending:
            if pending:
                self._dump_stacks(by_conn[id(c)] for c in pending)
            self.kill()
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            hung = sorted(by_conn[id(c)] for c in pending if by_conn[id(c)] not in errors)
            if hung:
                reason = "after another rank failed" if errors else f"within {timeout:.0f}s"
                parts.append(f"--- ranks {hung} did not answer {reason} ---")
            raise WorldFailure(f"{fn.__qualname__} failed on {self.n} ranks:\n" + "\n".join(parts))
        return [results[r] for r in range(self.n)]

    def _dump_stacks(self, ranks: Iterable[int]) -> None:
        # faulthandler in each stuck rank writes all its threads' stacks to stderr (see _worker.py)
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, KeyError):
                os.kill(self._pids[rank], signal.SIGUSR1)
        time.sleep(1.0)

    def close(self) -> None:
        if not self.alive():
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(None))
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
        self._listener.close()

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        for conn in self._conns:
            conn.close()
        self._listener.close()


class Worlds:
    """One reused pool per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, Pool] = {}

    def run(
        self, n: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Run fn(world, *args, **kwargs) on n ranks; returns the results in rank order."""
        pool = self._pools.get(n)
        if pool is None or not pool.alive():
            pool = self._pools[n] = Pool(n)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
