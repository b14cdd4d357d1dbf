"""A short training job that injects one fault (tests/faults/test_fault_matrix.py, docs/faults.md).

MP_FAULT="<rank>:<phase>:<kind>" picks the global rank, the phase (preinit: before smp.init, init,
trace: the first forward, which with pp > 1 is rank 0's trace before partitioning, forward, backward,
step: the optimizer step, save: the partial save at the end of a step after the first, into
MP_TEST_SAVE) and the fault: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: the process stays, silent),
``raise`` (a RuntimeError naming the rank and phase), ``slow`` (sleeps MP_TEST_SLOW seconds, alive,
then goes on), ``hang`` (sleeps for an hour: alive, never answering, as in a deadlock), ``full`` (the
save's filesystem fills up: a filler file written until ENOSPC, or, with MP_TEST_FSIZE set,
RLIMIT_FSIZE lowered to that many bytes, so that writes fail with EFBIG), ``sockets`` (every TCP
connection of the process is shut down, as by a peer or the network). MP_TEST_LOAD=<path> instead
loads the partial checkpoint at <path> and exits. MP_TEST_PP and MP_TEST_TP set the degrees; the rest
of the world is data parallelism. The job runs 3 steps of a small MLP, pipelined when pp > 1, with a
DistributedLinear layer when tp > 1.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

RANK, PHASE, KIND = os.environ["MP_FAULT"].split(":")


FIRED: list[str] = []  # a fault the rank survives (slow, full, sockets) fires once, not at every call
STEPS: list[int] = []  # the steps done


def fault(phase: str) -> None:
    rank = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))) if phase == "preinit" else smp.rank()
    if phase != PHASE or rank != int(RANK) or FIRED or (KIND == "slow" and not STEPS):
        return  # slow: in a step after the first (a sleep in the first would skew the partitioner's timing)
    line = f"rank {rank}: injecting {KIND} at {phase} t={time.time():.3f}"
    print(line, flush=True)
    if os.environ.get("MP_TEST_MARK"):  # the launcher may drop a rank's last output when the job aborts
        with open(os.environ["MP_TEST_MARK"], "a") as f:
            f.write(line + "\n")
    FIRED.append(phase)
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif KIND == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif KIND == "slow":
        time.sleep(float(os.environ["MP_TEST_SLOW"]))
    elif KIND == "hang":
        time.sleep(3600)
    elif KIND == "full":
        fill(os.path.dirname(os.environ["MP_TEST_SAVE"]))
    elif KIND == "sockets":
        shut_sockets()
    else:
        raise RuntimeError(f"injected failure on rank {rank} at {phase}")


def fill(folder: str) -> None:
    if os.environ.get("MP_TEST_FSIZE"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
        limit = int(os.environ["MP_TEST_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return
    try:
        with open(os.path.join(folder, f"filler-{smp.rank()}"), "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc


def shut_sockets() -> None:
    # The job's own connections (torch.distributed's store and gloo pairs), not the launcher's: the
    # process manager's connection (PMI_FD) and listening sockets inherited from it are mpiexec's.
    for fd in map(int, os.listdir("/proc/self/fd")):
        if str(fd) == os.environ.get("PMI_FD"):
            continue
        with contextlib.suppress(OSError):
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
            with contextlib.closing(sock):
                tcp = sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
                if tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)


class Hooked(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not STEPS:
            fault("trace")
        fault("forward")
        y = self.inner(x)
        if y.requires_grad:
            y.register_hook(lambda g: (fault("backward"), g)[1])
        return y


pp, tp = int(os.environ.get("MP_TEST_PP", "1")), int(os.environ.get("MP_TEST_TP", "1"))
fault("preinit")
smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2, "ddp": True})
if os.environ.get("MP_TEST_LOAD"):
    loaded = smp.load(os.environ["MP_TEST_LOAD"])
    print(f"rank {smp.rank()} loaded {sorted(loaded)}", flush=True)
    raise SystemExit(0)
fault("init")
torch.manual_seed(0)
middle: nn.Module = smp.nn.DistributedLinear(8, 8) if tp > 1 else nn.Linear(8, 8)
model = nn.Sequential(Hooked(nn.Linear(6, 8)), nn.ReLU(), Hooked(middle), nn.ReLU(), Hooked(nn.Linear(8, 3)))
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@smp.step
def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


for _ in range(3):
    train(torch.randn(4, 6), torch.randn(4, 3))
    fault("step")
    optimizer.step()
    optimizer.zero_grad()
    if os.environ.get("MP_TEST_SAVE"):
        if STEPS:
            fault("save")
        smp.save(model.local_state_dict(), os.environ["MP_TEST_SAVE"], partial=True)
    STEPS.append(len(STEPS))
print(f"rank {smp.rank()} finished", flush=True)
