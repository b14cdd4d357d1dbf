"""The UCX transport's wire: 64-bit tags, control messages, and the records of messages in flight.

Tags are 64 bits: kind (2) | source rank (22) | wire counter (24) | tensor index (16). A message is
a header (kind HEADER, matched from any source by a tag probe that removes it: UCX's matched probe)
followed by one DATA message per tensor payload that is not inline; CTRL messages answer the D2D
handshake and a HELLO is the first message on a new endpoint (both in ucx).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from mp_comm.buffers import BufferManager, Region
from mp_comm.message import Header, TensorMeta
from mp_comm.transport.base import Outgoing

__all__ = ["FALLBACK_CHANNEL", "MAX_RANKS", "MAX_TENSORS"]

_HEADER, _DATA, _CTRL, _HELLO = 0, 1, 2, 3
_CTRL_WIRE = struct.Struct("<q")  # a control message: the wire counter, then the decision's letters
_KIND_MASK: Final = 3 << 62
MAX_RANKS: Final = 1 << 22
MAX_TENSORS: Final = (1 << 16) - 1
FALLBACK_CHANNEL: Final = 1
"""The fallback transport's internal channel that carries the payloads the D2D path could not take."""


def _tag(kind: int, source: int, wire: int, index: int = 0) -> int:
    return (kind << 62) | (source << 40) | ((wire & 0xFFFFFF) << 16) | index


def _tag_source(tag: int) -> int:
    return (tag >> 40) & (MAX_RANKS - 1)


def _tag_wire(tag: int) -> int:
    return (tag >> 16) & 0xFFFFFF


@dataclass(slots=True)
class _SendOp:
    out: Outgoing
    modes: bytes
    reqs: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)
    regions: list[tuple[BufferManager, Region]] = field(default_factory=list)
    awaiting: bool = False
    fallback: Any = None  # the fallback transport's SendHandle
    ready: Any = None  # CUDA event the payloads must wait for


@dataclass(slots=True)
class _RecvOp:
    source: int
    header: Header
    metas: tuple[TensorMeta, ...]
    tensors: list[torch.Tensor]
    reqs: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)
    landing: list[tuple[int, BufferManager, Region]] = field(default_factory=list)
    fallback_index: tuple[int, ...] = ()
    waiting_fallback: bool = False
