"""``shard_optimizer_state``: smp's optimizer-state sharding over the reduced data-parallel group,
wired from ``mp_memory.zero`` (torch's ``ZeroRedundancyOptimizer``).

``smp.DistributedOptimizer`` returns the user's optimizer, as always; under ``shard_optimizer_state``
its ``step()`` runs a ``ZeroRedundancyOptimizer`` built (at the first ``step()``, after partitioning)
from its class, defaults and parameter groups over this rank's RDP group (the ranks holding the same
parameters). Each keeps the optimizer state of about 1/rdp_size of the parameters; the gradients are
reduced as without sharding and the stepped parameters are broadcast. LR schedulers made on the
optimizer keep working (the groups are shared).

Checkpoints (as smp's): ``local_state_dict()`` holds this rank's share with the names of its
parameters, and loads under the same layout; ``state_dict()`` (the full state) raises, as in smp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mp.errors import IncompatibleCheckpointFoundError, SMPCheckpointError, SMPValidationError
from mp.optimizer_chain import ModelView, OptimizerPart, part_of
from mp.state import state
from mp_comm import GroupKind
from mp_memory import Header, ZeroSharding, read_header, write_header
from mp_partition import Placement

__all__ = ["ZeroPart", "sharding_of"]


def sharding_of(optimizer: Any) -> ZeroSharding | None:
    """The ZeRO sharding of an optimizer registered under ``shard_optimizer_state`` (else None)."""
    part = part_of(optimizer, ZeroPart)
    return None if part is None else part.sharding


def _ready(sharding: ZeroSharding, placement: Placement, what: str) -> None:
    if sharding.zero is None and placement.pp_size > 1 and not placement.partitioned:
        raise SMPValidationError(
            f"optimizer.{what}() under shard_optimizer_state needs the model partitioned (the state is "
            "sharded over this stage's parameters); call it after the first @smp.step"
        )


def _names(params: list[torch.Tensor], model: ModelView) -> list[str | None]:
    by_id = model.param_names()
    return [by_id.get(id(p)) for p in params]


class ZeroPart(OptimizerPart):
    """ZeRO-1 in the optimizer's chain (module docstring): steps, saves and loads through the ZeRO
    optimizer over the RDP group; never calls the parts below, and refuses the full state. ``model``:
    the model whose parameters it steps (the shards follow its partition)."""

    name = "zero"

    def __init__(self, optimizer: torch.optim.Optimizer, model: ModelView) -> None:
        self.sharding = ZeroSharding(optimizer, state.process_groups.get(GroupKind.RDP))
        self.model = model
        self._pending: list[dict[str, Any]] = []

    def step(self, inner: Callable[[Any], Any], closure: Any) -> Any:
        _ready(self.sharding, self.model.placement, "step")
        if self.sharding.zero is None and self._pending:  # a state loaded before partitioning
            self.sharding.build()
            self._load(self._pending.pop())
        return self.sharding.step(closure)

    def local_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        _ready(self.sharding, self.model.placement, "local_state_dict")
        header = Header(partial=True, zero_param_names=_names(self.sharding.local_params(), self.model))
        return write_header(self.sharding.local_state_dict(), header)

    def state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        raise SMPCheckpointError(
            "optimizer.state_dict() (the full optimizer state) is not supported under "
            "shard_optimizer_state, as in smp: each rank holds only its share. Save "
            "optimizer.local_state_dict() (smp.save(..., partial=True) or smp.save_checkpoint(partial=True))"
        )

    def _load(self, sd: dict[str, Any]) -> None:
        header, sd = read_header(sd)
        names = header.zero_param_names
        running = _names(self.sharding.local_params(), self.model)
        if names is None or names != running:
            raise IncompatibleCheckpointFoundError(
                f"the optimizer state was not saved as this rank's share under shard_optimizer_state with "
                f"this layout (saved for {str(names)[:200]}, this rank steps {str(running)[:200]}): load "
                "it with the layout, partition and data-parallel size it was saved with"
            )
        self.sharding.load_local(sd)

    def load_state_dict(self, inner: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]) -> None:
        if read_header(state_dict)[0].zero_param_names is None:
            raise IncompatibleCheckpointFoundError(
                "the optimizer state was not saved under shard_optimizer_state (no per-rank share): "
                "load a local_state_dict() saved with shard_optimizer_state and this layout"
            )
        if self.sharding.zero is not None:
            self._load(state_dict)
            return
        self._pending[:] = [state_dict]  # loaded at the first step, once the shards are known
        placement = self.model.placement
        if placement.pp_size == 1 or placement.partitioned:
            self.sharding.build()
            self._load(self._pending.pop())
