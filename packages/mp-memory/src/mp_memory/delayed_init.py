"""Delayed parameter initialization: build a model without its parameters' memory, then materialize and
initialize only the parameters a rank keeps.

:func:`parameters_on_meta` moves every parameter registered inside it to the meta device (one at a time:
a parameter is created, then replaced, so the peak is one parameter, as in accelerate's
``init_empty_weights``). Buffers stay real: modules compute them in ``__init__`` (a causal mask, rotary
frequencies) and no init method would compute them again. A parameter created constant (zeros, ones)
remembers its value.

:func:`materialize` gives the meta parameters for which ``keep(p)`` holds real storage and initializes
them with each module's own init: ``reset_parameters()``, then the HF model's ``_init_weights(module)``
where the root has one (the order of HF's eager construction), or the remembered constant. A parameter
may bring its own initial value (``own(p)``: a tensor-parallel shard is this rank's slice of a full tensor,
drawn again as its module's constructor drew it); it wins over the module's init, which is skipped when
every new parameter of the module has one. Parameter objects keep their identity and their attributes
(``torch.utils.swap_tensors``), so optimizers built on the meta model work.

The values are not those of eager initialization under the same seed: eager construction draws random
numbers for every module in construction order, this draws them only for the kept modules, in module
order. They follow the same distributions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mp_memory.errors import MemorySaverError

__all__ = ["DelayedInitError", "has_meta_parameters", "materialize", "parameters_on_meta"]

_CONSTANT = "_mp_delayed_constant"


class DelayedInitError(MemorySaverError):
    """A parameter that delayed initialization cannot initialize."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside live on the meta device (see the module docstring)."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            if param.numel() > 0 and param.is_floating_point():
                low, high = param.detach().aminmax()
                if bool(low == high):
                    setattr(meta, _CONSTANT, float(low))
            param = meta
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def materialize(
    root: nn.Module,
    keep: Callable[[nn.Parameter], bool],
    device: torch.device | str = "cpu",
    own: Callable[[nn.Parameter], Callable[[], torch.Tensor] | None] | None = None,
) -> int:
    """Give the kept meta parameters of ``root`` storage on ``device`` and initialize them (module
    docstring). ``own(p)``: what draws ``p``'s own initial value, or None. Returns the number of elements
    materialized (asked only of those not created constant). Parameters not kept stay on meta."""
    hf_init: Any = getattr(root, "_init_weights", None)
    done: set[int] = set()
    by_init: set[int] = set()  # parameters initialized here by their module or as constants, not drawn
    count = 0
    for path, module in root.named_modules():
        fresh: list[tuple[nn.Parameter, float | None]] = []
        for p in module.parameters(recurse=False):
            if p.is_meta and keep(p) and id(p) not in done:
                constant = getattr(p, _CONSTANT, None)  # swap_tensors swaps the attributes too
                real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)  # swapped with the data: p keeps its attributes
                torch.utils.swap_tensors(p, real)  # type: ignore[no-untyped-call]
                done.add(id(p))
                fresh.append((p, constant))
                count += p.numel()
        if not fresh:
            continue
        draws = [None if own is None or c is not None else own(p) for p, c in fresh]
        with torch.no_grad():
            for p, constant in fresh:
                if constant is not None:
                    p.fill_(constant)
            reset = getattr(module, "reset_parameters", None)
            uninitialized = [c is None and d is None for (_, c), d in zip(fresh, draws, strict=True)]
            if any(d is None for d in draws) and callable(reset):
                reset()
            if any(d is None for d in draws) and callable(hf_init):
                hf_init(module)
            elif any(uninitialized) and not callable(reset):
                raise DelayedInitError(
                    f"delayed initialization cannot initialize the parameters of module {path!r} "
                    f"({type(module).__name__}): it has no reset_parameters() and its root model no "
                    "_init_weights(). Fix: give the module a reset_parameters() that initializes its "
                    "parameters, or build the model without delayed initialization"
                )
            for (p, _), draw in zip(fresh, draws, strict=True):
                if draw is not None:
                    p.copy_(draw())  # one full tensor at a time
                else:
                    by_init.add(id(p))
    if callable(hf_init) and by_init:
        _hf_init_parents(root, hf_init, by_init)
    return count


def _hf_init_parents(root: nn.Module, hf_init: Callable[[nn.Module], Any], by_init: set[int]) -> None:
    """HF initializes every module children first (``smart_apply``), and some of its rules act on a
    parent: GPT-2 scales its blocks' ``c_proj`` in ``_init_weights(GPT2Attention | GPT2MLP)``. Run the
    root's ``_init_weights`` on each module without parameters of its own, deepest first, where every
    parameter below was initialized here (not drawn as a shard) or is still on meta (another rank's)."""
    with torch.no_grad():
        for module in reversed(list(root.modules())):
            if next(module.parameters(recurse=False), None) is not None:
                continue
            below = list(module.parameters())
            if any(id(p) in by_init for p in below) and all(id(p) in by_init or p.is_meta for p in below):
                hf_init(module)
