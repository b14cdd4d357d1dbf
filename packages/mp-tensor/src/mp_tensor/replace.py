"""Replacing modules by their distributed implementations (docs/tensor.md), called by ``DistributedModel``.

A module is replaced if and only if (1) a distributed implementation is registered for its class, (2)
tensor parallelism is enabled for it (its mark), (3) no ancestor was replaced, and (4) it shares no
parameter with a module outside its own subtree. A module that meets (1)-(3) but not (4), or whose
sizes the TP degree does not divide, is left alone and a log line says why. The original weights are
copied into the shards; every replacement remembers how to translate its gathered state dict back to
the original module's layout (:mod:`mp_tensor.state_dict`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import mp_tensor.builtin  # noqa: F401  (registers the built-in mappings)
from mp_tensor.context import TPContext, use_context
from mp_tensor.enable import mark_of
from mp_tensor.errors import MPTensorError
from mp_tensor.nn.base import DistributedModule, param_spec
from mp_tensor.registry import (
    INIT_ARGS_ATTR,
    REGISTRATION_ATTR,
    Registration,
    Registry,
    default_registry,
)

__all__ = ["ORIGINAL_ATTR", "Replacement", "default_dtype", "replace_modules"]

log = logging.getLogger(__name__)

ORIGINAL_ATTR = "_mp_tp_original"


class Replacement:
    """What a replaced module was: its class name and its registration (for the state-dict translation)."""

    def __init__(self, original_cls: str, registration: Registration) -> None:
        self.original_cls = original_cls
        self.registration = registration

    def to_original(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        fn = self.registration.to_original
        return dict(state_dict) if fn is None else fn(state_dict)

    def from_original(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        fn = self.registration.from_original
        return dict(state_dict) if fn is None else fn(state_dict)


def _owners(model: nn.Module) -> dict[int, set[str]]:
    """For each parameter (by id), the paths of the modules that register it directly."""
    owners: dict[int, set[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(path)
    return owners


def _shared_with(path: str, module: nn.Module, owners: dict[int, set[str]]) -> str | None:
    prefix = f"{path}." if path else ""
    for name, p in module.named_parameters(remove_duplicate=False):
        outside = sorted(o for o in owners.get(id(p), ()) if o != path and not o.startswith(prefix))
        if outside:
            return f"its parameter {name!r} is shared with {outside[0]!r}"
    return None


def _accepted(cls: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params and k != "self"}


def _full_shapes(module: DistributedModule) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    specs = {name: param_spec(p) for name, p in module.named_parameters()}
    for name, value in module.state_dict().items():
        shape = list(value.shape)
        spec = specs.get(name)
        if spec is not None and spec.split_dim is not None:
            shape[spec.split_dim] *= module.tp.size
        shapes[name] = tuple(shape)
    return shapes


def _build_registered(
    reg: Registration, module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]
) -> DistributedModule:
    recorded = module.__dict__.get(INIT_ARGS_ATTR)
    assert recorded is not None
    args, kwargs = recorded
    if reg.init_hook is not None:
        hooked = reg.init_hook(*args, **kwargs)
        if not (isinstance(hooked, tuple) and len(hooked) == 2 and isinstance(hooked[1], Mapping)):
            raise MPTensorError(
                f"the init_hook of {reg.name} returned {hooked!r}; it must return (args, kwargs): an "
                "iterable of positional arguments and a dict of keyword arguments."
            )
        args, kwargs = tuple(hooked[0]), dict(hooked[1])
    kwargs = {**kwargs, **_accepted(reg.dist_cls, overrides)}
    with use_context(ctx):
        new = reg.dist_cls(*args, **kwargs)
    original = {k: v for k, v in module.state_dict().items()}
    if reg.from_original is not None:
        original = reg.from_original(original)
    expected = _full_shapes(new)
    got = {k: tuple(v.shape) for k, v in original.items()}
    if got == expected:
        new.load_full_state_dict(original)
    else:
        missing = sorted(set(expected) - set(got))[:3]
        log.warning(
            "%s: the weights of the original %s were not copied into %s: its state dict does not have the "
            "reference layout (e.g. missing %s); pass translate_functions to tp_register_with_module",
            reg.name, type(module).__name__, reg.dist_cls.__name__, missing,
        )  # fmt: skip
    if reg.forward_hook is not None or reg.return_hook is not None:
        new.set_call_hooks(reg.forward_hook, reg.return_hook)
    return new


def _why_not(reg: Registration, module: nn.Module, ctx: TPContext) -> str | None:
    if reg.builder is None and INIT_ARGS_ATTR not in module.__dict__:
        return (
            f"it was created before {reg.name} was registered, so its constructor arguments are unknown; "
            "register the class before building the model"
        )
    if reg.check is not None:
        return reg.check(module, ctx.size)
    return None


def _children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    yield from list(module.named_children())


def replace_modules(
    model: nn.Module, ctx: TPContext, *, registry: Registry | None = None, default_enabled: bool = False
) -> nn.Module:
    """Replace the marked, distributable modules of ``model`` in place; returns the (possibly new) root.

    Collective over the TP group only in that every rank must build the same replacements (they copy
    weights, they do not communicate). ``default_enabled``: treat unmarked modules as enabled.
    """
    reg_table = registry or default_registry
    owners = _owners(model)
    done: list[str] = []

    def visit(path: str, module: nn.Module) -> nn.Module:
        if isinstance(module, DistributedModule):
            return module
        mark = mark_of(module)
        enabled = mark.enabled if mark is not None else default_enabled
        reg = reg_table.lookup(module) if enabled else None
        if reg is not None:
            label = path or "<root>"
            reason = _shared_with(path, module, owners) or _why_not(reg, module, ctx)
            if reason is None:
                try:
                    new = _replace_one(reg, module, ctx, {} if mark is None else mark.kwargs)
                except MPTensorError as exc:
                    if isinstance(exc, ValueError):
                        reason = str(exc)
                    else:
                        raise
                else:
                    log.info(
                        "tensor parallelism: %s (%s) -> %s", label, type(module).__name__, type(new).__name__
                    )
                    done.append(label)
                    return new
            log.info("tensor parallelism: not distributing %s (%s): %s", label, type(module).__name__, reason)
        for name, child in _children(module):
            new_child = visit(f"{path}.{name}" if path else name, child)
            if new_child is not child:
                setattr(module, name, new_child)
        return module

    root = visit("", model)
    log.info("tensor parallelism over %d ranks: replaced %d modules", ctx.size, len(done))
    return root


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside (None: left as it is), restored on the way out."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def _replace_one(
    reg: Registration, module: nn.Module, ctx: TPContext, overrides: Mapping[str, Any]
) -> DistributedModule:
    # The distributed module keeps the original's precision (a model built in bfloat16, or under
    # smp.model_creation(dtype=...)), unless the config asks for fp16 parameters: its parameters are
    # created in that dtype, before the original's values are copied in (no rounding on the way).
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    with default_dtype(dtype if ctx.dtype is None else None):
        if reg.builder is not None:
            new = reg.builder(module, ctx, overrides)
        else:
            new = _build_registered(reg, module, ctx, overrides)
    new.train(module.training)
    device = next((p.device for p in module.parameters()), None)
    if device is not None and device.type not in ("cpu", "meta"):  # meta: delayed init materializes later
        new.to(device)
    # a builder may hand over translations bound to this model's sizes (GPT-NeoX's head count)
    reg = new.__dict__.pop(REGISTRATION_ATTR, reg)
    new.__dict__[ORIGINAL_ATTR] = Replacement(type(module).__name__, reg)
    return new
