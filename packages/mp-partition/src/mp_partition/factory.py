"""Models given as ``package.module:factory`` for the standalone tool."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import PartitionError

__all__ = ["FactoryModel", "load_factory"]


@dataclass(frozen=True)
class FactoryModel:
    """A model made by a user factory, with the example inputs it returned (if any)."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def load_factory(
    spec: str, factory_kwargs: Mapping[str, Any] | None = None, *, device: str | torch.device | None = None
) -> FactoryModel:
    """Calls the factory named by ``spec`` (``package.module:function``, or ``...:Class``).

    The factory returns a module, or ``(module, args)``, or ``(module, args, kwargs)`` where ``args`` and
    ``kwargs`` are example inputs for tracing. With ``device`` the factory runs under
    ``torch.device(device)`` (``"meta"`` builds any size without allocating it).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PartitionError(f"model factory {spec!r} is invalid: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PartitionError(
            f"cannot import {module_name!r} for model factory {spec!r} ({exc}): expected an importable "
            "module; run from the directory that holds it or add it to PYTHONPATH"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise PartitionError(f"{module_name!r} has no attribute {attr!r} (model factory {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise PartitionError(f"model factory {spec!r} is a {type(target).__name__}: expected a callable")
    kwargs = dict(factory_kwargs or {})
    if device is not None:
        with torch.device(device):
            made = target(**kwargs)
    else:
        made = target(**kwargs)
    return _normalize(spec, made)


def _normalize(spec: str, made: object) -> FactoryModel:
    if isinstance(made, nn.Module):
        return FactoryModel(made)
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Module) and len(made) in (2, 3):
        args = made[1]
        if isinstance(args, torch.Tensor):
            args = (args,)
        if not isinstance(args, Sequence):
            raise PartitionError(
                f"model factory {spec!r} returned args of type {type(args).__name__}: expected a tuple"
            )
        kwargs = made[2] if len(made) == 3 else {}
        if not isinstance(kwargs, Mapping):
            raise PartitionError(
                f"model factory {spec!r} returned kwargs of type {type(kwargs).__name__}: expected a dict"
            )
        return FactoryModel(made[0], tuple(args), dict(kwargs))
    raise PartitionError(
        f"model factory {spec!r} returned {type(made).__name__}: expected an nn.Module, (module, args) or "
        "(module, args, kwargs)"
    )
