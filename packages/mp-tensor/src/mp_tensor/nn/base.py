"""``DistributedModule``: the base of every tensor-parallel module, and the metadata of its parameters.

Every parameter of a distributed module carries a :class:`ParamSpec`:

- ``split_dim``: the dimension along which the full parameter is split over the TP ranks (tp_rank j
  holds slice j), or None when every TP rank holds the whole parameter;
- ``scaled_batch``: True when the parameter's gradient already sums over the samples of the whole TP
  group (it touched the exchanged batch). Such gradients are reduced over the *reduced* data-parallel
  group; all others over the data-parallel group (see :mod:`mp_tensor.grads`).

:meth:`DistributedModule.full_state_dict` gathers the shards into the layout of the module's
non-distributed reference implementation, and :meth:`DistributedModule.load_full_state_dict` slices
such a state dict into this rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mp_comm.waits import collective_wait
from mp_tensor.context import TPContext, current_context

__all__ = [
    "DistributedModule",
    "ParamInit",
    "ParamSpec",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "param_init",
    "param_spec",
    "set_param_init",
    "set_param_spec",
]

_SPEC_ATTR = "_mp_tp_spec"
_INIT_ATTR = "_mp_tp_init"


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter of a distributed module is laid out over the TP group."""

    split_dim: int | None = None
    scaled_batch: bool = True


def set_param_spec(param: Tensor, spec: ParamSpec) -> None:
    """Attach ``spec`` to ``param``."""
    setattr(param, _SPEC_ATTR, spec)


def param_spec(param: Tensor) -> ParamSpec | None:
    """The spec of a distributed module's parameter, or None for an ordinary parameter."""
    spec = getattr(param, _SPEC_ATTR, None)
    return spec if isinstance(spec, ParamSpec) else None


@dataclass(frozen=True)
class ParamInit:
    """How a distributed module initialized one parameter: this rank's slice of a full ``shape`` tensor
    drawn as ``kind`` (``"normal"``: N(0, ``scale``); ``"uniform"``: U(-``scale``, ``scale``); ``"zero"``),
    with row ``zero_row`` zeroed (an embedding's padding row). Delayed parameter initialization builds the
    module on the meta device and draws the shard again with :meth:`draw` (the same draws as the
    constructor: the same values from the same random state)."""

    shape: tuple[int, ...]
    kind: str
    scale: float
    split_dim: int | None
    rank: int
    size: int
    zero_row: int | None = None

    def draw(self) -> Tensor:
        full = torch.empty(self.shape)
        if self.kind == "normal":
            full.normal_(0.0, self.scale)
        elif self.kind == "uniform":
            full.uniform_(-self.scale, self.scale)
        else:
            full.zero_()
        if self.zero_row is not None:
            full[self.zero_row].zero_()
        if self.split_dim is None or self.size == 1:
            return full
        part = self.shape[self.split_dim] // self.size
        return full.narrow(self.split_dim, self.rank * part, part)


def set_param_init(param: Tensor, init: ParamInit) -> None:
    """Attach ``init`` (how ``param``'s value was drawn) to ``param``."""
    setattr(param, _INIT_ATTR, init)


def param_init(param: Tensor) -> ParamInit | None:
    """How a distributed module's parameter was initialized, or None when it does not say."""
    init = getattr(param, _INIT_ATTR, None)
    return init if isinstance(init, ParamInit) else None


def is_distributed_parameter(param: Tensor) -> bool:
    """True when ``param`` is one shard of a parameter split over the TP ranks."""
    spec = param_spec(param)
    return spec is not None and spec.split_dim is not None


def is_scaled_batch_parameter(param: Tensor) -> bool:
    """True when ``param``'s gradient covers the whole TP group's batch (reduce it over the RDP group)."""
    spec = param_spec(param)
    return spec is not None and spec.scaled_batch


class DistributedModule(nn.Module):
    """Base class of the tensor-parallel modules (smp.nn.DistributedModule).

    ``tp`` is the tensor-parallel context (group, optimize, prescaled_batch, dtype, seed); when omitted,
    the current one (:func:`mp_tensor.context.current_context`) is used.
    """

    def __init__(self, *, tp: TPContext | None = None) -> None:
        super().__init__()
        self.tp = current_context(tp, who=type(self).__name__)

    # ---------------------------------------------------------------- hooks of a registered class

    def set_call_hooks(
        self, forward_hook: Callable[..., Any] | None, return_hook: Callable[..., Any] | None
    ) -> None:
        """Translate each call from the replaced module's signature (``forward_hook`` returns
        ``(args, kwargs)``) and the result back to what it returned (``return_hook``)."""
        self.__dict__["_mp_forward_hook"] = forward_hook
        self.__dict__["_mp_return_hook"] = return_hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward_hook = self.__dict__.get("_mp_forward_hook")
        if forward_hook is not None:
            hooked = forward_hook(*args, **kwargs)
            if not (isinstance(hooked, tuple) and len(hooked) == 2 and isinstance(hooked[1], Mapping)):
                raise TypeError(
                    f"the forward_hook of {type(self).__name__} returned {hooked!r}; it must return "
                    "(args, kwargs): an iterable of positional arguments and a dict of keyword arguments."
                )
            args, kwargs = tuple(hooked[0]), dict(hooked[1])
        out = super().__call__(*args, **kwargs)
        return_hook = self.__dict__.get("_mp_return_hook")
        return out if return_hook is None else return_hook(out)

    # ------------------------------------------------------------------------------ parameter layout

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    def shard(self, full: Tensor, dim: int | None) -> Tensor:
        """This rank's slice of ``full`` along ``dim`` (the whole tensor when ``dim`` is None)."""
        if dim is None or self.tp.size == 1:
            return full
        size = full.shape[dim] // self.tp.size
        return full.narrow(dim, self.tp.rank * size, size)

    def _own_specs(self) -> dict[str, ParamSpec | None]:
        """Spec of every entry of this module's state dict (buffers and plain parameters: None)."""
        specs: dict[str, ParamSpec | None] = {}
        for name, p in self.named_parameters():
            specs[name] = param_spec(p)
        return specs

    @torch.no_grad()
    def full_state_dict(self, keep: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
        """The state dict of the equivalent non-distributed module (collective over the TP group).

        Shards are all-gathered along their split dimension, in a fixed order, so every TP rank must
        call this at the same point. Tied parameters appear under each of their names. ``keep``: only
        the entries it accepts (a pipeline stage's part of a module split over stages).
        """
        specs = self._own_specs()
        out: dict[str, Tensor] = {}
        for name, value in self.state_dict(keep_vars=False).items():
            if keep is not None and not keep(name):
                continue
            spec = specs.get(name)
            if spec is None or spec.split_dim is None or not self.tp.distributed:
                out[name] = value.detach().clone()
                continue
            assert self.tp.group is not None
            dim = spec.split_dim % value.dim()
            parts = [torch.empty_like(value) for _ in range(self.tp.size)]
            with collective_wait("all_gather", self.tp.group):
                dist.all_gather(parts, value.detach().contiguous(), group=self.tp.group)
            out[name] = torch.cat(parts, dim=dim)
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load the state dict of the equivalent non-distributed module: every rank keeps its shards."""
        specs = self._own_specs()
        local: dict[str, Tensor] = {}
        for name, value in state_dict.items():
            spec = specs.get(name)
            local[name] = self.shard(value, None if spec is None else spec.split_dim)
        self.load_state_dict(local, strict=strict)

    def extra_repr(self) -> str:
        return f"tp_size={self.tp.size}, tp_rank={self.tp.rank}"
