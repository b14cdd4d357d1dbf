"""Optimizer-state sharding (ZeRO stage 1) on torch's ``ZeroRedundancyOptimizer``.

Every rank of a data-parallel group keeps the full parameters and gradients, but the optimizer state of
only its share of the parameters: ``ZeroRedundancyOptimizer`` assigns each parameter to one rank
(largest first, to the rank with the least so far), that rank steps it, and the updated parameters are
broadcast to the others. The result is the unsharded optimizer's, with about 1/n of its state per rank.

:class:`ZeroSharding` builds it from an optimizer the user already made: same class, same defaults and
the *same* parameter-group dicts (so an LR scheduler made on the user's optimizer still drives it),
when the caller says the groups are final (after pipeline partitioning dropped the other stages'
parameters).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ZeroSharding", "state_bytes"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state (for ZeRO: this rank's share)."""
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _constructor_defaults(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes (AdamW's hold ``decoupled_weight_decay``, which
    its constructor sets itself); the groups carry every setting anyway."""
    accepted = inspect.signature(type(opt).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(opt.defaults)
    return {k: v for k, v in opt.defaults.items() if k in accepted}


class ZeroSharding:
    """ZeRO-1 for ``optimizer`` over ``group`` (None: the default group), built by :meth:`build`."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None) -> None:
        self.optimizer = optimizer
        self.group = group
        self.zero: ZeroRedundancyOptimizer | None = None

    def build(self) -> ZeroRedundancyOptimizer:
        """The sharded optimizer over the optimizer's current groups (made once). State the user's
        optimizer already holds is dropped: load it into the sharded one (``load_local``)."""
        if self.zero is None:
            opt = self.optimizer
            # a group with no parameters left on this pipeline stage cannot be sharded (nor stepped)
            groups = [g for g in opt.param_groups if g["params"]]
            self.zero = ZeroRedundancyOptimizer(
                groups, optimizer_class=type(opt), process_group=self.group, **_constructor_defaults(opt)
            )
            opt.state.clear()
        return self.zero

    def step(self, closure: Any = None) -> Any:
        return self.build().step(closure)

    def local_params(self) -> list[torch.Tensor]:
        """The parameters whose state this rank keeps, in the local optimizer's order."""
        return [p for g in self.build().optim.param_groups for p in g["params"]]

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's share of the optimizer state (torch's format, numbered over its share)."""
        return dict(self.build().optim.state_dict())

    def load_local(self, sd: dict[str, Any]) -> None:
        self.build().optim.load_state_dict(sd)
