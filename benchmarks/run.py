"""Run every benchmark in this folder (`nox -s bench`; `nox -s bench -- NAME ...` runs only those).

A benchmark is a script whose name has no leading underscore (those are its helpers); it starts whatever
processes it needs itself and writes its results to results/ (comm_cuda_phases prints only; the GPU ones
exit at once without a GPU), so this runner only calls them one after another and reports which failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    only = set(sys.argv[1:])
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != "run.py" and not p.name.startswith("_"))
    failed = []
    for script in scripts:
        if only and script.stem not in only:
            continue
        start = time.monotonic()
        print(f"== {script.name}", flush=True)
        rc = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"== {script.name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.monotonic() - start:.0f}s")
        if rc:
            failed.append(script.name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
