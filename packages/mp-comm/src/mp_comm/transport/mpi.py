"""The MPI transport: nonblocking MPI point-to-point on a private communicator, one progress thread.

All MPI calls of the transport are made by whichever thread holds its progress lock (the
requester, tracker and post-processing roles in one loop): a thread that has just called `send` (its
message is posted at once), a thread waiting in `recv` (it sees its message without a hand-off), and
otherwise the progress thread, which only sleeps and polls, never spins: a spinning Python thread
would keep the GIL from the threads that do the work. Per message, on a duplicate of the world's
communicator:

* the header (the pickled object with stubs and the tensor metadata) goes with tag ``HEADER_TAG``;
* each non-empty tensor payload follows as raw bytes with tag ``2 + wire % (TAG_UB - 2)``, where `wire`
  counts the sender's messages to that destination, so payloads of different messages never match
  each other's receives;
* once all are posted, the sender rings the destination's doorbell (:mod:`mp_comm.transport.doorbell`)
  if a thread of the destination naps on it, which ends that nap.

The receiving side (matched probes, payloads received straight into the tensors) is in
:mod:`mp_comm.transport.mpi_receiving`, the import of mpi4py in :mod:`mp_comm.transport.mpi_setup`.

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
from dataclasses import dataclass
from typing import Any, Final

import torch

from mp_comm.errors import (
    PeerTimeoutError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
)
from mp_comm.message import DeviceMap, default_device_map
from mp_comm.teardown import EXIT_TIMEOUT, Stage, at_exit
from mp_comm.transport.base import (
    Mailbox,
    OrderCounter,
    Outgoing,
    TransportConfig,
)
from mp_comm.transport.doorbell import Doorbell
from mp_comm.transport.mpi_receiving import (
    _FIRST_DATA_TAG,
    HEADER_TAG,
    MPIReceiving,
    _HeaderOp,
    _RecvOp,
)
from mp_comm.transport.mpi_setup import _buffer, check_thread_level, import_mpi

__all__ = ["HEADER_TAG", "MPITransport", "check_thread_level", "import_mpi"]

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT: Final = 60.0


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


_OPEN: weakref.WeakSet[MPITransport] = weakref.WeakSet()


def _close_at_exit() -> None:  # after UCX (it may still hand payloads to MPI), before the process groups
    for transport in list(_OPEN):
        try:
            transport.close(timeout=EXIT_TIMEOUT)
        except Exception as exc:
            log.warning("closing the MPI transport of rank %d at exit: %s", transport.rank, exc)


at_exit(Stage.HOST_TRANSPORT, _close_at_exit)


class MPITransport(MPIReceiving):
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
        self.bell = Doorbell(self._comm)  # collective too; a napping receiver wakes when rung
        """This rank's doorbell (its `rung` and `skipped` count the rings sent and spared)."""
        if self.mailbox.bell is None and self.bell.usable:
            self.mailbox.bell = self.bell
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
        # No wake-up here: the sending thread posts the message itself right after (`drive`, called by
        # `send`), and only wakes the progress thread when another thread holds the progress lock.
        self._outq.append(out)

    def _stage(self, wires: list[torch.Tensor]) -> list[torch.Tensor]:
        # The MPI path moves host memory: device tensors are copied out on the caller's
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
        if not busy and self._in_flight():
            # Back to polling at once, not after the rest of a busy sleep, where a transfer of this rank
            # needs it. With none in flight there is nothing to hurry: the rank's next `recv` drives
            # progress itself (the pipeline unmarks busy right before one), and waking this thread each
            # time only takes the GIL from the thread that works.
            self._wake.set()

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
        if not self._thread.is_alive():
            self.bell.close()
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

    def drive(self) -> bool:
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
                    # A thread waiting for a message drives progress itself (see Mailbox.take), also
                    # between its naps; polling here as well would only take the GIL from it, and on a
                    # loaded host a thread preempted while it holds the GIL stalls the other. Look in
                    # now and then all the same: every `poll_max` while transfers are in flight (the
                    # waiter may leave with them unfinished), every `poll_busy_idle` when none is. A
                    # transfer that stays in flight when posted wakes this thread (`_in_flight_posted`).
                    cfg = self.config
                    idle.rest(cfg.poll_max if self._in_flight() else cfg.poll_busy_idle)
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
            op.out.handle.set_failed(error)
        while self._outq:
            self._outq.popleft().handle.set_failed(error)
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
                # small messages leave at once (MPI's eager protocol)
                done = reqs[0].Test() if len(reqs) == 1 else mpi.Request.Testall(reqs)
            except mpi.Exception as exc:
                out.handle.set_failed(self._wrap_error(f"sending tag {out.tag!r}", exc, out.dest))
                continue
            self.bell.ring(out.dest)
            if done:
                out.handle.set_done()
                continue
            self._sends.append(_SendOp(out, reqs, keep))
            if out.dest != self.rank:  # a send to itself completes when this rank receives it
                self._in_flight_posted()
        return worked

    def _in_flight_posted(self) -> None:
        """A transfer stays in flight (a large payload): make sure the progress thread polls for it, in
        case the thread that posted it stops driving (it leaves `recv`, or returns from `send`)."""
        if threading.current_thread() is not self._thread:
            self._wake.set()

    def _finish_sends(self) -> bool:
        if not self._sends:
            return False
        mpi = self._mpi
        done: list[_SendOp] = []
        for op in self._sends:
            try:
                complete = mpi.Request.Testall(op.reqs)
            except mpi.Exception as exc:
                op.out.handle.set_failed(self._wrap_error(f"sending tag {op.out.tag!r}", exc, op.out.dest))
                done.append(op)
                continue
            if complete:
                op.out.handle.set_done()
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
            op.out.handle.set_failed(error)
        while self._outq:
            self._outq.popleft().handle.set_failed(error)
        self._sends.clear()
