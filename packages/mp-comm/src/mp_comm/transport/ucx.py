"""The UCX transport (ucxx): endpoints from worker addresses, opened lazily, tag matching.

Install with ``pip install 'mp-comm[ucx]'`` (the ``ucxx-cu12`` wheels). On CPU, UCX moves host memory
over shared memory (cma, posix, sysv) or tcp; with GPUs it is the device-to-device path of Appendix
G.2: CUDA IPC between GPUs of one node, GPUDirect RDMA across nodes, chosen by UCX itself.

No rank listens for connections: the ranks' UCX worker addresses are exchanged once through a
:class:`Bootstrap`, and an endpoint to a peer is created from its worker address the first time this
rank sends to it. Its first message, a sealed hello, makes the peer open an endpoint back, so that the
peer can name whoever goes away. UCX's own network transports are limited to the job's interface
(`UCXConfig.net_devices`). UCX calls are made by the transport's progress thread only; it sleeps on the
worker's event descriptor (and a pipe that `send` writes to) when idle.

The transport is built in layers, one mechanism each: its wire (tags, control messages) in
ucx_wire, endpoints and their authentication in ucx_endpoints, payloads and the device-to-device
handshake through persistent buffers in ucx_payloads, the receiving side in ucx_receiving; this
module holds the lifecycle, the progress thread and the sending side.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from mp_comm.buffers import BufferManager
from mp_comm.errors import (
    MessageEncodeError,
    PeerTimeoutError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
)
from mp_comm.message import DeviceMap, default_device_map
from mp_comm.teardown import Stage, at_exit
from mp_comm.transport import auth
from mp_comm.transport.base import Mailbox, MessageTransport, OrderCounter, Outgoing, TransportConfig
from mp_comm.transport.bootstrap import Bootstrap, bootstrap_for_world
from mp_comm.transport.ucx_receiving import UCXReceiving
from mp_comm.transport.ucx_setup import (
    UCXConfig,
    foreign_ucx,
    import_ucxx,
    job_net_devices,
    preload_before_mpi,
    ucx_available,
)
from mp_comm.transport.ucx_wire import (
    _CTRL,
    _HEADER,
    _HELLO,
    FALLBACK_CHANNEL,
    MAX_RANKS,
    MAX_TENSORS,
    _RecvOp,
    _SendOp,
    _tag,
)

__all__ = [
    "FALLBACK_CHANNEL",
    "MAX_RANKS",
    "MAX_TENSORS",
    "UCXConfig",
    "UCXTransport",
    "foreign_ucx",
    "import_ucxx",
    "preload_before_mpi",
    "ucx_available",
]

log = logging.getLogger(__name__)

_OPEN: weakref.WeakSet[UCXTransport] = weakref.WeakSet()


def _abort_at_exit() -> None:
    # A transport left open at exit: close its endpoints so that UCX does not report them leaked.
    left = list(_OPEN)
    for transport in left:
        transport._closing = True  # the others going away now is expected
    for transport in left:
        try:
            transport.abort()
        except Exception as exc:
            log.warning("closing the UCX transport of rank %d at exit: %s", transport.rank, exc)


at_exit(Stage.DEVICE_TRANSPORT, _abort_at_exit)


class UCXTransport(UCXReceiving):
    """Point-to-point messages over UCX. Collective to create and to close, through `bootstrap`."""

    name = "ucx"

    def __init__(
        self,
        bootstrap: Bootstrap,
        *,
        config: TransportConfig | None = None,
        ucx: UCXConfig | None = None,
        node_key: str | None = None,
        fallback: MessageTransport | None = None,
        mailbox: Mailbox | None = None,
        orders: OrderCounter | None = None,
        device_map: DeviceMap = default_device_map,
    ) -> None:
        key = node_key if node_key is not None else socket.gethostname()
        try:
            self._ucx, self._array = import_ucxx()
        except TransportUnavailableError:
            # The other ranks wait in the exchange below: take part, so that they fail too.
            with contextlib.suppress(Exception):
                bootstrap.allgather(None)
            raise
        # First the nodes (they decide the network devices UCX may use) and the job's secret.
        secret = auth.new_secret() if bootstrap.rank == 0 else None  # the job's: see transport/auth.py
        nodes = bootstrap.allgather((key, secret))
        if any(p is None for p in nodes):
            raise TransportUnavailableError(
                f"the UCX transport could not start on ranks {[r for r, p in enumerate(nodes) if p is None]}"
            )
        if bootstrap.size > MAX_RANKS:
            raise TransportUnavailableError(
                f"the UCX transport supports up to {MAX_RANKS} ranks, not {bootstrap.size}"
            )
        super().__init__(
            bootstrap.rank,
            bootstrap.size,
            config=config or TransportConfig(),
            mailbox=mailbox,
            orders=orders,
            device_map=device_map,
        )
        self.ucx_config = ucx or UCXConfig()
        self._bootstrap = bootstrap
        self._fallback = fallback
        self._outq: collections.deque[_SendOp] = collections.deque()
        self._deferred: list[_SendOp] = []
        self._sends: list[_SendOp] = []
        self._awaiting: dict[tuple[int, int], _SendOp] = {}
        self._headers: dict[int, collections.deque[tuple[Any, Any, int]]] = {}
        self._recvs: list[_RecvOp] = []
        self._fallback_wait: dict[tuple[int, int], _RecvOp] = {}
        self._fallback_in: collections.deque[tuple[int, int, list[torch.Tensor]]] = collections.deque()
        self._ctrl_reqs: list[tuple[Any, Any]] = []
        self._eps: dict[int, Any] = {}
        self._ep_keep: list[Any] = []
        self._ep_errors: collections.deque[tuple[int, str]] = collections.deque()
        self._recv_buffers: dict[str, BufferManager] = {}
        self._send_buffers: dict[str, BufferManager] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._woken = False
        self._stopping = False
        self._closing = False
        self._aborting = False
        self._ready = False  # set once every rank's address is known
        self._secret: bytes = nodes[0][1]  # rank 0's draw
        self.rejected = 0
        """Messages refused because they did not carry the job's MAC (auth.py)."""
        self._peers: list[bytes] = []  # the ranks' UCX worker addresses
        self._same_node = [p[0] == key for p in nodes]
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._address = b""
        self._net_devices: str | None = None
        try:
            self._net_devices = job_net_devices(self.ucx_config, all(self._same_node))
        except TransportUnavailableError as exc:
            self._start_error = exc
        self._thread = threading.Thread(target=self._run, name=f"mp-comm-ucx-r{self.rank}", daemon=True)
        if self._start_error is None:
            self._thread.start()
            self._started.wait(60.0)
        if self._start_error is not None or not self._started.is_set():
            self._closed = True
            error = self._start_error or TransportError("UCX did not start within 60 s")
            # Peers are in the allgather below: take part so that they fail too instead of hanging.
            with contextlib.suppress(Exception):
                bootstrap.allgather(None)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            raise TransportUnavailableError(
                f"the UCX transport cannot start on rank {self.rank}: {error}"
            ) from error
        peers = bootstrap.allgather(self._address)
        if any(p is None for p in peers):
            self.abort()
            raise TransportUnavailableError(
                f"the UCX transport could not start on ranks {[r for r, p in enumerate(peers) if p is None]}"
            )
        self._peers = list(peers)
        self._ready = True
        self._wake()
        if fallback is not None:
            fallback.register_channel(FALLBACK_CHANNEL, self._on_fallback)
        _OPEN.add(self)
        log.debug("UCX transport up on rank %d (UCX_NET_DEVICES=%s)", self.rank, self._net_devices or "env")

    @classmethod
    def from_world(cls, world: Any, **kwargs: Any) -> UCXTransport:
        """The transport for a World (collective): addresses go through MPI, or torch.distributed."""
        kwargs.setdefault("node_key", str(world.info.node))
        network = getattr(world, "network", None)
        if kwargs.get("ucx") is None and network is not None and world.info.num_nodes > 1:
            kwargs["ucx"] = UCXConfig(host=network.address)  # the job's interface (mp_comm.network)
        kwargs["config"] = (kwargs.get("config") or TransportConfig()).for_world(world)
        return cls(bootstrap_for_world(world), **kwargs)

    @property
    def same_node(self) -> list[bool]:
        """For every rank, whether it shares this rank's node."""
        return list(self._same_node)

    def recv_buffer(self, device: str) -> BufferManager | None:
        """The persistent receive buffer manager of a device ("cpu", "cuda:0"; None until first used)."""
        return self._recv_buffers.get(device)

    # -- caller side ---------------------------------------------------------------------------------

    def _submit(self, out: Outgoing) -> None:
        if self._error is not None:
            raise TransportError(
                f"the UCX transport of rank {self.rank} has failed: {self._error}"
            ) from self._error
        if len(out.tensors) > MAX_TENSORS:
            raise MessageEncodeError(
                f"a message to rank {out.dest} with tag {out.tag!r} holds {len(out.tensors)} tensors; "
                f"the UCX transport carries at most {MAX_TENSORS} per message (use MPI, or split it)",
                peer=out.dest,
            )
        buffered = set(self.ucx_config.buffered_devices) if self._handshake(out.dest) else set()
        limit = self.config.inline_bytes
        modes = bytes(
            (
                ord("-")
                if not m.nbytes or (m.nbytes <= limit and t.device.type == "cpu")
                else ord("H")
                if t.device.type in buffered
                else ord("E")
            )
            for t, m in zip(out.tensors, out.metas, strict=True)
        )
        op = _SendOp(out, modes)
        device = next((t.device for t in out.tensors if t.device.type == "cuda"), None)
        if device is not None:
            # The payloads are read by UCX outside any stream: wait for the kernels that produce them.
            op.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            op.ready.record(torch.cuda.current_stream(device))
        self._outq.append(op)
        self._wake()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")

    def close(self, timeout: float | None = None) -> None:
        """Collective: finish this rank's sends, meet the other ranks, then close every endpoint."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._closing = True  # from here on, peers closing their endpoints is expected
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while (self._outq or self._sends or self._deferred) and self._error is None:
            if time.monotonic() > deadline:
                break
            time.sleep(1e-3)
        pending = len(self._outq) + len(self._sends) + len(self._deferred)
        met = self._bootstrap.barrier(max(0.0, deadline - time.monotonic())) if self._error is None else False
        self._stop()
        if met:
            self._bootstrap.close()
        self._fail_all(
            self._error or TransportClosedError(f"the UCX transport of rank {self.rank} was closed")
        )
        if pending:
            raise PeerTimeoutError(
                f"close() of the UCX transport on rank {self.rank}: {pending} sends did not complete within "
                f"{limit:g} s",
                waited=limit,
            )
        if not met and self._error is None:
            raise PeerTimeoutError(
                f"close() of the UCX transport on rank {self.rank} waited {limit:g} s for the other ranks "
                "to close (close is collective: every rank must call it)",
                waited=limit,
            )

    def abort(self) -> None:
        """Close at once, without meeting the other ranks: they see this rank's endpoints fail."""
        _OPEN.discard(self)
        self._closing = True
        if self._thread.is_alive():
            self._aborting = True
            self._stop()
        self._closed = True
        self._fail_all(TransportClosedError(f"the UCX transport of rank {self.rank} was aborted"))

    def _stop(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join(30.0)
        if self._thread.is_alive():
            log.error("the UCX progress thread of rank %d did not stop", self.rank)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- progress thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        ucx = self._ucx
        try:
            options = {} if self._net_devices is None else {"NET_DEVICES": self._net_devices}
            self._context = ucx.UCXContext(
                config_dict=options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
            )
            self._worker = ucx.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
            self._address = bytes(self._worker.address.tobytes())
            self._epoll_fd = self._worker.epoll_file_descriptor
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            while not self._stopping:
                if not self._round():
                    self._idle()
            if not self._aborting:
                self._drain()
        except BaseException as exc:
            log.exception("UCX progress thread of rank %d failed", self.rank)
            self._fail(exc)
        finally:
            self._teardown()

    def _fail(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, TransportError) else self._wrap_error("progress", exc, None)
        self._error = error
        for op in [*self._sends, *self._deferred, *self._outq]:
            op.out.handle._fail(error)
        self._fail_all(error)

    def _idle(self) -> None:
        # Sleep on the worker's event descriptor and the wake pipe. Spinning here instead was measured
        # slower on 2 cores: the spinning thread takes the GIL from the thread it should hand data to.
        in_flight = bool(self._sends or self._recvs or self._headers or self._deferred)
        busy = in_flight or self.mailbox.waiters > 0
        timeout = self.config.poll_min if busy else self.config.poll_max
        if self._worker.arm():
            with contextlib.suppress(InterruptedError, OSError):
                select.select([self._epoll_fd, self._wake_r], [], [], timeout)
        self._woken = False
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._wake_r, 4096)

    def _round(self) -> bool:
        self._worker.progress()
        if not self._ready:  # messages wait in UCX's queue until the peers' addresses are known
            return False
        worked = self._probe(_HELLO)
        worked |= self._handle_ep_errors()
        worked |= self._post_sends()
        worked |= self._probe(_HEADER)
        worked |= self._probe(_CTRL)
        worked |= self._finish_headers()
        worked |= self._take_fallbacks()
        worked |= self._finish_recvs()
        worked |= self._finish_sends()
        return worked

    # sending

    def _post_sends(self) -> bool:
        worked = False
        if self._deferred:
            still: list[_SendOp] = []
            for op in self._deferred:
                (self._start_send(op) if op.ready.query() else still.append(op))
            worked = len(still) != len(self._deferred)
            self._deferred = still
        while self._outq:
            op = self._outq.popleft()
            worked = True
            if op.ready is not None and not op.ready.query():
                self._deferred.append(op)
                continue
            self._start_send(op)
        return worked

    def _start_send(self, op: _SendOp) -> None:
        out = op.out
        try:
            ep = self._endpoint(out.dest)
            can_fallback = self._fallback is not None
            header, _ = out.header(extra=(op.modes, can_fallback), inline_limit=self.config.inline_bytes)
            tag = _tag(_HEADER, self.rank, out.wire)
            hbuf = np.frombuffer(bytearray(auth.seal(self._secret, tag, bytes(header))), dtype=np.uint8)
            op.keep.append(hbuf)
            op.reqs.append(ep.tag_send(self._array(hbuf), self._ucx.UCXXTag(tag)))
            for i, mode in enumerate(op.modes):
                if mode == ord("E"):
                    self._send_payload(op, ep, i, staged=False)
            if ord("H") in op.modes:
                op.awaiting = True
                self._awaiting[(out.dest, out.wire & 0xFFFFFF)] = op
        except Exception as exc:
            out.handle._fail(self._wrap_error(f"sending tag {out.tag!r}", exc, out.dest))
            return
        self._sends.append(op)

    def _finish_sends(self) -> bool:
        done: list[_SendOp] = []
        for op in self._sends:
            if op.awaiting:
                continue
            try:
                if not all(r.completed for r in op.reqs):
                    continue
                for r in op.reqs:
                    r.check_error()
                if op.fallback is not None:
                    if not op.fallback.done():
                        continue
                    error = op.fallback.exception()
                    if error is not None:
                        raise error
            except Exception as exc:
                op.out.handle._fail(self._wrap_error(f"sending tag {op.out.tag!r}", exc, op.out.dest))
            else:
                op.out.handle._complete()
            for manager, region in op.regions:
                manager.release(region)
            done.append(op)
        for op in done:
            self._sends.remove(op)
        self._ctrl_reqs = [(r, b) for r, b in self._ctrl_reqs if not r.completed]
        self._ep_keep = [(r, b) for r, b in self._ep_keep if not r.completed]
        return bool(done)

    # shutdown

    def _drain(self) -> None:
        """After the closing barrier: finish receives still under way (briefly)."""
        deadline = time.monotonic() + 5.0
        while (self._recvs or self._headers) and time.monotonic() < deadline:
            if not self._round():
                self._idle()

    def _teardown(self) -> None:
        self._stopping = True
        for ep in self._eps.values():
            with contextlib.suppress(Exception):
                ep.close_blocking()
        with contextlib.suppress(Exception):
            for _ in range(10):
                self._worker.progress()
        self._eps.clear()
        self._ep_keep.clear()
        self._ctrl_reqs.clear()
        self._sends.clear()
        self._recvs.clear()
        self._headers.clear()
        for name in ("_worker", "_context"):
            if hasattr(self, name):
                delattr(self, name)
        log.debug("UCX transport of rank %d closed", self.rank)
