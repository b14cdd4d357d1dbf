"""The MPI path of the collectives: MPICH's collectives on CPU tensors' memory, through mpi4py.

torch's CPU wheel has no MPI backend, and MPICH's collectives move 3-4x more bytes per second than
gloo's on these hosts (10-100x below 1 MB), so :mod:`mp_comm.collectives` runs a CPU tensor's
collective here when its group has an MPI twin (:func:`mp_comm.world.mpi_comm_of`): a communicator
over the same ranks that `World.new_groups` created beside it. Everything else (CUDA tensors, worlds
started without MPI, groups made by `dist.new_group`) stays on torch.distributed.

Buffers are the tensors' own memory (by address: no numpy views, no copies), and results are written
straight into the output tensor:

* all-reduce: ``MPI_Allreduce`` from the input into a fresh output (no clone, no in-place pass);
* all-gather along any dim: each rank's block lands in its place in the output through a strided
  datatype (no gather buffer, no ``cat``, no ``movedim`` copy);
* all-to-all: the same strided datatype on both sides, for any split and concat dims;
* reduce-scatter along dim ``d``: the input is laid out block-major once (a copy only when ``d`` has
  outer dims), so that every rank's block is contiguous and ``MPI_Reduce_scatter_block`` writes the
  output directly.

Reductions need an MPI type with arithmetic (floats, ints, complex); bfloat16, float16 and bool have
none, so their reductions return None here (the caller uses gloo) and are never done bytewise.
Operations that only move bytes (gather, all-to-all, broadcast) take any dtype as bytes.

Every collective is posted nonblocking and waited for by :func:`mp_comm.mpi_wait.complete`, which
yields the CPU and then sleeps instead of busy-polling as MPICH's blocking calls do
(``MP_COMM_WAIT``).

Outputs of 1 MB and more come from a pool of recycled host memory (:class:`HostPool`, as the
transports use for received tensors): fresh memory pays a page fault per 4 KiB page on first write,
which cost more than the collective itself on 16-64 MB tensors here.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Final

import torch
from torch import Tensor

from mp_comm.buffers import HostPool
from mp_comm.mpi_wait import complete

__all__ = [
    "MPIWork",
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "all_to_all",
    "broadcast",
    "reduce_scatter",
    "usable",
]


# Process-wide like torch's caching allocator: outputs are handed to the caller, and their memory
# comes back here when the caller drops them, whichever group produced them.
_OUTPUTS: Final = HostPool(256 << 20, min_bytes=1 << 20)


def _empty(shape: list[int] | tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous CPU tensor, on recycled memory when it is large."""
    shape = tuple(shape)
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(shape[i + 1], 1)
    nbytes = math.prod(shape) * dtype.itemsize
    return _OUTPUTS.tensor(shape, stride, dtype, nbytes)


@functools.cache
def _mpi() -> Any:
    from mp_comm.transport.mpi import import_mpi

    return import_mpi()


# torch dtype -> name of the MPI datatype with the same arithmetic (absent: no MPI reduction).
_REDUCIBLE: Final = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int8: "INT8_T",
    torch.int16: "INT16_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.uint8: "UINT8_T",
    torch.complex64: "C_FLOAT_COMPLEX",
    torch.complex128: "C_DOUBLE_COMPLEX",
}


def usable(x: Tensor, comm: Any | None, *, reduce: bool) -> bool:
    """Whether a collective on `x` can run over `comm` here: a CPU tensor, and a dtype MPI can reduce
    (when `reduce`). Every member of a group answers alike (same dtype and device everywhere)."""
    if comm is None or x.device.type != "cpu" or x.layout != torch.strided or x.is_quantized or not x.numel():
        return False
    return not reduce or x.dtype in _REDUCIBLE


def _unit(dtype: torch.dtype) -> tuple[Any, int]:
    """The MPI datatype of one element's unit, and how many units an element has (bytes otherwise)."""
    mpi = _mpi()
    name = _REDUCIBLE.get(dtype)
    if name is not None:
        return getattr(mpi, name), 1
    return mpi.BYTE, torch.empty((), dtype=dtype).element_size()


def _buf(t: Tensor, *, readonly: bool) -> Any:
    """The memory of a contiguous CPU tensor as an MPI buffer (by address: no copy)."""
    return _mpi().buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size(), readonly=readonly)


class MPIWork:
    """A nonblocking MPI collective in flight, with the `wait`/`is_completed` of a torch Work.

    It keeps the buffers' tensors alive until the request has completed.
    """

    def __init__(self, request: Any, keep: tuple[Tensor, ...]) -> None:
        self._request = request
        self._keep: tuple[Tensor, ...] | None = keep
        self._nbytes = max(t.numel() * t.element_size() for t in keep)

    def wait(self) -> bool:
        if self._keep is not None:
            complete(self._request, self._nbytes)
            self._keep = None
        return True

    def is_completed(self) -> bool:
        if self._keep is not None and self._request.Test():
            self._keep = None
        return self._keep is None


def _returned(work: MPIWork, async_op: bool) -> MPIWork | None:
    """The work for an async call; for a blocking one, wait for it here (see :mod:`mp_comm.mpi_wait`:
    every collective is posted nonblocking so that the wait can give the core away)."""
    if async_op:
        return work
    work.wait()
    return None


def _block_type(shape: tuple[int, ...], dim: int, n: int, unit: Any, per: int) -> tuple[Any, int]:
    """(datatype, count) of one of the `n` equal blocks along `dim` of a contiguous tensor of `shape`.

    Block k starts at k times the returned type's extent, so one count of it per rank describes
    the whole tensor in collectives. Blocks are contiguous when no dim before `dim` is larger than 1;
    otherwise the type is a vector (one run per outer index) resized to a block's inner length. The
    caller frees a derived type (``count`` is then 1); MPI lets pending operations finish with it.
    """
    outer = math.prod(shape[:dim])
    inner = shape[dim] // n * math.prod(shape[dim + 1 :]) * per  # units in one run of one block
    if outer == 1:
        return unit, inner
    vector = unit.Create_vector(outer, inner, inner * n)
    extent = unit.Get_extent()[1]
    block = vector.Create_resized(0, inner * extent)
    vector.Free()
    block.Commit()
    return block, 1


def _free(datatype: Any) -> None:
    if not datatype.is_predefined:  # a derived type of _block_type
        datatype.Free()


def all_reduce(x: Tensor, comm: Any, async_op: bool) -> tuple[Tensor, MPIWork | None]:
    """Sum of `x` over `comm`, in a fresh contiguous tensor."""
    mpi = _mpi()
    inp = x.contiguous()
    out = _empty(inp.shape, inp.dtype)
    unit, _ = _unit(inp.dtype)
    send, recv = [_buf(inp, readonly=True), inp.numel(), unit], [_buf(out, readonly=False), out.numel(), unit]
    work = MPIWork(comm.Iallreduce(send, recv, mpi.SUM), (inp, out))
    return out, _returned(work, async_op)


def all_gather(x: Tensor, dim: int, comm: Any, async_op: bool) -> tuple[Tensor, MPIWork | None]:
    """Every rank's `x` concatenated along `dim`, in group-rank order."""
    n = comm.Get_size()
    inp = x.contiguous()
    shape = list(inp.shape)
    shape[dim] *= n
    out = _empty(shape, inp.dtype)
    unit, per = _unit(inp.dtype)
    block, count = _block_type(tuple(shape), dim, n, unit, per)
    send = [_buf(inp, readonly=True), inp.numel() * per, unit]
    recv = [_buf(out, readonly=False), count, block]
    try:
        return out, _returned(MPIWork(comm.Iallgather(send, recv), (inp, out)), async_op)
    finally:
        _free(block)


def all_to_all(
    x: Tensor, split_dim: int, concat_dim: int, comm: Any, async_op: bool
) -> tuple[Tensor, MPIWork | None]:
    """Block k of `x` along `split_dim` to rank k; what arrives, concatenated along `concat_dim`."""
    n = comm.Get_size()
    inp = x.contiguous()
    shape = list(inp.shape)
    shape[split_dim] //= n
    shape[concat_dim] *= n
    out = _empty(shape, inp.dtype)
    unit, per = _unit(inp.dtype)
    send_type, send_count = _block_type(tuple(inp.shape), split_dim, n, unit, per)
    recv_type, recv_count = _block_type(tuple(shape), concat_dim, n, unit, per)
    send = [_buf(inp, readonly=True), send_count, send_type]
    recv = [_buf(out, readonly=False), recv_count, recv_type]
    try:
        return out, _returned(MPIWork(comm.Ialltoall(send, recv), (inp, out)), async_op)
    finally:
        _free(send_type)
        _free(recv_type)


def reduce_scatter(x: Tensor, dim: int, comm: Any, async_op: bool) -> tuple[Tensor, MPIWork | None]:
    """The sum of `x` over `comm`, this rank's block along `dim` of it."""
    mpi = _mpi()
    n = comm.Get_size()
    if math.prod(x.shape[:dim]) == 1:
        inp = x.contiguous()  # the blocks along `dim` are already contiguous runs
    else:  # block-major: [n, *shape with dim // n], so each rank's block is one contiguous run
        inp = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # type: ignore[no-untyped-call]
    shape = list(x.shape)
    shape[dim] //= n
    out = _empty(shape, x.dtype)
    unit, _ = _unit(x.dtype)
    send = [_buf(inp, readonly=True), out.numel(), unit]  # mpi4py counts per block
    recv = [_buf(out, readonly=False), out.numel(), unit]
    return out, _returned(MPIWork(comm.Ireduce_scatter_block(send, recv, mpi.SUM), (inp, out)), async_op)


def broadcast(t: Tensor, root: int, comm: Any) -> None:
    """Overwrite the contiguous CPU tensor `t` with group rank `root`'s, in place."""
    unit, per = _unit(t.dtype)
    request = comm.Ibcast([_buf(t, readonly=False), t.numel() * per, unit], root=root)
    complete(request, t.numel() * t.element_size())


def all_reduce_(t: Tensor, comm: Any) -> None:
    """Sum the contiguous CPU tensor `t` over `comm` in place."""
    mpi = _mpi()
    unit, _ = _unit(t.dtype)
    request = comm.Iallreduce(mpi.IN_PLACE, [_buf(t, readonly=False), t.numel(), unit], mpi.SUM)
    complete(request, t.numel() * t.element_size())
