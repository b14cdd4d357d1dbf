"""Position information inside attention: rotary embeddings, ALiBi biases and sliding-window masks.

These are smp's ``rotary_dim`` / ``rotary_emb_base`` / ``gpt_neox_type_rotary``, ``use_alibi`` /
``alibi_bias_max`` and ``window_size`` options of the transformer modules, written from their
definitions; the tests compare them with the Hugging Face models that use them (GPT-J and GPT-NeoX
rotary, MPT/Bloom ALiBi, GPT-Neo local attention).

- Rotary (Su et al., RoFormer): channel pairs of every query and key head are rotated by the angle
  ``position * base**(-2i/rotary_dim)``. GPT-J pairs neighbouring channels ``(2i, 2i+1)``; GPT-NeoX (and
  Llama) pairs channel ``i`` with ``i + rotary_dim/2``. Only the first ``rotary_dim`` channels of a head
  rotate. Positions are ``0..S-1``, as in smp.
- ALiBi (Press et al.): score ``(i, j)`` of head ``h`` gets ``slope_h * (j - i)``; the slopes are MPT's
  (``2**(-alibi_bias_max * k / n)``, ``k = 1..n`` over the next power of two ``n`` of the head count,
  interleaved when the count is not a power of two), which for a power of two are Bloom's. A tensor
  parallel rank adds the slopes of its own heads.
- Sliding window (GPT-Neo's local attention): query ``i`` sees keys ``j`` with ``0 <= i - j < window``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["alibi_bias", "alibi_slopes", "apply_rotary", "keep_mask", "rotary_tables"]

DEFAULT_ROTARY_BASE = 10000.0


def rotary_tables(
    seq: int, dim: int, base: float | None, neox: bool, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``[seq, dim]`` in fp32, laid out for :func:`apply_rotary`'s pairing."""
    base = DEFAULT_ROTARY_BASE if base is None else base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    angles = torch.arange(seq, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    # GPT-NeoX pairs channel i with i + dim/2, GPT-J channel 2i with 2i+1
    angles = torch.cat((angles, angles), dim=-1) if neox else angles.repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, neox: bool) -> Tensor:
    if neox:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, neox: bool) -> Tensor:
    """``x [N, S, heads, d]`` with its first ``cos.shape[-1]`` channels of every head rotated."""
    dim = cos.shape[-1]
    c, s = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    rot = x[..., :dim]
    rot = rot * c + _rotate(rot, neox) * s
    return rot if dim == x.shape[-1] else torch.cat((rot, x[..., dim:]), dim=-1)


def alibi_slopes(heads: int, bias_max: float = 8.0) -> Tensor:
    """The ALiBi slope of each of ``heads`` heads (fp32)."""
    n = 2 ** math.ceil(math.log2(heads))
    m = torch.arange(1, n + 1, dtype=torch.float32) * (bias_max / n)
    slopes = 1.0 / torch.pow(2.0, m)
    if n != heads:
        slopes = torch.cat((slopes[1::2], slopes[::2]))[:heads]
    return slopes


def alibi_bias(slopes: Tensor, sq: int, sk: int, dtype: torch.dtype) -> Tensor:
    """``[heads, sq, sk]``: ``slope * (j - i)``, the last query aligned with the last key."""
    i = torch.arange(sk - sq, sk, device=slopes.device)[:, None]
    j = torch.arange(sk, device=slopes.device)[None, :]
    return (slopes[:, None, None] * (j - i).to(torch.float32)).to(dtype)


def keep_mask(sq: int, sk: int, window: int | None, device: torch.device) -> Tensor:
    """``[sq, sk]`` bool, True where the causal (and, with ``window``, local) mask lets a query see a key;
    the last query is aligned with the last key."""
    gap = torch.arange(sk - sq, sk, device=device)[:, None] - torch.arange(sk, device=device)[None, :]
    keep = gap >= 0
    return keep if window is None else keep & (gap < window)
