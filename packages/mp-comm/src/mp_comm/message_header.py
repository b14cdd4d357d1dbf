"""The header of a message: its object's bytes and tensor metadata, the fields that order and route
it, and static mode's metadata cache.

Static shapes: when a sender repeats a (destination, tag) with identical metadata and static mode is
on, the header names a slot of the receiver's metadata cache instead of carrying the metadata
(:class:`MetaCacheSender`, :class:`MetaCacheReceiver`). The sender owns the slot numbers, so the two
caches agree as long as one sender's headers are processed in order, which every transport ensures.
"""

from __future__ import annotations

import ctypes
import pickle
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import numpy as np
import torch

from mp_comm.errors import MessageDecodeError
from mp_comm.message_tensors import _FROM_WIRE_MAX, TensorMeta, byte_view, is_dense

__all__ = [
    "PROTOCOL_VERSION",
    "Header",
    "MetaCacheReceiver",
    "MetaCacheSender",
    "Tag",
    "decode_header",
    "encode_header",
    "inline_payloads",
    "land_inline",
    "pack_header",
]

#: Bumped whenever the header layout or the encoding of bodies changes; a header of another version is
#: refused by name.
PROTOCOL_VERSION: Final = 2

#: A message tag: an int, a str, or a tuple of those (anything hashable and picklable).
Tag: TypeAlias = Hashable

_PICKLE_PROTOCOL: Final = pickle.HIGHEST_PROTOCOL

# A whole message's parsed metadata by its wire form: one lookup per message instead of one per tensor.
_METAS_FROM_WIRE: dict[tuple[Any, ...], tuple[TensorMeta, ...]] = {}


@dataclass(slots=True)  # not frozen: one is built per message, and a frozen init costs twice as much
class Header:
    """The first part of every message: the object with stubs and the tensors' metadata.

    `tag` is the user's tag, `order` the sender's per-destination sequence number that the receiving
    mailbox delivers in (one sender's messages arrive in the order they were sent), `wire` the
    transport's own per-destination counter (it names the payloads on the wire), `channel` 0 for user
    messages and another value for a transport's internal traffic. `metas` is None when the metadata
    comes from the receiver's cache slot `slot` (static mode); a full header with `slot` >= 0 also
    stores its metadata there. `extra` carries transport-specific fields (UCX's transfer modes).
    """

    tag: Tag
    order: int
    wire: int
    body: bytes
    metas: tuple[TensorMeta, ...] | None
    slot: int = -1
    channel: int = 0
    extra: tuple[Any, ...] = ()
    inline: tuple[int, ...] = ()
    """Indices of the tensors whose bytes travel inside the header, concatenated in `blob` (small
    payloads: one message instead of two is cheaper than the copy)."""
    blob: bytes = b""


def encode_header(h: Header) -> bytes:
    return pack_header(
        h.tag,
        h.order,
        h.wire,
        h.body,
        metas=h.metas,
        slot=h.slot,
        channel=h.channel,
        extra=h.extra,
        inline=h.inline,
        blob=h.blob,
    )


def pack_header(
    tag: Tag,
    order: int,
    wire: int,
    body: bytes,
    *,
    metas: Sequence[TensorMeta] | None,
    slot: int,
    channel: int,
    extra: tuple[Any, ...],
    inline: tuple[int, ...],
    blob: bytes,
) -> bytes:
    """The header's bytes from its fields (`encode_header` without building a Header first)."""
    wires = None if metas is None else tuple([m.wire for m in metas])
    raw = (PROTOCOL_VERSION, tag, order, wire, body, wires, slot, channel, extra, inline, blob)
    return pickle.dumps(raw, protocol=_PICKLE_PROTOCOL)


def inline_payloads(
    tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta], limit: int
) -> tuple[tuple[int, ...], bytes]:
    """Which host tensors of at most `limit` bytes travel inside the header, and their bytes."""
    if limit <= 0:
        return (), b""
    index: list[int] = []
    parts: list[bytes] = []
    for i, (t, m) in enumerate(zip(tensors, metas, strict=True)):
        n = m.nbytes
        if 0 < n <= limit and t.is_cpu:
            # Wire tensors are dense and described by their metadata (wire_tensors makes both).
            index.append(i)
            # A dense tensor's bytes span [data_ptr, data_ptr + nbytes): strides are never negative.
            parts.append(ctypes.string_at(t.data_ptr(), n))
    if len(parts) == 1:
        return tuple(index), parts[0]
    return tuple(index), b"".join(parts)


def land_inline(header: Header, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> None:
    """Copy the header's inline payloads into their destination tensors."""
    offset = 0
    blob = header.blob if type(header.blob) is bytes else bytes(header.blob)
    for i in header.inline:
        n = metas[i].nbytes
        if offset + n > len(blob):
            raise ValueError(
                f"the header's inline payloads hold {len(blob)} bytes, tensor {i} needs {n} at {offset}"
            )
        dst = tensors[i]
        if dst.is_cpu and is_dense(dst) and dst.numel() * dst.element_size() == n:
            # One memcpy into the freshly allocated, dense destination.
            ctypes.memmove(dst.data_ptr(), blob if n == len(blob) else blob[offset : offset + n], n)
        else:
            src = np.frombuffer(blob, dtype=np.uint8, count=n, offset=offset)
            byte_view(dst).copy_(torch.from_numpy(src.copy()).to(dst.device))
        offset += n


def decode_header(data: bytes | bytearray | memoryview, *, source: int) -> Header:
    """Parse a header; a header that cannot be parsed raises MessageDecodeError naming the source."""
    try:
        raw = pickle.loads(data)
        version = raw[0]
        if version != PROTOCOL_VERSION:
            raise ValueError(
                f"protocol version {version!r}, this rank speaks {PROTOCOL_VERSION}; run the same mp-comm "
                "version on every rank"
            )
        _, tag, order, wire, body, metas, slot, channel, extra, inline, blob = raw
        parsed = None if metas is None else _metas_from_wire(metas)
        return Header(
            tag,
            int(order),
            int(wire),
            body,
            parsed,
            int(slot),
            int(channel),
            tuple(extra),
            tuple(inline),
            blob,
        )
    except Exception as exc:
        raise MessageDecodeError(
            f"a message header from rank {source} cannot be parsed ({len(data)} bytes): "
            f"{type(exc).__name__}: {exc}",
            peer=source,
        ) from exc


def _metas_from_wire(raw: Sequence[Any]) -> tuple[TensorMeta, ...]:
    # A pipeline repeats whole messages' metadata: one cache lookup per message.
    key = raw if type(raw) is tuple else None
    if key is not None:
        try:
            cached = _METAS_FROM_WIRE.get(key)
        except TypeError:  # something unhashable inside: parse it below (and fail there if bad)
            key = cached = None
        if cached is not None:
            return cached
    parsed = tuple([TensorMeta.from_wire(m) for m in raw])
    if key is not None:
        if len(_METAS_FROM_WIRE) >= _FROM_WIRE_MAX:
            _METAS_FROM_WIRE.clear()
        _METAS_FROM_WIRE[key] = parsed
    return parsed


class MetaCacheSender:
    """The sender's half of static mode: which cache slot of each receiver holds which metadata.

    `slots` bounds the receiver's cache per sender; the least recently used (destination, tag) gives
    its slot up when a new one needs room.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}; the static metadata cache needs at least one slot")
        self._slots = slots
        self._by_dest: dict[int, OrderedDict[Tag, tuple[int, tuple[TensorMeta, ...]]]] = {}

    def lookup(self, dest: int, tag: Tag, metas: tuple[TensorMeta, ...]) -> tuple[int, bool]:
        """(slot, hit): on a hit the header omits the metadata; on a miss it stores it in `slot`."""
        table = self._by_dest.setdefault(dest, OrderedDict())
        entry = table.get(tag)
        if entry is not None:
            slot, cached = entry
            table.move_to_end(tag)
            if cached == metas:
                return slot, True
            table[tag] = (slot, metas)
            return slot, False
        if len(table) < self._slots:
            slot = len(table)
        else:
            _, (slot, _) = table.popitem(last=False)
        table[tag] = (slot, metas)
        return slot, False


class MetaCacheReceiver:
    """The receiver's half of static mode: per sender, the metadata stored in each slot."""

    def __init__(self) -> None:
        self._by_source: dict[int, dict[int, tuple[TensorMeta, ...]]] = {}

    def resolve(self, source: int, header: Header) -> tuple[TensorMeta, ...]:
        """The header's metadata: stored into the slot if it carries it, else read from the slot."""
        if header.metas is not None:
            if header.slot >= 0:
                self._by_source.setdefault(source, {})[header.slot] = header.metas
            return header.metas
        cached = self._by_source.get(source, {}).get(header.slot)
        if cached is None:
            raise MessageDecodeError(
                f"rank {source} sent a static-mode header naming metadata slot {header.slot} for tag "
                f"{header.tag!r}, but no metadata was stored there; the two ranks' caches disagree "
                "(were headers processed out of order?)",
                peer=source,
            )
        return cached
