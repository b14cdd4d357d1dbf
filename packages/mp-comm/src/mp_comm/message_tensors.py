"""Tensors on the wire: their metadata (`TensorMeta`), the dense layout they travel in, byte views
of their memory, and the receiver's allocation of the tensors they land in.

Copies: a tensor whose memory is dense (contiguous, or a permutation of a contiguous layout such as
a transpose) travels as its own memory, zero-copy for CPU tensors, and arrives with the same strides.
A view with gaps or overlaps (a slice with a step, an ``expand``) is made contiguous first, and so
arrives contiguous with the same values. Conjugate and negative views are resolved first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import torch

from mp_comm.buffers import HostPool

__all__ = [
    "DeviceMap",
    "TensorMeta",
    "allocate",
    "byte_view",
    "default_device_map",
    "finish_tensors",
    "is_dense",
    "numpy_bytes",
    "wire_tensors",
]

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


def wire_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[TensorMeta]]:
    """The tensors as they travel (detached and dense: views when already dense), and their metadata."""
    wires: list[torch.Tensor] = []
    metas: list[TensorMeta] = []
    for t in tensors:
        w = _wire_tensor(t)
        wires.append(w)
        # _wire_tensor makes empty tensors fresh and contiguous: their strides are their own too
        stride = w.stride()
        # `type(t) is ...` first: isinstance on Parameter goes through its metaclass (slow).
        kind = type(t)
        parameter = kind is torch.nn.Parameter or (
            kind is not torch.Tensor and isinstance(t, torch.nn.Parameter)
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
        # m.nbytes (0 for meta tensors) first: most messages' tensors are too small for the pool
        if pool is not None and m.nbytes >= pool.min_bytes and device.type == "cpu":
            out.append(pool.tensor(m.shape, m.stride, m.dtype, _storage_bytes(m)))
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
