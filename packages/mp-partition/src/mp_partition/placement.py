"""Where a partitioned model lives: the pipeline degree and this rank's stage, the module -> pp_rank
assignment, and which of a model's tensors this rank holds.

One `Placement` describes a model before partitioning (``partitioned=False``: every module on pp_rank 0,
every tensor local) and another, built once, after it. The code that saves, loads, checkpoints,
recomputes or casts a partitioned model receives it instead of asking the model:

    placement = Placement(pp_size=2, pp_rank=1, assignment={"": 0, "layers.1": 1}, partitioned=True)
    placement.owner("layers.1.weight")       # 1: the pp_rank holding a parameter, buffer or state key
    placement.free_remote(model)             # other stages' tensors become shape-only placeholders
    placement.is_local(model.layers[0].weight)  # False on pp_rank 1
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PLACEHOLDER_ATTR", "Placement", "module_path"]

PLACEHOLDER_ATTR = "_mp_remote_placeholder"
"""The attribute `Placement.free_remote` sets on a tensor another stage holds."""


def module_path(key: str) -> str:
    """The module path of a parameter, buffer or state-dict key (``"a.b.weight"`` -> ``"a.b"``)."""
    return key.rsplit(".", 1)[0] if "." in key else ""


def _no_check(what: str) -> None:
    """The collective entry without a pipeline: nothing to wait for."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The partition of one model as seen from one rank (frozen: a new partition is a new object)."""

    pp_size: int
    """The pipeline-parallel degree."""
    pp_rank: int
    """This rank's pipeline stage."""
    assignment: Mapping[str, int] = field(default_factory=dict)
    """Module path -> pp_rank; a module not listed belongs to its closest listed ancestor (pp_rank 0 if
    none is listed). Empty before partitioning."""
    partitioned: bool = False
    """Whether the assignment is in force (each rank then holds only its own modules' tensors)."""
    pp_group: dist.ProcessGroup | None = None
    """The process group of this rank's pipeline (None without one)."""
    enter: Callable[[str], None] = _no_check
    """The collective entry: called with a description (``"model.state_dict()"``) before a collective
    over the pipeline between steps, it raises a clear error when a stage does not come, not a hang."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignment", MappingProxyType(dict(self.assignment)))

    @property
    def pipelined(self) -> bool:
        """Whether the model is split over several stages now (partitioned, pp_size > 1)."""
        return self.partitioned and self.pp_size > 1

    def module_owner(self, path: str) -> int:
        """The pp_rank that runs the module at ``path`` ("" is the root)."""
        if not self.assignment:
            return 0
        while path not in self.assignment and path:
            path = module_path(path)
        return self.assignment.get(path, 0)

    def owner(self, key: str) -> int:
        """The pp_rank holding a parameter, buffer or state-dict entry named ``key``."""
        return self.module_owner(module_path(key))

    def holds(self, key: str) -> bool:
        """Whether this rank holds the entry ``key``: always before partitioning or without a pipeline."""
        return not self.pipelined or self.owner(key) == self.pp_rank

    @staticmethod
    def is_local(t: torch.Tensor) -> bool:
        """Whether this rank holds the tensor's values (not a placeholder of another stage's)."""
        return not getattr(t, PLACEHOLDER_ATTR, False)

    def local_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters of ``module`` that this rank holds."""
        return [p for p in module.parameters() if self.is_local(p)]

    def local_named_modules(self, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """(path, module) for the modules this stage runs."""
        return ((n, m) for n, m in module.named_modules() if self.module_owner(n) == self.pp_rank)

    def free_remote(self, module: nn.Module) -> None:
        """Turn every parameter and buffer of ``module`` that another stage owns into a placeholder: the
        tensor object stays (an optimizer may hold it) with its shape, its memory is dropped."""
        tensors: Iterator[tuple[str, torch.Tensor]] = iter(
            [*module.named_parameters(), *module.named_buffers()]
        )
        for name, t in tensors:
            if self.owner(name) != self.pp_rank:
                t.data = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
                setattr(t, PLACEHOLDER_ATTR, True)
                if isinstance(t, nn.Parameter):
                    t.grad = None
