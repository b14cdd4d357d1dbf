"""The message format of the point-to-point transports: tensor stubs, metadata first, payloads apart.

An object to send (any picklable Python value: lists, tuples, dicts, dataclasses, HuggingFace
``ModelOutput``, ``None``, numbers, with tensors nested anywhere) is pickled once with every strided
``torch.Tensor`` in it replaced by a stub (a call naming the tensor's index in the message). The tensors
themselves travel as raw bytes, each described by a :class:`TensorMeta` (shape, strides, dtype, device,
requires_grad), which reaches the receiver in the :class:`Header` before any payload so that it can
allocate the buffers the payloads land in. The receiver unpickles the object with the stubs resolved
to the received tensors (:func:`decode_object`).

Copies: a tensor whose memory is dense (contiguous, or a permutation of a contiguous layout such as
a transpose) travels as its own memory, zero-copy for CPU tensors, and arrives with the same strides.
A view with gaps or overlaps (a slice with a step, an ``expand``) is made contiguous first, and so
arrives contiguous with the same values. Conjugate and negative views are resolved first.

Static shapes: when a sender repeats a (destination, tag) with identical metadata and static mode is
on, the header names a slot of the receiver's metadata cache instead of carrying the metadata
(:class:`MetaCacheSender`, :class:`MetaCacheReceiver`). The sender owns the slot numbers, so the two
caches agree as long as one sender's headers are processed in order, which every transport ensures.
"""

from __future__ import annotations

import ctypes
import io
import logging
import math
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import numpy as np
import torch

from mp_comm.buffers import HostPool
from mp_comm.errors import MessageDecodeError, MessageEncodeError

__all__ = [
    "PROTOCOL_VERSION",
    "DeviceMap",
    "Header",
    "MetaCacheReceiver",
    "MetaCacheSender",
    "Tag",
    "TensorMeta",
    "allocate",
    "byte_view",
    "decode_header",
    "decode_object",
    "default_device_map",
    "encode_header",
    "encode_object",
    "inline_payloads",
    "is_dense",
    "land_inline",
    "numpy_bytes",
    "pack_header",
    "wire_tensors",
]

log = logging.getLogger(__name__)

#: Bumped whenever the header layout or the encoding of bodies changes; a header of another version is
#: refused by name.
PROTOCOL_VERSION: Final = 2

#: A message tag: an int, a str, or a tuple of those (anything hashable and picklable).
Tag: TypeAlias = Hashable

_PICKLE_PROTOCOL: Final = pickle.HIGHEST_PROTOCOL
_DTYPES: Final[dict[str, torch.dtype]] = {
    str(dt).removeprefix("torch."): dt for dt in vars(torch).values() if isinstance(dt, torch.dtype)
}
_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {dt: name for name, dt in _DTYPES.items()}
_CPU: Final = torch.device("cpu")
_META: Final = torch.device("meta")
# Parsed metadata by its wire form: a pipeline repeats its shapes, and building a frozen dataclass costs
# more than the lookup. Bounded: cleared when full.
_FROM_WIRE: dict[tuple[Any, ...], TensorMeta] = {}
_FROM_WIRE_MAX: Final = 4096
# The sender's metadata objects by their fields, for the same reason (bounded the same way).
_TO_WIRE: dict[tuple[Any, ...], TensorMeta] = {}
# A whole message's parsed metadata by its wire form: one lookup per message instead of one per tensor.
_METAS_FROM_WIRE: dict[tuple[Any, ...], tuple[TensorMeta, ...]] = {}
_LOCAL = threading.local()  # per thread: a pickler to reuse


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor before its bytes arrive."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """Strides of the tensor as it travels (its own for dense tensors, contiguous otherwise)."""
    dtype: torch.dtype
    device: str
    """Device type on the sender: ``"cpu"``, ``"cuda"``, ``"meta"``; the receiver maps it to its own."""
    requires_grad: bool
    parameter: bool
    """The sender's tensor was an ``nn.Parameter``; the receiver rebuilds one."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    nbytes: int = field(init=False, compare=False, repr=False)
    """Bytes of payload on the wire (0 for empty and meta tensors); computed once, read per message."""
    flags: int = field(init=False, compare=False, repr=False)
    """requires_grad | parameter << 1: zero for a plain tensor, which needs no finishing."""
    wire: tuple[Any, ...] = field(init=False, compare=False, repr=False)
    """The wire form (`to_wire`), built once: metadata objects are cached and reused per message."""

    def __post_init__(self) -> None:
        nbytes = 0 if self.device == "meta" else math.prod(self.shape) * self.dtype.itemsize
        object.__setattr__(self, "nbytes", nbytes)
        flags = int(self.requires_grad) | (int(self.parameter) << 1)
        object.__setattr__(self, "flags", flags)
        name = _DTYPE_NAMES.get(self.dtype) or str(self.dtype).removeprefix("torch.")
        object.__setattr__(self, "wire", (self.shape, self.stride, name, self.device, flags))

    def to_wire(self) -> tuple[Any, ...]:
        return self.wire

    @classmethod
    def from_wire(cls, raw: Sequence[Any]) -> TensorMeta:
        if type(raw) is tuple and cls is TensorMeta:
            try:
                cached = _FROM_WIRE.get(raw)
            except TypeError:  # something unhashable inside: parse it below (and fail there if bad)
                cached = None
            if cached is not None:
                return cached
            meta = cls._parse(raw)
            if len(_FROM_WIRE) >= _FROM_WIRE_MAX:
                _FROM_WIRE.clear()
            _FROM_WIRE[raw] = meta
            return meta
        return cls._parse(raw)

    @classmethod
    def _parse(cls, raw: Sequence[Any]) -> TensorMeta:
        shape, stride, dtype_name, device, flags = raw
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"unknown dtype {dtype_name!r} (the sender's torch has it, this one does not)")
        return cls(tuple(shape), tuple(stride), dtype, device, bool(flags & 1), bool(flags & 2))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def is_dense(t: torch.Tensor) -> bool:
    """True when the tensor's elements fill one gap-free, non-overlapping block of memory."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _stubbed(obj: object) -> bool:
    # Strided plain tensors and Parameters travel as payloads; other layouts (sparse, quantized) and
    # tensor subclasses keep their own pickling.
    if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
        return False
    assert isinstance(obj, torch.Tensor)
    return obj.layout == torch.strided


def _wire_tensor(t: torch.Tensor) -> torch.Tensor:
    # Detaching builds a new tensor object: only needed to leave autograd (or the Parameter type) behind.
    w = t.detach() if t.requires_grad or type(t) is not torch.Tensor else t
    if w.is_conj():
        w = w.resolve_conj()
    if w.is_neg():
        w = w.resolve_neg()
    if w.numel() == 0:
        return torch.empty(w.shape, dtype=w.dtype, device=w.device)
    if not is_dense(w):
        w = w.contiguous()
    return w


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The dense memory of `t` as a flat uint8 tensor, without a copy (`t` must be dense)."""
    if t.is_contiguous():
        if t.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=t.device)
        return t.view(-1).view(torch.uint8)
    assert is_dense(t), "byte_view needs a dense tensor"
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def numpy_bytes(t: torch.Tensor) -> Any:
    """A writable numpy uint8 array over a dense CPU tensor's memory (no copy), for buffer APIs."""
    return byte_view(t).numpy()


class _StubPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.file = file
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def reset(self) -> None:
        """Forget the last object (its memo, its tensors, its bytes), to pickle the next one."""
        self.clear_memo()
        self.tensors = []
        self._index = {}
        self.file.seek(0)
        self.file.truncate()

    def dump_stubbed(self, obj: object) -> bytes:
        self.dump(obj)
        body = self.file.getvalue()
        self.reset()
        return body

    # A reducer_override, not a persistent_id: pickle consults persistent_id for every object it meets,
    # ints and strings included, but reducer_override only for objects of other types. A pipeline
    # request (a few dataclasses around tuples, ints and strings) encoded in 16.5 µs instead of 24.6.
    def reducer_override(self, obj: object) -> Any:
        if not _stubbed(obj):
            return NotImplemented
        assert isinstance(obj, torch.Tensor)
        key = id(obj)
        index = self._index.get(key)
        if index is None:  # the same tensor twice travels once and arrives as one object
            index = self._index[key] = len(self.tensors)
            self.tensors.append(obj)
        return _tensor_stub, (index,)


_DECODING = threading.local()  # per thread: the received tensors the stubs of the body being decoded name


def _tensor_stub(index: int) -> torch.Tensor:
    """What a tensor's stub unpickles to: the received tensor it names (only inside `decode_object`)."""
    tensors: Sequence[torch.Tensor] = getattr(_DECODING, "tensors", ())
    if not isinstance(index, int) or not 0 <= index < len(tensors):
        raise pickle.UnpicklingError(f"tensor stub {index!r} does not name one of {len(tensors)} tensors")
    return tensors[index]


def encode_object(obj: object) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle `obj` with its tensors replaced by stubs; returns the bytes and the tensors in stub order.

    Raises MessageEncodeError (at once, in the caller's thread) when something in `obj` cannot be
    pickled; the message names the type of the object and pickle's reason.
    """
    if type(obj) is torch.Tensor and obj.layout == torch.strided:
        return _LONE_BODY, [obj]  # the most common message: its body is always the same stub
    # Each thread reuses one pickler (creating one costs as much as pickling a small message). It is
    # taken out while in use, so that an object whose pickling sends a message gets a fresh one.
    pickler: _StubPickler | None = _LOCAL.__dict__.pop("pickler", None)
    if pickler is None:
        pickler = _StubPickler(io.BytesIO())
    try:
        pickler.dump(obj)
    except Exception as exc:
        raise MessageEncodeError(
            f"cannot send an object of type {type(obj).__name__}: {type(exc).__name__}: {exc}. Messages "
            "must be picklable apart from their tensors; replace the offending value (a lambda, a "
            "lock, an open file, a generator) by plain data."
        ) from exc
    body, tensors = pickler.file.getvalue(), pickler.tensors
    pickler.reset()
    _LOCAL.pickler = pickler
    return body, tensors


def wire_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[TensorMeta]]:
    """The tensors as they travel (detached and dense: views when already dense), and their metadata."""
    wires: list[torch.Tensor] = []
    metas: list[TensorMeta] = []
    for t in tensors:
        w = _wire_tensor(t)
        wires.append(w)
        stride = tuple(w.stride()) if w.numel() else _contiguous_strides(w.shape)
        # `type(t) is ...` first: isinstance on Parameter goes through its metaclass (slow).
        parameter = type(t) is torch.nn.Parameter or (
            type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter)
        )
        key = (
            tuple(w.shape),
            stride,
            w.dtype,
            "cpu" if w.is_cpu else w.device.type,
            t.requires_grad,
            parameter,
        )
        meta = _TO_WIRE.get(key)
        if meta is None:
            if len(_TO_WIRE) >= _FROM_WIRE_MAX:
                _TO_WIRE.clear()
            meta = _TO_WIRE[key] = TensorMeta(*key)
        metas.append(meta)
    return wires, metas


def decode_object(body: bytes, tensors: Sequence[torch.Tensor]) -> object:
    """Unpickle a message body, resolving the stubs to the received tensors (may raise anything)."""
    if len(tensors) == 1 and body == _LONE_BODY:
        return tensors[0]
    outer = getattr(_DECODING, "tensors", ())  # an object whose unpickling decodes another message
    _DECODING.tensors = tensors
    try:
        return pickle.loads(body)
    finally:
        _DECODING.tensors = outer


#: Maps a tensor's metadata to the device it is allocated on at the receiver.
DeviceMap: TypeAlias = Callable[[TensorMeta], torch.device]


def default_device_map(meta: TensorMeta) -> torch.device:
    """CPU stays CPU, meta stays meta; a CUDA tensor lands on this rank's current CUDA device.

    On a rank without CUDA, CUDA tensors arrive on the CPU.
    """
    if meta.device == "cuda":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return _CPU
    if meta.device == "meta":
        return _META
    return _CPU


def allocate(
    metas: Sequence[TensorMeta], device_map: DeviceMap = default_device_map, pool: HostPool | None = None
) -> list[torch.Tensor]:
    """Empty destination tensors for the metadata, with the sender's shapes, strides and dtypes.

    CPU tensors come from `pool` when one is given (recycled memory: no page faults on large ones).
    """
    out: list[torch.Tensor] = []
    default = device_map is default_device_map
    for m in metas:
        device = _CPU if default and m.device == "cpu" else device_map(m)
        if pool is not None and device.type == "cpu":
            nbytes = _storage_bytes(m)
            if nbytes >= pool.min_bytes:  # the pool does not keep smaller buffers
                out.append(pool.tensor(m.shape, m.stride, m.dtype, nbytes))
                continue
        out.append(torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=device))
    return out


def _storage_bytes(m: TensorMeta) -> int:
    # A dense layout spans exactly numel elements; an empty tensor needs no storage.
    return math.prod(m.shape) * m.dtype.itemsize


def finish_tensors(tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Apply requires_grad and Parameter-ness after the payloads have landed."""
    if not any(m.flags for m in metas):
        return tensors if isinstance(tensors, list) else list(tensors)
    out: list[torch.Tensor] = []
    for t, m in zip(tensors, metas, strict=True):
        if m.parameter:
            out.append(torch.nn.Parameter(t, requires_grad=m.requires_grad))
        else:
            out.append(t.requires_grad_(m.requires_grad) if m.requires_grad else t)
    return out


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


# The body of a message that is one tensor and nothing else, as the stub pickler writes it.
_LONE_BODY: Final = _StubPickler(io.BytesIO()).dump_stubbed(torch.empty(0))
