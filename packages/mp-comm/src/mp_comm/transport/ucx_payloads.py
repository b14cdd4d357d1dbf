"""How the UCX transport moves tensor payloads: straight into the tensor, or, on the device-to-device
path, through persistent buffers after a handshake, or over the fallback transport.

Device payloads (by default the device types in `UCXConfig.buffered_devices`, i.e. CUDA) sent to
another node (or to any peer, per `UCXConfig.buffered_peers`) go through persistent buffers with a
handshake (D2DAllocatorThread's role): the header asks, the receiver
reserves room in its persistent receive buffer and answers with a CTRL message naming the outcome,
and only then does the sender send those payloads. The outcomes, agreed by both sides because the
receiver decides and the sender obeys:

* ``B`` buffered: the payload lands in the receiver's persistent buffer, then is copied to the tensor;
* ``F`` fallback: no room, and both ranks have a fallback transport (MPI): the payloads go over it;
* ``D`` direct: no room and no fallback: UCX receives straight into the tensor (registering it).

Across nodes (or always, per `UCXConfig.stage_sends`) the sender also copies a device payload into
its persistent send buffer before sending, when there is room.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mp_comm.buffers import BufferManager, Region
from mp_comm.message import Header, byte_view, decode_object, numpy_bytes
from mp_comm.transport import auth
from mp_comm.transport.base import MessageTransport
from mp_comm.transport.ucx_endpoints import UCXEndpoints
from mp_comm.transport.ucx_wire import _CTRL, _CTRL_WIRE, _DATA, FALLBACK_CHANNEL, _RecvOp, _SendOp, _tag

__all__ = ["UCXPayloads"]

log = logging.getLogger("mp_comm.transport.ucx")  # the logger these messages always had


class UCXPayloads(UCXEndpoints):
    """Payload transfer and the D2D handshake (a base of UCXTransport; runs on its progress thread)."""

    _fallback: MessageTransport | None
    _fallback_in: collections.deque[tuple[int, int, list[torch.Tensor]]]
    _fallback_wait: dict[tuple[int, int], _RecvOp]
    _ctrl_reqs: list[tuple[Any, Any]]
    _recv_buffers: dict[str, BufferManager]
    _send_buffers: dict[str, BufferManager]

    if TYPE_CHECKING:

        def _wake(self) -> None: ...  # UCXTransport's: wakes its progress thread

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
