"""Run the regression set of benchmarks (`nox -s bench`; `nox -s bench -- NAME ...` runs only those).

A benchmark is a module of this package whose name has no leading underscore (those are its helpers;
models.py holds the models several share), run as `python -m benchmarks.NAME` from the repository's
root; it starts whatever processes it needs itself and writes its results to results/ (the GPU ones exit
at once without a GPU), so this runner only calls them one after another and reports which failed.
Not in the set: the one-off experiments in experiments/, and device_suite (the prepared run for a
machine with a GPU and 16 cores: benchmarks/device_suite.sh).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"run", "models", "device_suite"}


def regression_set() -> list[str]:
    """The benchmarks' module names, sorted."""
    return sorted(
        p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and p.stem not in NOT_BENCHMARKS
    )


def main() -> int:
    only = set(sys.argv[1:])
    failed = []
    for name in regression_set():
        if only and name not in only:
            continue
        start = time.monotonic()
        print(f"== {name}", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"], cwd=HERE.parent)
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.monotonic() - start:.0f}s")
        if rc:
            failed.append(name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
