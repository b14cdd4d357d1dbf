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

import types
from typing import Any

import torch

from mp.errors import IncompatibleCheckpointFoundError, SMPCheckpointError, SMPValidationError
from mp.state import state
from mp_comm import GroupKind
from mp_memory.checkpoint.schema import Header, read_header, write_header
from mp_memory.zero import ZeroSharding

__all__ = ["shard_optimizer_state", "sharding_of"]

_ATTR = "_mp_zero"


def sharding_of(optimizer: Any) -> ZeroSharding | None:
    """The ZeRO sharding of an optimizer registered under ``shard_optimizer_state`` (else None)."""
    found: ZeroSharding | None = getattr(optimizer, _ATTR, None)
    return found


def _ready(sharding: ZeroSharding, what: str) -> None:
    model = state.model
    if sharding.zero is None and model is not None and model._pp > 1 and not model.partitioned:
        raise SMPValidationError(
            f"optimizer.{what}() under shard_optimizer_state needs the model partitioned (the state is "
            "sharded over this stage's parameters); call it after the first @smp.step"
        )


def _names(params: list[torch.Tensor]) -> list[str | None]:
    model = state.model
    by_id = {id(p): n for n, p in model.module.named_parameters()} if model is not None else {}
    return [by_id.get(id(p)) for p in params]


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` step, save and load through ZeRO over the RDP group (module docstring)."""
    sharding = ZeroSharding(optimizer, state.process_groups.get(GroupKind.RDP))
    pending: list[dict[str, Any]] = []

    def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        _ready(sharding, "step")
        if sharding.zero is None and pending:  # a state loaded before partitioning
            sharding.build()
            _load(pending.pop())
        return sharding.step(closure)

    def local_state_dict(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> dict[str, Any]:
        _ready(sharding, "local_state_dict")
        header = Header(partial=True, zero_param_names=_names(sharding.local_params()))
        return write_header(sharding.local_state_dict(), header)

    def state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
        raise SMPCheckpointError(
            "optimizer.state_dict() (the full optimizer state) is not supported under "
            "shard_optimizer_state, as in smp: each rank holds only its share. Save "
            "optimizer.local_state_dict() (smp.save(..., partial=True) or smp.save_checkpoint(partial=True))"
        )

    def _load(sd: dict[str, Any]) -> None:
        header, sd = read_header(sd)
        names = header.zero_param_names
        running = _names(sharding.local_params())
        if names is None or names != running:
            raise IncompatibleCheckpointFoundError(
                f"the optimizer state was not saved as this rank's share under shard_optimizer_state with "
                f"this layout (saved for {str(names)[:200]}, this rank steps {str(running)[:200]}): load "
                "it with the layout, partition and data-parallel size it was saved with"
            )
        sharding.load_local(sd)

    def load_state_dict(self: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        if read_header(sd)[0].zero_param_names is None:
            raise IncompatibleCheckpointFoundError(
                "the optimizer state was not saved under shard_optimizer_state (no per-rank share): "
                "load a local_state_dict() saved with shard_optimizer_state and this layout"
            )
        if sharding.zero is not None:
            _load(sd)
            return
        pending[:] = [sd]  # loaded at the first step, once the shards are known
        model = state.model
        if model is None or model._pp == 1 or model.partitioned:
            sharding.build()
            _load(pending.pop())

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.local_state_dict = types.MethodType(local_state_dict, optimizer)  # type: ignore[attr-defined]
    optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _ATTR, sharding)
