"""The one patch ``smp.DistributedOptimizer`` makes to the user's optimizer: an ordered list of parts.

smp returns the user's own optimizer object (LR schedulers and ``isinstance`` checks need it), given
smp's methods. mp sets those methods once, here (:func:`install`); each one runs the same method of
an ordered list of :class:`OptimizerPart` (outermost first). A part receives ``inner``, the rest of
the list below it: it calls ``inner`` to add to what the parts below do (sharding clips, then steps
through the parts below), or leaves it uncalled to replace it (ZeRO-1 steps its own sharded
optimizer; a refusal raises). The last part is the plain one (torch's methods over this rank's
parameters, ``mp.optimizer``). The list is built in one place, ``mp.optimizer.DistributedOptimizer``.

The installed ``step`` also keeps torch's LR-scheduler protocol: torch's schedulers wrap
``optimizer.step`` to note that it ran (``optimizer._opt_called``) and warn when the wrapper is missing
("``optimizer.step()`` has been overridden") or was not called before ``scheduler.step()``. mp's step
notes the call itself and carries the wrapper's mark, so a scheduler made before or after
``smp.DistributedOptimizer`` sees every step, and a scheduler stepped before the optimizer is still
warned about.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from mp_partition import Placement

if TYPE_CHECKING:
    from mp_memory import ShardedDataParallel

__all__ = [
    "CHAIN_METHODS",
    "ModelView",
    "OptimizerChain",
    "OptimizerPart",
    "chain_of",
    "install",
    "part_of",
]

_ATTR = "_mp_chain"
_LR_MARK = "_wrapped_by_lr_sched"  # torch.optim.lr_scheduler: this step notes its calls
_LR_CALLED = "_opt_called"  # ... on the optimizer, read by the scheduler's first step()

CHAIN_METHODS = ("step", "state_dict", "load_state_dict", "local_state_dict", "clip_master_grads")
"""The optimizer's methods that run through the parts (``local_optimizer_state_dict`` is smp's other
name for ``local_state_dict``)."""

StateDict = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ModelView:
    """What the optimizer's parts know of the model whose parameters they step, bound once by
    ``smp.DistributedOptimizer``: its module, where it lives now, and a way to run something once it
    is partitioned. The parts take the placement from here instead of asking the model."""

    module: nn.Module
    """The user's model (``DistributedModel.module``): the parameter names in state dicts are its own."""
    where: Callable[[], Placement]
    """The model's placement now (it is replaced once, when the first step partitions the model)."""
    after_partition: Callable[[Callable[[], None]], None]
    """``after_partition(fn)`` runs ``fn`` once the model is partitioned (a post-partition hook)."""
    sharding: ShardedDataParallel | None = None
    """The model's sharded data parallelism (``sharded_data_parallel_degree`` > 1), else None."""

    @property
    def placement(self) -> Placement:
        """The model's placement now (mp_partition.Placement)."""
        return self.where()

    def param_names(self) -> dict[int, str]:
        """``id(parameter)`` -> its name in ``module``."""
        return {id(p): n for n, p in self.module.named_parameters()}


class OptimizerPart:
    """One feature of the optimizer. Each method gets ``inner``, the same method of the parts below;
    the defaults pass through. ``name`` shows in errors and ``repr``."""

    name = "part"

    def step(self, inner: Callable[[Any], Any], closure: Any) -> Any:
        return inner(closure)

    def state_dict(self, inner: Callable[[], StateDict]) -> StateDict:
        return inner()

    def local_state_dict(self, inner: Callable[[], StateDict]) -> StateDict:
        return inner()

    def load_state_dict(self, inner: Callable[[StateDict], None], state_dict: StateDict) -> None:
        inner(state_dict)

    def clip_master_grads(
        self, inner: Callable[[float, float], torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return inner(max_norm, norm_type)

    def __repr__(self) -> str:
        return self.name


class OptimizerChain:
    """The parts of one optimizer, outermost first, and the optimizer's own methods as torch has them
    (for torch.distributed.checkpoint, which must call those: :meth:`torch_methods`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, parts: Sequence[OptimizerPart]) -> None:
        self.optimizer = optimizer
        self.parts = tuple(parts)

    def _run(self, method: str, *args: Any) -> Any:
        """``method`` of the first part, with the rest of the parts as its ``inner``."""
        call = _no_inner(method)
        for part in reversed(self.parts):
            call = _bind(getattr(part, method), call)
        return call(*args)

    def step(self, closure: Any = None) -> Any:
        setattr(self.optimizer, _LR_CALLED, True)
        return self._run("step", closure)

    def state_dict(self) -> StateDict:
        result: StateDict = self._run("state_dict")
        return result

    def local_state_dict(self, *args: Any, **kwargs: Any) -> StateDict:
        result: StateDict = self._run("local_state_dict")
        return result

    def load_state_dict(self, state_dict: StateDict) -> None:
        self._run("load_state_dict", state_dict)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        result: torch.Tensor = self._run("clip_master_grads", max_norm, norm_type)
        return result

    @contextlib.contextmanager
    def torch_methods(self) -> Iterator[None]:
        """torch.distributed.checkpoint calls the optimizer's own ``state_dict``/``load_state_dict``/
        ``step``: the installed ones are hidden meanwhile."""
        saved = {k: self.optimizer.__dict__.pop(k) for k in _TORCH_NAMES if k in self.optimizer.__dict__}
        try:
            yield
        finally:
            self.optimizer.__dict__.update(saved)

    def __repr__(self) -> str:
        return f"OptimizerChain({' -> '.join(map(repr, self.parts))})"


_TORCH_NAMES = ("state_dict", "load_state_dict", "step")


def _bind(method: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args: method(inner, *args)


def _no_inner(method: str) -> Callable[..., Any]:
    def missing(*args: Any) -> Any:
        raise AssertionError(f"the optimizer chain's last part does not implement {method}")

    return missing


P = TypeVar("P", bound=OptimizerPart)


def install(optimizer: torch.optim.Optimizer, parts: Sequence[OptimizerPart]) -> OptimizerChain:
    """Set the chain's methods on ``optimizer`` (once: a second call replaces the parts, not the patch)."""
    chain = OptimizerChain(optimizer, parts)
    setattr(optimizer, _ATTR, chain)

    def step(closure: Any = None) -> Any:
        return chain_of(optimizer).step(closure)

    setattr(step, _LR_MARK, True)
    optimizer.step = step  # type: ignore[method-assign]
    methods: dict[str, Callable[..., Any]] = {
        "state_dict": lambda: chain_of(optimizer).state_dict(),
        "load_state_dict": lambda sd: chain_of(optimizer).load_state_dict(sd),
        "local_state_dict": lambda *a, **k: chain_of(optimizer).local_state_dict(*a, **k),
        "local_optimizer_state_dict": lambda *a, **k: chain_of(optimizer).local_state_dict(*a, **k),
        "clip_master_grads": lambda max_norm, norm_type=2.0: chain_of(optimizer).clip_master_grads(
            max_norm, norm_type
        ),
    }
    for name, fn in methods.items():
        setattr(optimizer, name, fn)
    return chain


def chain_of(optimizer: Any) -> OptimizerChain:
    """The chain installed on ``optimizer`` (AssertionError if none: an internal invariant)."""
    chain = getattr(optimizer, _ATTR, None)
    assert isinstance(chain, OptimizerChain), f"no mp optimizer chain on {type(optimizer).__name__}"
    return chain


def part_of(optimizer: Any, kind: type[P]) -> P | None:
    """The part of class ``kind`` in ``optimizer``'s chain (None if absent or no chain)."""
    chain = getattr(optimizer, _ATTR, None)
    if not isinstance(chain, OptimizerChain):
        return None
    return next((p for p in chain.parts if isinstance(p, kind)), None)
