"""The collectives without autograd: how each runs (MPI or torch.distributed), with fallbacks and
registered waits; :mod:`mp_comm.collectives` builds its autograd Functions on these.

CPU tensors go over MPI when the group has an MPI twin (a communicator over the same ranks, made by
``World.new_groups`` under mpiexec; see :mod:`mp_comm.collectives_mpi`): MPICH's collectives are
several times faster than gloo's. Other groups, CUDA tensors, and reductions of dtypes MPI cannot sum
(bfloat16, float16, bool) use torch.distributed (gloo, NCCL).

Backends that lack an operation (older gloo lacks reduce-scatter and all-to-all) get it from the
primitives they have: all-gather from the list form, reduce-scatter from an all-reduce and a slice,
all-to-all from point-to-point sends. The first call that finds an operation unsupported records it
for that backend, so all ranks of a group take the same path; :func:`use_fallback` forces a fallback
(to test it against the native operation).

Every torch.distributed collective here registers its wait (mp_comm.waits) while it blocks: the op,
the backend and the group's ranks, so that when a rank stops answering the heartbeat's report says which
collective the others wait in (:func:`mp_comm.waits.collective_wait`, for mp's other call sites too).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from mp_comm import collectives_mpi as _mpi
from mp_comm import waits
from mp_comm.errors import CollectiveError
from mp_comm.waits import collective_label as _label
from mp_comm.waits import collective_wait
from mp_comm.world import mpi_comm_of

__all__ = [
    "FALLBACK_OPS",
    "CollectiveHandle",
    "Work",
    "all_reduce_",
    "broadcast_",
    "group_rank",
    "group_size",
    "use_fallback",
]

log = logging.getLogger(__name__)

#: The operations that have a fallback built from other primitives.
FALLBACK_OPS: Final = frozenset({"all_gather", "reduce_scatter", "all_to_all"})

_unsupported: set[tuple[str, str]] = set()  # (backend, op) found unsupported at run time
_forced: set[str] = set()


def group_size(group: dist.ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


@contextlib.contextmanager
def use_fallback(*ops: str) -> Iterator[None]:
    """Within the block, run ``ops`` (names from :data:`FALLBACK_OPS`) by their fallbacks on every backend."""
    unknown = set(ops) - FALLBACK_OPS
    if unknown:
        raise CollectiveError(
            f"use_fallback got {sorted(unknown)}: expected names from {sorted(FALLBACK_OPS)}; "
            "pass only operations that have a fallback."
        )
    added = set(ops) - _forced
    _forced.update(added)
    try:
        yield
    finally:
        _forced.difference_update(added)


class Work(Protocol):
    """What a collective in flight offers: a torch ``dist.Work`` or an MPI request (``MPIWork``)."""

    def wait(self) -> bool: ...

    def is_completed(self) -> bool: ...


class CollectiveHandle:
    """A collective in flight. :meth:`wait` blocks until it is done and returns its output.

    ``what``: the wait to register while :meth:`wait` blocks (torch works; MPI's register their own)."""

    def __init__(
        self,
        result: Tensor,
        works: Sequence[Work] = (),
        finalize: Callable[[], object] | None = None,
        what: str | None = None,
    ) -> None:
        self._result = result
        self._works = list(works)
        self._finalize = finalize
        self._what = what

    def wait(self) -> Tensor:
        """Wait for the communication (idempotent) and return the output tensor."""
        if self._what is not None and not self.is_completed():
            with waits.waiting(self._what):
                for work in self._works:
                    work.wait()
        else:
            for work in self._works:
                work.wait()
        self._works.clear()
        if self._finalize is not None:
            finalize, self._finalize = self._finalize, None
            with torch.no_grad():
                finalize()
        return self._result

    @property
    def pending_result(self) -> Tensor:
        """The output tensor, before :meth:`wait` (its values are final only after it)."""
        return self._result

    def with_result(self, result: Tensor) -> CollectiveHandle:
        """The same communication in flight, handing back ``result`` from :meth:`wait`."""
        return CollectiveHandle(result, self._works, self._finalize, self._what)

    def is_completed(self) -> bool:
        """True once :meth:`wait` would not block."""
        return all(work.is_completed() for work in self._works)


def _native(op: str, group: dist.ProcessGroup, call: Callable[[], dist.Work | None]) -> tuple[bool, Any]:
    """Run the native collective unless the backend lacks it; (ran, work)."""
    backend = str(dist.get_backend(group))
    if op in _forced or (backend, op) in _unsupported:
        return False, None
    try:
        return True, call()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        text = str(exc).lower()
        if not isinstance(exc, NotImplementedError) and not any(
            marker in text for marker in ("not support", "unsupported", "not implemented", "has no attribute")
        ):
            raise
        _unsupported.add((backend, op))
        log.info("backend %s lacks %s (%s); using the fallback from other collectives", backend, op, exc)
        return False, None


def _first_attr(*names: str) -> Callable[..., Any]:
    for name in names:
        found = getattr(dist, name, None)
        if found is not None:
            return found  # type: ignore[no-any-return]
    raise AttributeError(f"torch.distributed has no attribute {' or '.join(names)}")


# ------------------------------------------------------------------------- raw (no autograd) ops


def _over_mpi(x: Tensor, group: dist.ProcessGroup, op: str, *, reduce: bool) -> Any | None:
    """The group's MPI twin when this collective on ``x`` runs over MPI, else None."""
    if op in _forced:  # testing a torch.distributed fallback
        return None
    comm = mpi_comm_of(group)
    return comm if _mpi.usable(x, comm, reduce=reduce) else None


def _mpi_handle(result: tuple[Tensor, _mpi.MPIWork | None]) -> CollectiveHandle:
    out, work = result
    return CollectiveHandle(out, [work] if work is not None else [])


def _raw_all_reduce(x: Tensor, group: dist.ProcessGroup, async_op: bool) -> CollectiveHandle:
    comm = _over_mpi(x, group, "all_reduce", reduce=True)
    if comm is not None:
        return _mpi_handle(_mpi.all_reduce(x, comm, async_op))
    out = x.contiguous().clone()
    with collective_wait("all_reduce", group):
        work = dist.all_reduce(out, group=group, async_op=async_op)
    return CollectiveHandle(out, [work] if work is not None else [], what=_label("all_reduce", group))


def _moved_back(buf: Tensor, dim: int, works: list[Work], async_op: bool, what: str) -> CollectiveHandle:
    """The handle whose result is ``buf`` with dim 0 moved to ``dim``, as a tensor of its own (not a view)."""
    if dim == 0:
        return CollectiveHandle(buf, works, what=what)
    result = buf.new_empty(buf.movedim(0, dim).shape)
    handle = CollectiveHandle(result, works, lambda: result.copy_(buf.movedim(0, dim)), what)
    if not async_op:
        handle.wait()
    return handle


def _raw_all_gather(x: Tensor, dim: int, group: dist.ProcessGroup, async_op: bool) -> CollectiveHandle:
    comm = _over_mpi(x, group, "all_gather", reduce=False)
    if comm is not None:
        return _mpi_handle(_mpi.all_gather(x, dim, comm, async_op))
    n = group_size(group)
    inp = x.movedim(dim, 0).contiguous()
    buf = inp.new_empty((n * inp.shape[0], *inp.shape[1:]))
    with collective_wait("all_gather", group):
        ran, work = _native(
            "all_gather",
            group,
            lambda: _first_attr("all_gather_single", "all_gather_into_tensor")(
                buf, inp, group=group, async_op=async_op
            ),
        )
        if not ran:
            work = dist.all_gather(list(buf.chunk(n)), inp, group=group, async_op=async_op)
    what = _label("all_gather", group)
    return _moved_back(buf, dim, [work] if work is not None else [], async_op, what)


def _raw_reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup, async_op: bool) -> CollectiveHandle:
    comm = _over_mpi(x, group, "reduce_scatter", reduce=True)
    if comm is not None:
        return _mpi_handle(_mpi.reduce_scatter(x, dim, comm, async_op))
    n = group_size(group)
    inp = x.movedim(dim, 0).contiguous()
    out = inp.new_empty((inp.shape[0] // n, *inp.shape[1:]))
    what = _label("reduce_scatter", group)
    with waits.waiting(what):
        ran, work = _native(
            "reduce_scatter",
            group,
            lambda: _first_attr("reduce_scatter_single", "reduce_scatter_tensor")(
                out, inp, group=group, async_op=async_op
            ),
        )
    if ran:
        return _moved_back(out, dim, [work] if work is not None else [], async_op, what)
    # Fallback: all-reduce everything, keep this rank's slice.
    full = inp.clone()
    with waits.waiting(what):
        work = dist.all_reduce(full, group=group, async_op=async_op)
    start = group_rank(group) * out.shape[0]
    result = out.new_empty(out.movedim(0, dim).shape)
    handle = CollectiveHandle(
        result,
        [work] if work is not None else [],
        lambda: result.copy_(full.narrow(0, start, out.shape[0]).movedim(0, dim)),
        what,
    )
    if not async_op:
        handle.wait()
    return handle


def _raw_all_to_all(
    x: Tensor, split_dim: int, concat_dim: int, group: dist.ProcessGroup, async_op: bool
) -> CollectiveHandle:
    comm = _over_mpi(x, group, "all_to_all", reduce=False)
    if comm is not None:
        return _mpi_handle(_mpi.all_to_all(x, split_dim, concat_dim, comm, async_op))
    n = group_size(group)
    inp = x.movedim(split_dim, 0).contiguous()  # chunk k of dim 0 goes to rank k
    buf = torch.empty_like(inp)  # chunk k of dim 0 comes from rank k
    what = _label("all_to_all", group)
    with waits.waiting(what):
        ran, work = _native(
            "all_to_all", group, lambda: dist.all_to_all_single(buf, inp, group=group, async_op=async_op)
        )
    if ran:
        works = [work] if work is not None else []
    else:
        me = group_rank(group)
        recv, send = list(buf.chunk(n)), list(inp.chunk(n))
        recv[me].copy_(send[me])
        ops = []
        for peer in range(n):
            if peer != me:
                peer_global = dist.get_global_rank(group, peer)
                ops.append(dist.P2POp(dist.isend, send[peer], peer_global, group))
                ops.append(dist.P2POp(dist.irecv, recv[peer], peer_global, group))
        works = dist.batch_isend_irecv(ops) if ops else []
    shape = list(x.shape)
    shape[split_dim] //= n
    shape[concat_dim] *= n
    result = x.new_empty(shape)

    def finalize() -> None:
        pieces = [chunk.movedim(0, split_dim) for chunk in buf.chunk(n)]
        torch.cat(pieces, dim=concat_dim, out=result)

    handle = CollectiveHandle(result, works, finalize, what)
    if not async_op:
        handle.wait()
    return handle


def all_reduce_(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum the contiguous tensor ``t`` over ``group`` in place (no autograd: e.g. gradient buckets)."""
    comm = _over_mpi(t, group, "all_reduce", reduce=True)
    if comm is not None and t.is_contiguous():
        _mpi.all_reduce_(t, comm)
    elif group_size(group) > 1:
        with collective_wait("all_reduce", group):
            dist.all_reduce(t, group=group)
    return t


def broadcast_(t: Tensor, group: dist.ProcessGroup, src: int = 0) -> Tensor:
    """Overwrite the contiguous tensor ``t`` with group rank ``src``'s, in place (no autograd)."""
    comm = _over_mpi(t, group, "broadcast", reduce=False)
    if comm is not None and t.is_contiguous():
        _mpi.broadcast(t, src, comm)
    elif group_size(group) > 1:
        with collective_wait("broadcast", group):
            dist.broadcast(t, group=group, group_src=src)
    return t
