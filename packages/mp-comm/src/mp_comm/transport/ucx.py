"""The UCX transport (ucxx): endpoints from worker addresses, opened lazily, tag matching.

Install with ``pip install 'mp-comm[ucx]'`` (the ``ucxx-cu12`` wheels). On CPU, UCX moves host memory
over shared memory (cma, posix, sysv) or tcp; with GPUs it is the device-to-device path: CUDA IPC
between GPUs of one node, GPUDirect RDMA across nodes, chosen by UCX itself.

No rank listens for connections: the ranks' UCX worker addresses are exchanged once through a
:class:`Bootstrap`, and an endpoint to a peer is created from its worker address the first time this
rank sends to it. Its first message, a sealed hello (a HELLO tag message carrying the job's secret,
transport/auth.py), makes the peer open an endpoint back to that rank's worker address, as given by the
bootstrap (never taken from the message), so that the peer can name whoever goes away. UCX's own
network transports are limited to the job's interface (`UCXConfig.net_devices`). UCX calls are made by
the transport's progress thread only; it sleeps on the worker's event descriptor (and a pipe that
`send` writes to) when idle.

Payloads go straight into the tensor, or, on the device-to-device path, through persistent buffers
after a handshake, or over the fallback transport. Device payloads (by default the device types in
`UCXConfig.buffered_devices`, i.e. CUDA) sent to another node (or to any peer, per
`UCXConfig.buffered_peers`) go through persistent buffers: the header asks, the receiver reserves room
in its persistent receive buffer and answers with a CTRL message naming the outcome, and only then does
the sender send those payloads. The outcomes, agreed by both sides because the receiver decides and the
sender obeys:

* ``B`` buffered: the payload lands in the receiver's persistent buffer, then is copied to the tensor;
* ``F`` fallback: no room, and both ranks have a fallback transport (MPI): the payloads go over it;
* ``D`` direct: no room and no fallback: UCX receives straight into the tensor (registering it).

Across nodes (or always, per `UCXConfig.stage_sends`) the sender also copies a device payload into its
persistent send buffer before sending, when there is room.

The wire (tags, control messages, the records of messages in flight) is in ucx_wire; finding and
configuring ucxx in ucx_setup; this module is the transport itself: its lifecycle, the progress thread,
endpoints and their authentication, the sending side, payloads and the handshake, the receiving side.
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

from mp_comm.buffers import BufferManager, Region
from mp_comm.errors import (
    MessageDecodeError,
    MessageEncodeError,
    PeerTimeoutError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
)
from mp_comm.message import (
    DeviceMap,
    Header,
    byte_view,
    decode_header,
    decode_object,
    default_device_map,
    numpy_bytes,
)
from mp_comm.teardown import Stage, at_exit
from mp_comm.transport import auth
from mp_comm.transport.base import Mailbox, MessageTransport, OrderCounter, Outgoing, TransportConfig
from mp_comm.transport.bootstrap import Bootstrap, bootstrap_for_world
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
    _CTRL_WIRE,
    _DATA,
    _HEADER,
    _HELLO,
    _KIND_MASK,
    FALLBACK_CHANNEL,
    MAX_RANKS,
    MAX_TENSORS,
    _RecvOp,
    _SendOp,
    _tag,
    _tag_source,
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

_CTRL_MAX = _CTRL_WIRE.size + MAX_TENSORS + auth.MAC_BYTES  # the wire counter, a letter per payload, MAC

_OPEN: weakref.WeakSet[UCXTransport] = weakref.WeakSet()


def _abort_at_exit() -> None:
    # A transport left open at exit: close its endpoints so that UCX does not report them leaked.
    left = list(_OPEN)
    for transport in left:
        transport.expect_closing()  # the others going away now is expected
    for transport in left:
        try:
            transport.abort()
        except Exception as exc:
            log.warning("closing the UCX transport of rank %d at exit: %s", transport.rank, exc)


at_exit(Stage.DEVICE_TRANSPORT, _abort_at_exit)


class UCXTransport(MessageTransport):
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
        self._address = b""  # this rank's UCX worker address, once the progress thread made the worker
        # UCX's context and worker: made, used and released by the progress thread only (_run)
        self._context: Any = None
        self._worker: Any = None
        self._epoll_fd = -1
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

    def expect_closing(self) -> None:
        """From now on, peers closing their endpoints is expected (not reported as a failure)."""
        self._closing = True

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
            op.out.handle.set_failed(error)
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

    # -- endpoints and their authentication ----------------------------------------------------------

    def _on_outgoing_closed(self, rank: int, *_: Any) -> None:
        if not self._closing:
            self._ep_errors.append((rank, "this rank's connection to it closed"))

    def _endpoint(self, rank: int) -> Any:
        ep = self._eps.get(rank)
        if ep is None:
            ucx = self._ucx
            address = ucx.UCXAddress.create_from_buffer(np.frombuffer(self._peers[rank], dtype=np.uint8))
            errors = self.ucx_config.error_handling
            ep = ucx.UCXEndpoint.create_from_worker_address(self._worker, address, errors)
            ep.set_close_callback(self._on_outgoing_closed, cb_args=(rank,))
            hello = np.frombuffer(bytearray(auth.hello(self._secret, self.rank)), dtype=np.uint8)
            tag = ucx.UCXXTag(_tag(_HELLO, self.rank, 0))
            self._ep_keep.append((ep.tag_send(self._array(hello), tag), hello))
            self._eps[rank] = ep
        return ep

    def _on_hello(self, source: int, data: bytes) -> None:
        """A rank's first message to this one: open an endpoint back to it (to see it go away)."""
        rank = auth.open_hello(self._secret, data)
        if rank is None or rank != source or not 0 <= rank < self.size:
            self._refuse(source, "hello")
            return
        if rank not in self._eps and not self._closing:
            try:
                self._endpoint(rank)
            except Exception as exc:  # it went away already: its sends will say so
                log.warning("rank %d: cannot open an endpoint back to rank %d: %s", self.rank, rank, exc)

    def _handle_ep_errors(self) -> bool:
        if not self._ep_errors:
            return False
        while self._ep_errors:
            rank, why = self._ep_errors.popleft()
            error = self._lost(rank, why)
            log.error("%s", error)
            self.mailbox.fail_peer(rank, error)
            for op in [*self._sends, *self._deferred]:
                if op.out.dest == rank:
                    op.out.handle.set_failed(error)
            for op in self._sends:
                if op.out.dest == rank:
                    for manager, region in op.regions:
                        manager.release(region)
            self._sends = [op for op in self._sends if op.out.dest != rank]
            self._deferred = [op for op in self._deferred if op.out.dest != rank]
            self._awaiting = {k: v for k, v in self._awaiting.items() if k[0] != rank}
            self._eps.pop(rank, None)
        return True

    def _refuse(self, claimed: int, what: str) -> None:
        # Not the job's: dropped unread. The rank it claims to come from is not failed (it may be fine).
        self.rejected += 1
        log.error(
            "rank %d: dropped a %s that claims to come from rank %d but does not carry the job's MAC "
            "(a process outside the job reached this rank's UCX worker)",
            self.rank,
            what,
            claimed,
        )

    # -- sending -------------------------------------------------------------------------------------

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
            out.handle.set_failed(self._wrap_error(f"sending tag {out.tag!r}", exc, out.dest))
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
                op.out.handle.set_failed(self._wrap_error(f"sending tag {op.out.tag!r}", exc, op.out.dest))
            else:
                op.out.handle.set_done()
            for manager, region in op.regions:
                manager.release(region)
            done.append(op)
        for op in done:
            self._sends.remove(op)
        self._ctrl_reqs = [(r, b) for r, b in self._ctrl_reqs if not r.completed]
        self._ep_keep = [(r, b) for r, b in self._ep_keep if not r.completed]
        return bool(done)

    # -- payloads and the device-to-device handshake -------------------------------------------------

    def _on_fallback(self, source: int, header: Header, tensors: list[torch.Tensor]) -> None:
        # Runs on the fallback transport's progress thread: hand over to ours.
        wire = int(header.tag[1]) if isinstance(header.tag, tuple) else -1
        payloads = decode_object(header.body, tensors)  # a list of tensors, duplicates kept
        assert isinstance(payloads, list)
        self._fallback_in.append((source, wire, payloads))
        self._wake()

    def _payload_array(self, t: torch.Tensor) -> Any:
        return self._array(numpy_bytes(t) if t.device.type == "cpu" else byte_view(t))

    def _send_payload(self, op: _SendOp, ep: Any, i: int, *, staged: bool) -> None:
        t = op.out.tensors[i]
        src = byte_view(t)
        if staged:
            manager = self._buffer(self._send_buffers, t.device, self.ucx_config.send_buffer_bytes)
            region = manager.reserve(src.numel()) if manager is not None else None
            if region is not None:
                view = manager.view(region)  # type: ignore[union-attr]
                self._land([(view, src)])
                op.regions.append((manager, region))  # type: ignore[arg-type]
                src = view
        payload = numpy_bytes(src) if src.device.type == "cpu" else src
        op.keep.append(payload)
        op.reqs.append(
            ep.tag_send(self._array(payload), self._ucx.UCXXTag(_tag(_DATA, self.rank, op.out.wire, i)))
        )

    def _handshake(self, dest: int) -> bool:
        return self.ucx_config.buffered_peers == "all" or not self._same_node[dest]

    def _staging(self, dest: int) -> bool:
        policy = self.ucx_config.stage_sends
        return policy == "always" or (policy == "cross-node" and not self._same_node[dest])

    def _on_ctrl(self, source: int, wire: int, decision: str) -> None:
        op = self._awaiting.pop((source, wire), None)
        if op is None:
            log.error(
                "rank %d: a D2D answer from rank %d for a message it does not wait for", self.rank, source
            )
            return
        op.awaiting = False
        held = [i for i, m in enumerate(op.modes) if m == ord("H")]
        if decision == "F":
            assert self._fallback is not None
            self.stats["d2d_fallback"] += 1
            payload = [op.out.tensors[i] for i in held]
            op.fallback = self._fallback.send_channel(payload, source, FALLBACK_CHANNEL, tag=("d2d", wire))
            return
        self.stats["d2d_buffered" if decision == "B" else "d2d_direct"] += 1
        ep = self._endpoint(source)
        stage = self._staging(source)
        for i in held:
            self._send_payload(op, ep, i, staged=stage)

    def _land_or_fallback(self, op: _RecvOp, held: list[int], peer_can_fallback: bool) -> str:
        """Reserve persistent-buffer room for the held payloads: the outcome both sides then follow."""
        by_device: dict[torch.device, list[int]] = {}
        for i in held:
            by_device.setdefault(op.tensors[i].device, []).append(i)
        reserved: list[tuple[int, BufferManager, Region]] = []
        ok = True
        for device, index in by_device.items():
            manager = self._buffer(self._recv_buffers, device, self.ucx_config.recv_buffer_bytes)
            regions = None if manager is None else manager.reserve_all([op.metas[i].nbytes for i in index])
            if regions is None:
                ok = False
                break
            reserved += [(i, manager, r) for i, r in zip(index, regions, strict=True)]  # type: ignore[misc]
        if ok:
            for i, manager, region in reserved:
                op.landing.append((i, manager, region))
                view = manager.view(region)
                self._post_recv(op, i, self._array(numpy_bytes(view) if view.device.type == "cpu" else view))
            return "B"
        for _, manager, region in reserved:
            manager.release(region)
        if peer_can_fallback and self._fallback is not None:
            op.fallback_index = tuple(held)
            op.waiting_fallback = True
            self._fallback_wait[(op.source, op.header.wire & 0xFFFFFF)] = op
            return "F"
        for i in held:
            self._post_recv(op, i, self._payload_array(op.tensors[i]))
        return "D"

    def _post_recv(self, op: _RecvOp, i: int, array: Any) -> None:
        op.keep.append(array)
        tag = self._ucx.UCXXTag(_tag(_DATA, op.source, op.header.wire, i))
        op.reqs.append(self._worker.tag_recv(array, tag))

    def _send_ctrl(self, dest: int, wire: int, decision: str) -> None:
        tag = _tag(_CTRL, self.rank, wire)
        raw = auth.seal(self._secret, tag, _CTRL_WIRE.pack(wire) + decision.encode("ascii"))
        buf = np.frombuffer(bytearray(raw), dtype=np.uint8)
        req = self._endpoint(dest).tag_send(self._array(buf), self._ucx.UCXXTag(tag))
        self._ctrl_reqs.append((req, buf))

    def _take_fallbacks(self) -> bool:
        worked = False
        while self._fallback_in:
            source, wire, tensors = self._fallback_in.popleft()
            worked = True
            op = self._fallback_wait.pop((source, wire), None)
            if op is None:
                log.error("rank %d: fallback payloads from rank %d for an unknown message", self.rank, source)
                continue
            for i, t in zip(op.fallback_index, tensors, strict=True):
                op.tensors[i] = t.to(op.tensors[i].device) if t.device != op.tensors[i].device else t.detach()
            op.waiting_fallback = False
        return worked

    def _buffer(
        self, table: dict[str, BufferManager], device: torch.device, capacity: int
    ) -> BufferManager | None:
        if capacity <= 0:
            return None
        key = str(device)
        manager = table.get(key)
        if manager is None:
            manager = table[key] = BufferManager(capacity, device, alignment=self.ucx_config.buffer_alignment)
        return manager

    # -- receiving -----------------------------------------------------------------------------------

    def _probe(self, kind: int) -> bool:
        ucx = self._ucx
        worked = False
        for _ in range(64):
            probe = self._worker.tag_probe(ucx.UCXXTag(kind << 62), ucx.UCXXTagMask(_KIND_MASK), True)
            if not probe.matched:
                break
            worked = True
            tag = int(probe.sender_tag.value)
            source = _tag_source(tag)
            if kind == _HEADER:
                buf = np.empty(int(probe.length), dtype=np.uint8)
                req = self._worker.tag_recv_with_handle(self._array(buf), probe)
                self._headers.setdefault(source, collections.deque()).append((req, buf, tag))
                continue
            # Hellos and control messages are a few bytes, already here; a longer one is not the job's.
            what, limit = ("hello", auth.HELLO_BYTES) if kind == _HELLO else ("control message", _CTRL_MAX)
            buf = np.empty(max(1, min(int(probe.length), limit)), dtype=np.uint8)
            req = self._worker.tag_recv_with_handle(self._array(buf), probe)
            while not req.completed:
                self._worker.progress()
            try:
                req.check_error()  # a truncated one fails here
            except Exception:
                self._refuse(source, what)
                continue
            if int(probe.length) > limit:
                self._refuse(source, what)
            elif kind == _HELLO:
                self._on_hello(source, buf.tobytes())
            else:
                ctrl = auth.unseal(self._secret, tag, buf.tobytes())
                if ctrl is None or len(ctrl) < _CTRL_WIRE.size:
                    self._refuse(source, what)
                    continue
                (wire,) = _CTRL_WIRE.unpack_from(ctrl)
                self._on_ctrl(source, int(wire), ctrl[_CTRL_WIRE.size :].decode("ascii", "replace"))
        return worked

    def _finish_headers(self) -> bool:
        worked = False
        for source in list(self._headers):
            queue = self._headers[source]
            while queue and queue[0][0].completed:
                req, buf, tag = queue.popleft()
                worked = True
                try:
                    req.check_error()
                    header = auth.unseal(self._secret, tag, buf.tobytes())
                    if header is None:  # checked before anything is unpickled
                        self._refuse(source, "message header")
                        continue
                    self._start_recv(source, decode_header(header, source=source))
                except MessageDecodeError as exc:
                    log.error("rank %d: %s", self.rank, exc)
                    self.mailbox.fail_peer(source, exc)
                except Exception as exc:
                    error = self._wrap_error("receiving a header", exc, source)
                    self.mailbox.fail_peer(source, error)
            if not queue:
                del self._headers[source]
        return worked

    def _start_recv(self, source: int, header: Header) -> None:
        prepared = self._prepare_arrival(source, header)
        if prepared is None:
            return
        metas, tensors = prepared
        modes: bytes = header.extra[0] if header.extra else b""
        peer_can_fallback = bool(header.extra[1]) if len(header.extra) > 1 else False
        op = _RecvOp(source, header, metas, tensors)
        held = [i for i, m in enumerate(modes) if m == ord("H")]
        for i, m in enumerate(modes):
            if m == ord("E"):
                self._post_recv(op, i, self._payload_array(tensors[i]))
        if held:
            decision = self._land_or_fallback(op, held, peer_can_fallback)
            self._send_ctrl(source, header.wire & 0xFFFFFF, decision)
        self._recvs.append(op)

    def _finish_recvs(self) -> bool:
        done: list[_RecvOp] = []
        for op in self._recvs:
            if op.waiting_fallback or not all(r.completed for r in op.reqs):
                continue
            done.append(op)
            try:
                for r in op.reqs:
                    r.check_error()
                # UCX completes a receive once its bytes are in place (CUDA copies included).
                if op.landing:
                    self._land([(byte_view(op.tensors[i]), m.view(region)) for i, m, region in op.landing])
            except Exception as exc:
                error = self._wrap_error(f"receiving tag {op.header.tag!r}", exc, op.source)
                self.mailbox.fail_peer(op.source, error)
                self._arrival_failed(op.source, op.header, error)
            else:
                self._arrived(op.source, op.header, op.tensors, op.metas)
            finally:
                for _, manager, region in op.landing:
                    manager.release(region)
        for op in done:
            self._recvs.remove(op)
        return bool(done)

    # -- shutdown ------------------------------------------------------------------------------------

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
        self._worker = None
        self._context = None
        log.debug("UCX transport of rank %d closed", self.rank)
