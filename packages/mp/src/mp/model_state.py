"""State dicts of `DistributedModel`, held by it as a collaborator: this rank's part
(``local_state_dict``), the full gathered state (``state_dict``), and loading either, checking that a
partial state fits this run's layout. The model's methods of those names call these.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mp.delayed_init import defers_loads
from mp.errors import IncompatibleCheckpointFoundError
from mp.model_partition import Partitioner
from mp.sharded import load_local_state_dict as load_sharded_local_state_dict
from mp.sharded import local_state_dict as sharded_local_state_dict
from mp.state import state
from mp.state_dicts import full_state_dict, layout_of, load_full_state_dict, local_layout_check
from mp_comm import GroupKind
from mp_memory import Header, read_header, write_header
from mp_partition import Placement
from mp_tensor import DistributedModule

if TYPE_CHECKING:
    from mp_memory import ShardedDataParallel

__all__ = ["ModelStateDicts"]

log = logging.getLogger(__name__)


_FULL_STATE_FIX = (
    "save the full model.state_dict() (smp.save(..., partial=False)), which loads under any layout"
)


class ModelStateDicts:
    """The smp state-dict API of one DistributedModel's ``module``. ``partitioner`` holds the
    placement (and takes a partial state's partition before the first step); ``after_partition(check)``
    runs ``check`` once the model is partitioned (a post-partition hook)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        partitioner: Partitioner,
        sharded: ShardedDataParallel | None,
        after_partition: Callable[[Callable[[], None]], None],
    ) -> None:
        self.module = module
        self._partitioner = partitioner
        self._sharded = sharded
        self._after_partition = after_partition

    @property
    def _placement(self) -> Placement:
        return self._partitioner.placement

    @property
    def _pp(self) -> int:
        return self._placement.pp_size

    @property
    def _pp_rank(self) -> int:
        return self._placement.pp_rank

    def local_state_dict(self, cast_to_cpu: bool = True) -> dict[str, Any]:
        """This rank's part of the model's state (its stage, its TP shards), with a partial header
        (``mp_memory.checkpoint.schema``): the partition (pp > 1) and, with TP shards, their layout."""
        if self._sharded is not None:  # this rank's shards (mp.sharded)
            return sharded_local_state_dict(self._sharded)
        out: dict[str, Any] = OrderedDict()
        for key, value in self.module.state_dict(keep_vars=False).items():
            if self._placement.owner(key) != self._pp_rank:
                continue
            out[key] = value.detach().cpu() if cast_to_cpu and isinstance(value, torch.Tensor) else value
        # The partition travels with the parts: loaded before the first step of another run, it
        # replaces that run's own partitioning (which could differ: traced times vary).
        assignment = dict(self._placement.assignment)
        partition = assignment if self._pp > 1 and assignment else None
        layout = layout_of(self.module, self._placement)
        # TP shards: which tp_rank's they are, so no other rank loads them
        header = Header(partial=True, partition=partition, tp_layout=layout if layout.split else None)
        return write_header(out, header)

    def state_dict(
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False, cast_to_cpu: bool = True
    ) -> dict[str, Any]:
        """The full state of the user's model on every rank: the original module's key names (a
        Hugging Face model's own, even under tensor parallelism) and full tensors, TP shards and
        pipeline stages gathered. Collective over the TP and pipeline groups: call it on every rank
        (or every ``rdp_rank() == 0`` rank, as smp asks). ``keep_vars`` returns the live tensors when
        nothing needs gathering (pp = 1 or not yet partitioned, no TP)."""
        distributed = any(isinstance(m, DistributedModule) for m in self.module.modules())
        gathers = distributed or (self._placement.partitioned and self._pp > 1)
        if keep_vars and not gathers:
            return OrderedDict((prefix + k, v) for k, v in self.module.state_dict(keep_vars=True).items())
        merged: dict[str, Any]
        if self._sharded is None:
            merged = full_state_dict(self.module, self._placement, cast_to_cpu)
        else:
            merged = self._sharded.full_state_dict()
        out: dict[str, Any] = destination if destination is not None else OrderedDict()
        out.update((prefix + k, v) for k, v in merged.items())
        return out

    def load_state_dict(
        self,
        state_dict: Any,
        strict: bool = True,
        translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        same_partition_load: bool = True,
    ) -> Any:
        """DistributedModel.load_state_dict (its docstring says what loads where). A model under delayed
        initialization keeps a state loaded before partitioning and loads it once its parameters are
        materialized (mp.delayed_init.defers_loads); it then returns None."""
        if defers_loads(self.module, self._placement):
            saved = read_header(state_dict)[0].partition if isinstance(state_dict, dict) else None
            if saved is not None and same_partition_load and self._pp > 1:
                self.pin_partition(saved)  # pinned at once, so that it is the partition used
            self._after_partition(
                lambda: self.load_state_dict(state_dict, strict, translate_function, same_partition_load)
            )
            log.info("delayed initialization: the loaded state is applied after partitioning")
            return None
        sd = dict(state_dict)
        if translate_function is not None:
            sd = dict(translate_function(sd))
        header, sd = read_header(sd)
        if sd and all(k.startswith("module.") for k in sd):
            sd = {k[len("module.") :]: v for k, v in sd.items()}
        if self._sharded is not None:
            if header.partial:  # the shard layout, checked by mp.sharded
                return load_sharded_local_state_dict(self._sharded, sd, header.sdp_layout)
            return self._sharded.load_full_state_dict(sd, strict)
        if not header.partial:
            return load_full_state_dict(self.module, self._placement, sd, strict)
        local_layout_check(self.module, self._placement, header.tp_layout)
        if not self._placement.partitioned and self._pp > 1:
            if header.partition is not None and same_partition_load:
                self.pin_partition(header.partition)
            loaded = set(sd)
            if strict:
                self._after_partition(lambda: self._check_partial_keys(loaded, True))
            return self.module.load_state_dict(sd, strict=False)
        if strict:
            self._check_partial_keys(set(sd), False)
        return self.module.load_state_dict(sd, strict=False)

    def pin_partition(self, saved: Any) -> None:
        """Before the first step: partition this model as ``saved`` (a partial state's module path ->
        pp_rank) instead of computing a partition, after checking that it fits this model."""
        self._partitioner.pin(
            saved, "load it into the model and layout it was saved with, or " + _FULL_STATE_FIX
        )

    def _check_partial_keys(self, loaded: set[str], collective: bool) -> None:
        """Raise IncompatibleCheckpointFoundError unless ``loaded`` is exactly this rank's part;
        ``collective``: agree over the pipeline group so that every pipeline rank raises."""
        local = {
            k for k in self.module.state_dict(keep_vars=True) if self._placement.owner(k) == self._pp_rank
        }
        missing, unexpected = sorted(local - loaded), sorted(loaded - local)
        problem = None
        if missing or unexpected:
            problem = (
                f"pp_rank {self._pp_rank} of {self._pp}: the partial state lacks {len(missing)} of this "
                f"rank's keys {missing[:5]} and has {len(unexpected)} keys of other ranks {unexpected[:5]}"
            )
        problems: list[Any] = [problem]
        if collective and self._pp > 1:
            problems = [None] * self._pp
            dist.all_gather_object(problems, problem, group=state.process_groups[GroupKind.PP])
        found = [p for p in problems if p is not None]
        if found:
            raise IncompatibleCheckpointFoundError(
                "a partial state dict (local_state_dict) does not match this layout: "
                + "; ".join(found)
                + ". It was saved with another pipeline_parallel_degree or partition: load it with the "
                "layout it was saved with, or " + _FULL_STATE_FIX
            )
