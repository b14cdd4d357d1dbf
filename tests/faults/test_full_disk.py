"""A checkpoint write that fails (a full disk, a file size limit) raises a readable error.

Without it, torch's zip writer surfaces ``RuntimeError: basic_ios::clear: iostream error``. The writes
run in a child process whose file size limit (RLIMIT_FSIZE, 4 KB) makes them fail as a full disk does
(EFBIG instead of ENOSPC): the error must name the rank, the file, the bytes it tried to write, the
free space, and the fix, and leave no file behind. The fault matrix (test_fault_matrix.py) checks the
same on a real full tmpfs in a 2-rank job, and that the checkpoint saved before still loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, resource, signal, sys
import torch
import mp as smp
from mp_memory.checkpoint.publish import write_part, write_text

folder = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
out = {}
for name, call in [
    ("part", lambda: write_part({"w": torch.zeros(4096)}, os.path.join(folder, "part"), 3)),
    ("text", lambda: write_text(os.path.join(folder, "newest"), "x" * 10000, 3)),
    ("save", lambda: smp.save({"w": torch.zeros(4096)}, os.path.join(folder, "model.pt"), partial=False)),
]:
    try:
        call()
        out[name] = "no error"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_a_failed_write_names_the_file_rank_bytes_and_free_space(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, rank, nbytes, file, reason in [
        ("part", 3, "16,384", "part", "the file size limit (ulimit -f) is 4,096 bytes (torch: "),
        ("text", 3, "10,000", "newest.tmp-r3-", "File too large"),  # Python's own write: the OSError
        ("save", 0, "16,384", "model.pt.tmp-r0-", "the file size limit (ulimit -f) is 4,096 bytes"),
    ]:
        text = out[name]
        kind = "SMPCheckpointError" if name == "save" else "CheckpointWriteError"
        assert text.startswith(f"{kind}: rank {rank} could not write checkpoint file "), text
        assert f"{tmp_path}{os.sep}{file}" in text, text
        assert reason in text, text
        assert f"at least {nbytes} bytes to write" in text and "bytes free in" in text, text
        assert "Fix: free space there or choose another folder" in text, text
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # nothing torn left behind
