"""Messages the mp_comm transport tests send: a sample of every dtype, a structured payload with views,
a dataclass and an object that fails to unpickle, and bit-exact comparison."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True

    def raw(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)

    return torch.equal(raw(a), raw(b))


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: Any
    note: str = "x"


def explode() -> None:
    raise ValueError("cannot rebuild this here")


class BoomOnLoad:
    def __reduce__(self) -> Any:
        return (explode, ())


def rich_payload(rank: int) -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) + rank
    return {
        "dtypes": [sample_tensor(dt, (3, 5), seed=rank) for dt in ALL_DTYPES],
        "views": (base.transpose(0, 2), base[:, ::2], base.expand(2, 2, 3, 4)),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5 + rank),
        "big": torch.randn(1 << 20, generator=torch.Generator().manual_seed(rank)),  # 4 MB
        "pair": Pair(torch.eye(3), [None, 1, "two"]),
        "param": torch.nn.Parameter(torch.ones(2)),
    }


def same_message(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bitwise_equal(a.detach(), b.detach())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_message(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_message(a[k], b[k]) for k in a)
    if isinstance(a, Pair):
        return same_message(a.left, b.left) and a.right == b.right
    return bool(a == b)
