"""Hydra's launcher for another host, as mp-launch runs it: the real launcher (ssh), watched.

mpiexec starts its proxy on each other host through ``-launcher-exec``; mp-launch points that at this
file (through a small shell shim), which runs the real launcher with the same arguments and writes,
into mp-launch's failure folder, how it ended. When every process of a host dies, Hydra's own report
(``control_cb ... assert (!closed) failed``) names no host; the record written here lets mp-launch
name it, with its ranks. The folder is on the launching host, where mpiexec and this wrapper run, so
this works where hosts share no file system.

Run as a file (stdlib only, no mp import): ``python -I _remote_launch.py FOLDER REAL_LAUNCHER ARGS...``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main() -> int:
    folder, launcher, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    child = subprocess.Popen([launcher, *args])
    record = os.path.join(folder, f"remote-{os.getpid()}.json")

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    _write(record, {"args": args, "started": time.time(), "code": None})
    code = child.wait()
    _write(record, {"args": args, "ended": time.time(), "code": code})
    return code if code >= 0 else 128 - code


def _write(path: str, entry: dict[str, object]) -> None:
    # Written whole, then renamed: mp-launch never reads half a record.
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            json.dump(entry, f)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
