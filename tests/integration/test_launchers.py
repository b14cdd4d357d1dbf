"""The same smp script under torchrun and under plain mpiexec: mp finds the world either way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
import torch, torch.distributed as dist
import mp as smp
smp.init({"pipeline_parallel_degree": 2})
t = torch.tensor([float(smp.rank() + 1)])
dist.all_reduce(t, group=smp.get_pp_process_group())
record = dict(rank=smp.rank(), size=smp.size(), local_rank=smp.local_rank(), local_size=smp.local_size(),
              pp_rank=smp.pp_rank(), launcher=smp.state.world.info.launcher.value, pp_sum=t.item(),
              gathered=smp.allgather(smp.rank(), smp.WORLD), threads=torch.get_num_threads())
open(sys.argv[1] + f"/rank{smp.rank()}.json", "w").write(json.dumps(record))
smp.shutdown()
"""


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MP_NUM_THREADS")}
    return env


def test_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(tmp_path)
    for r, rec in enumerate(records):
        assert rec["launcher"] == "torchrun"
        assert (rec["rank"], rec["size"], rec["local_rank"], rec["local_size"]) == (r, 2, r, 2)
        assert rec["pp_rank"] == r and rec["pp_sum"] == 3.0 and rec["gathered"] == [0, 1]


def test_plain_mpiexec(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    for r, rec in enumerate(_records(tmp_path)):
        assert rec["launcher"] == "mpi"
        assert (rec["rank"], rec["size"], rec["local_rank"], rec["local_size"]) == (r, 2, r, 2)
        assert rec["pp_sum"] == 3.0
        assert rec["threads"] == max(1, cores // 2)  # each rank gets its share of the host's cores
