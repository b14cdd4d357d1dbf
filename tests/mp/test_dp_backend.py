"""The ddp keys: ddp_dist_backend picks the torch.distributed backend, ddp_port the rendezvous port
(under mpiexec and under torchrun), horovod and herring are refused by smp.init."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mp as smp
from mp.config import load_config
from mp.dp_backend import check_engines, world_backend
from mp.errors import ConfigError
from tests._harness import mpiexec


@pytest.mark.parametrize("key", ["horovod", "herring"])
def test_other_data_parallel_engines_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}': got True") as info:
        smp.init({key: True})  # refused before any process group exists
    assert "Fix: remove" in str(info.value) and not smp.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'ddp_dist_backend': got 'nccl'.*without CUDA"):
        check_engines(load_config({"ddp_dist_backend": "nccl"}))


def test_backend_choice() -> None:
    assert world_backend(load_config({})) is None  # mp_comm decides: NCCL on GPUs, gloo on CPU
    assert world_backend(load_config({"ddp_dist_backend": "gloo"})) == "gloo"
    assert world_backend(load_config({"ddp_dist_backend": "nccl"})) == "cpu:gloo,cuda:nccl"


def _backend(world: Any, choice: str) -> str:
    smp.init({"ddp_dist_backend": choice})
    return str(smp.state.world.backend)


def test_the_backend_is_the_one_asked_for(worlds: Any) -> None:
    auto = (
        "cpu:gloo,cuda:nccl"
        if torch.cuda.is_available() and os.environ.get("MP_SHARE_GPUS") != "1"
        else "gloo"
    )
    assert worlds.run(2, _backend, "auto") == [auto, auto]
    assert worlds.run(2, _backend, "gloo") == ["gloo", "gloo"]


SCRIPT = """
import errno, json, socket, sys
import torch.distributed as dist
import mp as smp
port = int(sys.argv[2])
smp.init({"ddp_port": port, "ddp": True})
listening = None
if smp.rank() == 0:  # rank 0's store holds the port: binding it again fails
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        listening = False
    except OSError as exc:
        listening = exc.errno == errno.EADDRINUSE
    finally:
        s.close()
smp.barrier()
open(sys.argv[1] + f"/rank{smp.rank()}.json", "w").write(json.dumps({"listening": listening}))
smp.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_ddp_port_is_where_the_rendezvous_listens(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "port.py"
    script.write_text(SCRIPT)
    port = _free_port()
    if launcher == "mpiexec":
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        cmd = [mpiexec(), "-n", "2", sys.executable, str(script), str(tmp_path), str(port)]
    else:
        environ = dict(os.environ)
        master = _free_port()  # torchrun's own store; mp's must be on `port` instead
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
        cmd += [str(master), str(script), str(tmp_path), str(port)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=environ)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert records[0]["listening"] is True, records
