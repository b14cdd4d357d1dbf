"""Splitting step inputs into microbatches (smp's rules; docs/pipeline.md).

Every tensor found in the arguments, also inside lists, tuples, dicts and sets, is split along axis 0
(or ``input_split_axes[name]``) into ``n`` equal contiguous slices; microbatch ``mb`` gets
``t.narrow(axis, mb * s, s)`` with ``s = t.shape[axis] // n``. An object with a method
``smp_slice(num_mb, mb, axis)`` is split by that method. Arguments named in ``non_split_inputs`` and
all other objects (numbers, strings, modules, 0-dim tensors) are passed whole to every microbatch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mp_pipeline.errors import SplitError

__all__ = ["SplitSpec", "split_arguments"]


@dataclass(frozen=True)
class SplitSpec:
    """How the arguments of one step function are split; validated against its signature."""

    signature: inspect.Signature | None
    non_split_inputs: frozenset[str] = frozenset()
    input_split_axes: Mapping[str, int] | None = None

    @classmethod
    def for_function(
        cls,
        func: Callable[..., Any],
        non_split_inputs: Sequence[str] | None = None,
        input_split_axes: Mapping[str, int] | None = None,
    ) -> SplitSpec:
        name = getattr(func, "__qualname__", repr(func))
        if non_split_inputs is not None and not isinstance(non_split_inputs, list | tuple):
            raise SplitError(
                f"non_split_inputs={non_split_inputs!r} for step function {name}: expected a list of "
                "argument names, e.g. non_split_inputs=['mask']"
            )
        if input_split_axes is not None and not isinstance(input_split_axes, dict):
            raise SplitError(
                f"input_split_axes={input_split_axes!r} for step function {name}: expected a dict from "
                "argument name to axis, e.g. input_split_axes={'x': 1}"
            )
        try:
            sig: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            params = sig.parameters
            has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            named = list(non_split_inputs or []) + list((input_split_axes or {}).keys())
            for arg in named:
                if arg not in params and not has_var_kw:
                    raise SplitError(
                        f"{arg!r} is named in non_split_inputs/input_split_axes of step function {name}, "
                        f"which has no such argument; its arguments are {list(params)}. Fix the name."
                    )
        for arg, axis in (input_split_axes or {}).items():
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise SplitError(f"input_split_axes[{arg!r}]={axis!r}: expected an int axis")
        return cls(sig, frozenset(non_split_inputs or ()), dict(input_split_axes or {}))


def _split_value(value: Any, n: int, axis: int, where: str) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value] * n
        ax = axis if axis >= 0 else axis + value.dim()
        if not 0 <= ax < value.dim():
            raise SplitError(
                f"cannot split {where} (shape {list(value.shape)}) along axis {axis}: it has {value.dim()} "
                "dimension(s). Fix: set input_split_axes for it, or list it in non_split_inputs."
            )
        size = value.shape[ax]
        if size % n != 0:
            raise SplitError(
                "Batch size must be divisible by the number of microbatches. Found batch size="
                f"{size}, number of microbatches={n} for {where} (shape {list(value.shape)}, axis {ax}). "
                "Fix: make every batch (the last one too) a multiple of the microbatches, e.g. "
                "DataLoader(..., drop_last=True); or list the argument in non_split_inputs if it has no "
                "batch dimension; or set input_split_axes if its batch dimension is not 0."
            )
        step = size // n
        return [value.narrow(ax, i * step, step) for i in range(n)]
    smp_slice = getattr(value, "smp_slice", None)
    if callable(smp_slice) and not isinstance(value, type):
        return [smp_slice(n, i, axis) for i in range(n)]
    if isinstance(value, list | tuple):
        parts = [_split_value(v, n, axis, f"{where}[{i}]") for i, v in enumerate(value)]
        out: list[Any] = []
        for mb in range(n):
            items = [p[mb] for p in parts]
            if isinstance(value, list):
                out.append(items)
            elif hasattr(value, "_fields"):
                out.append(type(value)(*items))
            else:
                out.append(tuple(items))
        return out
    if isinstance(value, dict):
        keyed = {k: _split_value(v, n, axis, f"{where}[{k!r}]") for k, v in value.items()}
        result = []
        for mb in range(n):
            d = type(value)() if type(value) is not dict else {}
            try:
                for k, parts_k in keyed.items():
                    d[k] = parts_k[mb]
            except Exception:
                d = {k: parts_k[mb] for k, parts_k in keyed.items()}
            result.append(d)
        return result
    if isinstance(value, set | frozenset):
        members = [_split_value(v, n, axis, f"{where} member") for v in value]
        return [type(value)(m[mb] for m in members) for mb in range(n)]
    return [value] * n


def split_arguments(
    spec: SplitSpec, args: tuple[Any, ...], kwargs: dict[str, Any], n: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The (args, kwargs) of each of the ``n`` microbatches."""
    if n == 1:
        return [(args, kwargs)]
    axes = spec.input_split_axes or {}
    if spec.signature is None:
        split_pos = [_split_value(a, n, 0, f"argument {i}") for i, a in enumerate(args)]
        split_kw = {
            k: (
                [v] * n
                if k in spec.non_split_inputs
                else _split_value(v, n, axes.get(k, 0), f"argument {k!r}")
            )
            for k, v in kwargs.items()
        }
        return [(tuple(p[mb] for p in split_pos), {k: v[mb] for k, v in split_kw.items()}) for mb in range(n)]
    bound = spec.signature.bind(*args, **kwargs)
    per_name: dict[str, list[Any]] = {}
    for name, value in bound.arguments.items():
        param = spec.signature.parameters[name]
        if name in spec.non_split_inputs:
            per_name[name] = [value] * n
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            parts = {
                k: (
                    [v] * n
                    if k in spec.non_split_inputs
                    else _split_value(v, n, axes.get(k, 0), f"argument {k!r}")
                )
                for k, v in value.items()
            }
            per_name[name] = [{k: p[mb] for k, p in parts.items()} for mb in range(n)]
        else:
            per_name[name] = _split_value(value, n, axes.get(name, 0), f"argument {name!r}")
    out = []
    for mb in range(n):
        b = inspect.BoundArguments(spec.signature, {k: v[mb] for k, v in per_name.items()})
        out.append((tuple(b.args), dict(b.kwargs)))
    return out
