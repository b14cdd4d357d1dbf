"""The receiving side of the UCX transport: probe headers, open the message's payload receives, and
deliver it complete (mp_comm.transport.base) once every payload has landed.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np

from mp_comm.errors import MessageDecodeError
from mp_comm.message import Header, byte_view, decode_header
from mp_comm.transport import auth
from mp_comm.transport.ucx_payloads import UCXPayloads
from mp_comm.transport.ucx_wire import (
    _CTRL_WIRE,
    _HEADER,
    _HELLO,
    _KIND_MASK,
    MAX_TENSORS,
    _RecvOp,
    _tag_source,
)

__all__ = ["UCXReceiving"]

log = logging.getLogger("mp_comm.transport.ucx")  # the logger these messages always had

_CTRL_MAX = _CTRL_WIRE.size + MAX_TENSORS + auth.MAC_BYTES  # the wire counter, a letter per payload, MAC


class UCXReceiving(UCXPayloads):
    """Header probes and payload receives (a base of UCXTransport; runs on its progress thread)."""

    _headers: dict[int, collections.deque[tuple[Any, Any, int]]]
    _recvs: list[_RecvOp]

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
