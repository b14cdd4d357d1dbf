"""The message format of the point-to-point transports: tensor stubs, metadata first, payloads apart.

An object to send (any picklable Python value: lists, tuples, dicts, dataclasses, HuggingFace
``ModelOutput``, ``None``, numbers, with tensors nested anywhere) is pickled once with every strided
``torch.Tensor`` in it replaced by a stub (a call naming the tensor's index in the message). The tensors
themselves travel as raw bytes, each described by a :class:`TensorMeta` (shape, strides, dtype, device,
requires_grad), which reaches the receiver in the :class:`Header` before any payload so that it can
allocate the buffers the payloads land in. The receiver unpickles the object with the stubs resolved
to the received tensors (:func:`decode_object`).

The tensors' metadata and layout are in :mod:`mp_comm.message_tensors`, the header and static
mode's metadata cache in :mod:`mp_comm.message_header`; both are re-exported here.
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
from collections.abc import Sequence
from typing import Any, Final

import torch

from mp_comm.errors import MessageEncodeError
from mp_comm.message_header import (
    _PICKLE_PROTOCOL,
    PROTOCOL_VERSION,
    Header,
    MetaCacheReceiver,
    MetaCacheSender,
    Tag,
    decode_header,
    encode_header,
    inline_payloads,
    land_inline,
    pack_header,
)
from mp_comm.message_tensors import (
    DeviceMap,
    TensorMeta,
    allocate,
    byte_view,
    default_device_map,
    finish_tensors,
    is_dense,
    numpy_bytes,
    wire_tensors,
)

__all__ = [  # the tensors' and the header's names too: transports import them from here
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
    "finish_tensors",
    "inline_payloads",
    "is_dense",
    "land_inline",
    "numpy_bytes",
    "pack_header",
    "wire_tensors",
]

log = logging.getLogger(__name__)
_LOCAL = threading.local()  # per thread: a pickler to reuse


def _stubbed(obj: object) -> bool:
    # Strided plain tensors and Parameters travel as payloads; other layouts (sparse, quantized) and
    # tensor subclasses keep their own pickling.
    if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
        return False
    assert isinstance(obj, torch.Tensor)
    return obj.layout == torch.strided


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


# The body of a message that is one tensor and nothing else, as the stub pickler writes it.
_LONE_BODY: Final = _StubPickler(io.BytesIO()).dump_stubbed(torch.empty(0))
