"""Bootstraps: how the ranks of a transport find each other and meet when they close.

A transport that opens its own connections (UCX) needs every rank's address, and a clean close needs
to know that no rank still sends: both are collectives over the world. :class:`Bootstrap` is that
small collective interface; :class:`MPIBootstrap` runs it on an MPI communicator, :class:`TorchBootstrap`
on torch.distributed (for worlds started by torchrun), :class:`ThreadBootstrap` between transports
that live in one process (tests).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Protocol

from mp_comm.errors import TransportUnavailableError

__all__ = ["Bootstrap", "MPIBootstrap", "ThreadBootstrap", "TorchBootstrap", "bootstrap_for_world"]


class Bootstrap(Protocol):
    """Collectives that every rank of the transport calls together."""

    rank: int
    size: int

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        ...

    def barrier(self, timeout: float) -> bool:
        """Wait until every rank has arrived; False when `timeout` seconds pass first."""
        ...

    def close(self) -> None:
        """Release what the bootstrap holds (local)."""
        ...


class MPIBootstrap:
    """The collectives on a private duplicate of an MPI communicator (collective to create)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm.Dup()
        self.rank = int(self._comm.Get_rank())
        self.size = int(self._comm.Get_size())

    def allgather(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def barrier(self, timeout: float) -> bool:
        request = self._comm.Ibarrier()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                return False  # the request stays pending: the communicator is then not freed
            time.sleep(1e-3)
        return True

    def close(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


class TorchBootstrap:
    """The collectives on torch.distributed's default group (gloo on CPU)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise TransportUnavailableError(
                "torch.distributed is not initialized; call mp_comm.init_world() first, or pass a bootstrap"
            )
        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj)
        return out

    def barrier(self, timeout: float) -> bool:
        try:
            self._dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as exc:
            if "monitored_barrier" in str(exc) and "support" in str(exc):  # not a gloo group
                self._dist.barrier()
                return True
            return False
        return True

    def close(self) -> None:
        return None


class ThreadBootstrap:
    """Ranks that are threads (or objects) of one process: `ThreadBootstrap.group(n)[r]` is rank r's."""

    def __init__(self, rank: int, size: int, shared: _ThreadShared) -> None:
        self.rank = rank
        self.size = size
        self._shared = shared

    @classmethod
    def group(cls, size: int) -> list[ThreadBootstrap]:
        shared = _ThreadShared(size)
        return [cls(r, size, shared) for r in range(size)]

    def allgather(self, obj: Any) -> list[Any]:
        return self._shared.allgather(self.rank, obj)

    def barrier(self, timeout: float) -> bool:
        try:
            self._shared.barrier.wait(timeout)
        except threading.BrokenBarrierError:
            self._shared.barrier.reset()
            return False
        return True

    def close(self) -> None:
        return None


class _ThreadShared:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self._lock = threading.Lock()
        self._slots: list[Any] = [None] * size
        self._gather = threading.Barrier(size)

    def allgather(self, rank: int, obj: Any) -> list[Any]:
        with self._lock:
            self._slots[rank] = obj
        self._gather.wait(60.0)
        out = list(self._slots)
        self._gather.wait(60.0)
        return out


def bootstrap_for_world(world: Any) -> Bootstrap:
    """MPI when the world has a communicator, torch.distributed otherwise (collective)."""
    if getattr(world, "mpi_comm", None) is not None:
        return MPIBootstrap(world.mpi_comm)
    return TorchBootstrap()
