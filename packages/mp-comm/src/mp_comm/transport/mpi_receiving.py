"""The receiving side of the MPI transport.

The receiver matches headers from any source with ``MPI_Improbe``/``MPI_Imrecv`` (a matched probe, so
no other thread can steal the message between probe and receive), processes each sender's headers in
arrival order, allocates the destination tensors from the metadata, and posts one ``MPI_Irecv`` per
payload straight into the tensor's memory: contiguous CPU tensors move without extra copies on either
side. CUDA tensors are staged through host memory (the MPI path: the device-to-device path is the
UCX transport's).
"""

from __future__ import annotations

import abc
import collections
import logging
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from mp_comm.errors import MessageDecodeError
from mp_comm.message import Header, TensorMeta, decode_header
from mp_comm.transport.base import MessageTransport
from mp_comm.transport.mpi_setup import _buffer

__all__ = ["HEADER_TAG", "MPIReceiving"]

log = logging.getLogger("mp_comm.transport.mpi")  # the logger these messages always had

HEADER_TAG: Final = 1
_FIRST_DATA_TAG: Final = 2
_PROBES_PER_ROUND: Final = 64


@dataclass(slots=True)
class _HeaderOp:
    source: int
    buf: bytearray
    req: Any


@dataclass(slots=True)
class _RecvOp:
    source: int
    header: Header
    metas: tuple[TensorMeta, ...]
    tensors: list[torch.Tensor]
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (host buffer, device tensor) pairs
    reqs: list[Any] = field(default_factory=list)


class MPIReceiving(MessageTransport):
    """Header probes and payload receives (the base of MPITransport; run by the progress lock's holder)."""

    _mpi: Any
    _comm: Any
    _status: Any
    _data_tags: int
    _headers: dict[int, collections.deque[_HeaderOp]]
    _recvs: list[_RecvOp]

    @abc.abstractmethod
    def _in_flight_posted(self) -> None:
        """Called when a receive stays in flight after it was posted (the transport wakes its poller)."""

    def _data_tag(self, wire: int) -> int:
        return _FIRST_DATA_TAG + wire % self._data_tags

    def _probe_headers(self) -> bool:
        mpi, comm = self._mpi, self._comm
        status = self._status
        worked = False
        for _ in range(_PROBES_PER_ROUND):
            msg = comm.Improbe(mpi.ANY_SOURCE, HEADER_TAG, status)
            if msg is None:
                break
            worked = True
            source = status.Get_source()
            buf = bytearray(status.Get_count(mpi.BYTE))
            req = msg.Irecv([buf, mpi.BYTE])
            queue = self._headers.get(source)
            if queue is None:
                # Nothing of this sender waits before it: a header already here (a small one, always) is
                # handled at once.
                if req.Test():
                    self._start_recv(source, buf)
                    continue
                queue = self._headers[source] = collections.deque()
            queue.append(_HeaderOp(source, buf, req))
        return worked

    def _finish_headers(self) -> bool:
        worked = False
        for source in list(self._headers):
            queue = self._headers[source]
            # One sender's headers are handled in the order they arrived: the metadata cache of static
            # mode depends on it.
            while queue and queue[0].req.Test():
                op = queue.popleft()
                worked = True
                self._start_recv(source, op.buf)
            if not queue:
                del self._headers[source]
        return worked

    def _start_recv(self, source: int, raw: bytearray) -> None:
        try:
            header = decode_header(raw, source=source)
        except MessageDecodeError as exc:
            # Without the header the sender's payload count is unknown: its stream is unusable.
            log.error("rank %d: %s", self.rank, exc)
            self.mailbox.fail_peer(source, exc)
            return
        prepared = self._prepare_arrival(source, header)
        if prepared is None:
            return
        metas, tensors = prepared
        if len(header.inline) == len(metas) or not any(m.nbytes for m in metas):
            self._arrived(source, header, tensors, metas)  # everything travelled in the header
            return
        op = _RecvOp(source, header, metas, tensors, [])
        mpi, comm = self._mpi, self._comm
        tag = self._data_tag(header.wire)
        inline: Container[int] = header.inline if len(header.inline) < 8 else frozenset(header.inline)
        for i, (t, m) in enumerate(zip(tensors, metas, strict=True)):
            nbytes = m.nbytes
            if not nbytes or i in inline:
                continue
            host = t
            if not t.is_cpu:
                host = torch.empty_strided(
                    t.shape, t.stride(), dtype=t.dtype, pin_memory=torch.cuda.is_available()
                )
                op.staged.append((host, t))
            op.reqs.append(comm.Irecv(_buffer(mpi, host, nbytes, readonly=False), source, tag))
        if not op.reqs:  # everything travelled in the header
            self._arrived(source, header, tensors, metas)
        elif not self._try_finish(op):  # a payload already announced often lands right away
            self._recvs.append(op)
            self._in_flight_posted()

    def _finish_recvs(self) -> bool:
        if not self._recvs:
            return False
        done = [op for op in self._recvs if self._try_finish(op)]
        for op in done:
            self._recvs.remove(op)
        return bool(done)

    def _try_finish(self, op: _RecvOp) -> bool:
        """Deliver `op` if its payloads have landed (or fail it); whether it is finished."""
        mpi = self._mpi
        try:
            if not mpi.Request.Testall(op.reqs):
                return False
        except mpi.Exception as exc:
            error = self._wrap_error(f"receiving tag {op.header.tag!r}", exc, op.source)
            self.mailbox.fail_peer(op.source, error)
            self._arrival_failed(op.source, op.header, error)
            return True
        if op.staged:
            self._land([(dev, host) for host, dev in op.staged])
        self._arrived(op.source, op.header, op.tensors, op.metas)
        return True
