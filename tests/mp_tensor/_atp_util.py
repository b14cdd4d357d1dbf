"""Helpers shared by the ATP tests: compare tensors, naming the first one that differs."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def assert_same(name: str, actual: Tensor | None, expected: Tensor | None, *, exact: bool = False) -> None:
    """``actual`` equals ``expected`` (bitwise with ``exact``, else to float64 round-off); names ``name``."""
    assert actual is not None and expected is not None, (
        f"{name}: missing ({actual is None}, {expected is None})"
    )
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if exact:
        if not torch.equal(actual, expected):
            diff = (actual - expected).abs().max().item()
            raise AssertionError(f"{name}: not bitwise equal (max abs diff {diff:.3g})")
        return
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def assert_all_same(
    actual: Mapping[str, Tensor | None], expected: Mapping[str, Tensor | None], *, exact: bool = False
) -> None:
    """Every named tensor equal; the first that differs is named (in ``expected``'s order)."""
    assert set(actual) == set(expected), f"names differ: {sorted(actual)} vs {sorted(expected)}"
    for name in expected:
        assert_same(name, actual[name], expected[name], exact=exact)
