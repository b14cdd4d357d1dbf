"""Sharded data parallelism's model and optimizer state dicts, full and local (``mp_memory.sharded``):
the methods of :class:`~mp_memory.sharded.ShardedDataParallel` that save and load its state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mp_memory.sharded_state import _local, local_part

if TYPE_CHECKING:
    from mp_memory.sharded import ShardingConfig, ShardingError, TensorParallel

__all__ = ["ShardedStateDicts"]


def _error(message: str) -> ShardingError:
    from mp_memory.sharded import ShardingError

    return ShardingError(message)


class ShardedStateDicts:
    """State-dict methods of a sharded module (mixed into ``ShardedDataParallel``)."""

    module: nn.Module
    config: ShardingConfig
    tp: TensorParallel | None
    gather_tp_state: Callable[[], dict[str, Any]] | None
    local_tp_state: Callable[[dict[str, Any]], dict[str, torch.Tensor]] | None

    if TYPE_CHECKING:

        def gathered(self) -> contextlib.AbstractContextManager[None]: ...

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state under its own key names, full tensors, on every rank (collective).
        Under tensor parallelism, ``gather_tp_state`` (set by the caller) gathers it from the whole
        parameters (:meth:`gathered`) in the original model's names."""
        half = self.config.param_dtype  # the model's dtype, as without sharding (the masters: optimizer)
        if self.gather_tp_state is not None:
            with self.gathered():
                sd = self.gather_tp_state()
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {
            k: (v.detach().cpu().to(half) if half is not None and v.is_floating_point() else v.detach().cpu())
            if isinstance(v, torch.Tensor)
            else v
            for k, v in sd.items()
        }

    def load_full_state_dict(self, sd: dict[str, Any], strict: bool = True) -> Any:
        """Load a full state (each rank keeps its shards). Under tensor parallelism ``local_tp_state``
        (set by the caller) gives this TP rank's values first."""
        if self.tp is not None:
            assert self.local_tp_state is not None, "set local_tp_state under tensor parallelism"
            return self._load_values(self.local_tp_state(sd), strict)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(
            self.module, sd, options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def _load_values(self, values: dict[str, torch.Tensor], strict: bool) -> Any:
        """Copy whole values (under the module's own names) into this rank's shards and whole
        parameters; no communication. Returns torch's (missing_keys, unexpected_keys)."""
        from torch.nn.modules.module import _IncompatibleKeys

        live = self.module.state_dict()
        missing, unexpected = sorted(set(live) - set(values)), sorted(set(values) - set(live))
        if strict and (missing or unexpected):
            raise _error(
                f"the full state does not match this model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}. Fix: load a state_dict() of the same model, or pass strict=False"
            )
        with torch.no_grad():
            for k, v in values.items():
                if k in live:
                    target = live[k]
                    target_local = _local(target)
                    value = local_part(v, target) if isinstance(target, DTensor) else v
                    if tuple(value.shape) != tuple(target_local.shape):
                        raise _error(
                            f"{k}: a full value of shape {tuple(v.shape)} for this model's "
                            f"{tuple(target.shape)}. Fix: load a state saved from the same model"
                        )
                    target_local.copy_(value)
        return _IncompatibleKeys(missing, unexpected)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards (plain tensors) and the whole small parameters and buffers."""
        return {k: _local(v).detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def load_local_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy this rank's saved shards into the model (saved under the same layout)."""
        live = self.module.state_dict()
        missing, unexpected = sorted(set(live) - set(sd)), sorted(set(sd) - set(live))
        if missing or unexpected:
            raise _error(
                f"the sharded state does not match this model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}. Fix: load it into the model it was saved from"
            )
        with torch.no_grad():
            for k, v in live.items():
                target = _local(v)
                if tuple(target.shape) != tuple(sd[k].shape):
                    raise _error(
                        f"{k}: saved shard of shape {tuple(sd[k].shape)}, this rank holds "
                        f"{tuple(target.shape)}. Fix: load it with the sharded_data_parallel_degree it "
                        "was saved with, or save a full checkpoint"
                    )
                target.copy_(sd[k])

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, full tensors, on every rank (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.module, optimizer, options=StateDictOptions(full_state_dict=True)
        )

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, sd, options=StateDictOptions(full_state_dict=True))
