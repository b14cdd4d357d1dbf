"""Partitioning glue of `DistributedModel`: decide the partition on the first step (a pinned or
``partition_file`` one, or mp_partition's plan from a traced and timed first microbatch), share it,
free other stages' tensors to placeholders, and answer which pp_rank owns a module or tensor.
"""

from __future__ import annotations

import logging
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mp.delayed_init import delayed
from mp.errors import ModelNotPartitionedError, SMPRuntimeError
from mp.optimizer import keep_local_parameters
from mp.partition_file import read_partition, write_partition
from mp.state import state
from mp.tensor_api import pin_tp_internals
from mp_comm import GroupKind
from mp_partition import (
    PLACEHOLDER_ATTR,
    ModuleTimes,
    PartitionPlan,
    Placement,
    StepTimer,
    Tracer,
    auto_partition,
    device_memory_bytes,
    manual_partition,
    time_step,
)
from mp_pipeline import PipelineRuntime, TaskContext, Timeline, task_context

__all__ = ["PartitionMixin"]

log = logging.getLogger("mp.model")  # the logger these messages always had

_PLACEHOLDER = PLACEHOLDER_ATTR


class PartitionMixin(nn.Module):
    """The partition of the wrapped model and its owner lookups (mixed into DistributedModel)."""

    module: nn.Module
    plan: PartitionPlan | None
    _rank: int
    _pp: int
    _pp_rank: int
    _placement: Placement
    _pinned: dict[str, int] | None
    _tracing: bool
    _timer: StepTimer | None
    _trace_times: bool
    _runtime: PipelineRuntime | None
    _post_partition_hooks: OrderedDict[int, Callable[..., Any]]

    if TYPE_CHECKING:  # defined by DistributedModel and StateDictMixin

        def _run_hooks(self, hooks: OrderedDict[int, Callable[..., Any]]) -> None: ...

        def _module_paths(self) -> Iterator[str]: ...

    def _partition(self, body: Callable[[int], Any]) -> None:
        world = state.require()[1]
        if self._pp > 1:
            cfg = state.require()[0]
            payload: tuple[str, Any] = ("error", "rank 0 did not compute a partition")
            # The trace runs the model's forward: with tensor parallelism its distributed modules run
            # collectives in rank 0's TP group, so every member of that group traces (its own first
            # microbatch) and rank 0's plan is the one everybody uses.
            tracers = state.require()[2].group(GroupKind.TP, 0)
            # Whether rank 0 takes a given partition decides whether anybody traces: agreed first.
            pinned: list[Any] = [self._pinned is not None or cfg.load_partition]
            dist.broadcast_object_list(pinned, src=0)
            if world.rank in tracers and world.rank != 0 and not pinned[0]:
                try:
                    self._compute_plan(body)
                except Exception:
                    log.exception("tracing on rank %d (a TP peer of rank 0) failed", world.rank)
            if world.rank == 0:
                try:
                    assignment = self._decide_partition(body)
                    if cfg.partition_file is not None and not cfg.load_partition:
                        write_partition(cfg.partition_file, assignment, self._pp)
                    payload = ("ok", assignment)
                except Exception as exc:
                    payload = (
                        "error",
                        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                    )
                    dist.broadcast_object_list([payload], src=0)
                    raise
            box: list[Any] = [payload]
            dist.broadcast_object_list(box, src=0)
            kind, value = box[0]
            if kind == "error":
                raise SMPRuntimeError(f"partitioning the model failed on rank 0:\n{value}")
            placed = replace(self._placement, assignment=dict(value))
            assignment = {**placed.assignment, **pin_tp_internals(self.module, placed.module_owner)}
            self._placement = replace(placed, assignment=assignment, partitioned=True)
            self._placement.free_remote(self.module)
            assert self._runtime is not None
            self._runtime.install(self.module, assignment)
            log.info(
                "rank %d (pp_rank %d) holds %d of %d parameters after partitioning",
                world.rank,
                self._pp_rank,
                sum(p.numel() for p in self._local_params()),
                sum(p.numel() for p in self.module.parameters()),
            )
        self._placement = replace(self._placement, partitioned=True)
        optimizer = state.optimizer
        if optimizer is not None:
            keep_local_parameters(optimizer, self._placement)
        self._run_hooks(self._post_partition_hooks)

    def _decide_partition(self, body: Callable[[int], Any]) -> dict[str, int]:
        """On global rank 0: the partition of a partial checkpoint loaded before the first step, else the
        one in ``partition_file`` (``load_partition``), else a computed one."""
        cfg = state.require()[0]
        if self._pinned is not None:
            log.info("partition taken from the partial checkpoint loaded before the first step")
            return dict(self._pinned)
        if cfg.load_partition:
            assert cfg.partition_file is not None  # the config requires it
            assignment = read_partition(cfg.partition_file, self._module_paths(), self._pp)
            log.info("partition read from partition_file %r", cfg.partition_file)
            return assignment
        self.plan = self._compute_plan(body)
        return dict(self.plan.assignment)

    def _compute_plan(self, body: Callable[[int], Any]) -> PartitionPlan:
        cfg = state.require()[0]
        alpha = cfg.resolved_memory_weight
        if not cfg.auto_partition:
            return manual_partition(
                self.module, self._pp, cfg.resolved_default_partition, memory_weight=alpha
            )
        if cfg.skip_tracing or delayed(self.module):  # a model on the meta device cannot run yet
            return auto_partition(self.module, self._pp, memory_weight=alpha, skip_tracing=True)
        with Tracer(self.module, measure_time=self._trace_times) as tracer:
            self._tracing = True
            try:
                with task_context(TaskContext(0, ("<step>",))):
                    body(0)
            finally:
                self._tracing = False
        # Time balances the stages unless memory_weight is set (None: time, or memory where it binds).
        return auto_partition(
            self.module,
            self._pp,
            memory_weight=cfg.memory_weight,
            trace=tracer.result(),
            times=self._time_step(body),
            memory_limit_bytes=device_memory_bytes(self.module, state.require()[1].info.local_size),
            microbatches_in_flight=cfg.resolved_active_microbatches,
        )

    def _time_step(self, body: Callable[[int], Any]) -> ModuleTimes | None:
        """Forward and backward time of every module on the first microbatch (mp_partition.timing), or
        None if the timed step fails (the plan then balances the trace's costs)."""

        def step(timer: StepTimer) -> None:
            self._tracing, self._timer = True, timer
            try:
                with task_context(TaskContext(0, ("<step>",))):
                    body(0)
            finally:
                self._tracing, self._timer = False, None

        try:
            return time_step(self.module, step)
        except Exception:
            log.warning("timing the step for auto-partitioning failed; balancing traced costs", exc_info=True)
            return None

    def note_timeline(self, timeline: Timeline) -> None:
        """Adds each stage's measured seconds per microbatch (from a merged pipeline timeline) to the
        plan, beside the predicted ones (smp.timeline.stop calls it on the rank holding the plan)."""
        if self.plan is None or self.plan.num_partitions != self._pp:
            return
        topo = state.require()[2]
        per_stage: list[list[float]] = [[] for _ in range(self._pp)]
        for rank in timeline.ranks:
            seconds = timeline.stage_time_s(rank)
            if seconds is not None:
                per_stage[topo.coords(rank).pp_rank].append(seconds)
        measured = [sum(v) / len(v) if v else None for v in per_stage]
        self.plan = self.plan.with_measured_times(measured)

    @property
    def placement(self) -> Placement:
        """Where the model lives: the pp degree and rank, the module -> pp_rank assignment (empty and
        ``partitioned=False`` until the first step), which tensors this rank holds, the collective entry
        (mp_partition.Placement). State dicts, optimizer state, checkpoints and the memory features take
        it instead of asking the model."""
        return self._placement

    @property
    def _partitioned(self) -> bool:
        return self._placement.partitioned

    @property
    def _assignment(self) -> dict[str, int]:
        return dict(self._placement.assignment)

    def _owner(self, key: str) -> int:
        """The pp_rank holding a parameter, buffer or state-dict entry named ``key``."""
        return self._placement.owner(key)

    def _module_owner(self, path: str) -> int:
        return self._placement.module_owner(path)

    def _is_remote(self, t: torch.Tensor) -> bool:
        return not self._placement.is_local(t)

    def _local_params(self) -> list[nn.Parameter]:
        return self._placement.local_parameters(self.module)

    def _require_partitioned(self, what: str) -> None:
        if not self._partitioned:
            raise ModelNotPartitionedError(
                f"model.{what}() needs the model partitioned, which happens in the first @smp.step call; "
                "call it after the first step (or in a post-partition hook)"
            )

    def display_partition(self) -> None:
        """Print which pp_rank holds which modules: the partition report on the rank that computed the
        partition, the assignment (module path: pp_rank) on the others."""
        self._require_partitioned("display_partition")
        if self.plan is not None:
            print(self.plan.report())
        elif self._pp == 1:
            print(f"pipeline_parallel_degree=1: rank {self._rank} holds the whole model")
        else:
            for path, pp_rank in sorted(self._assignment.items()):
                print(f"{path or '(root)'}: pp_rank {pp_rank}")
