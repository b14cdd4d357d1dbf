"""Partitioning of `DistributedModel`, held by it as a collaborator: decide the partition on the first
step (a pinned or ``partition_file`` one, or mp_partition's plan from a traced and timed first
microbatch), share it, free other stages' tensors to placeholders, and keep the resulting placement.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch import nn

from mp.delayed_init import delayed
from mp.errors import IncompatibleCheckpointFoundError, SMPRuntimeError
from mp.partition_file import check_assignment, read_partition, write_partition
from mp.state import state
from mp.tensor_api import pin_tp_internals
from mp_comm import GroupKind
from mp_partition import (
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

__all__ = ["Partitioner"]

log = logging.getLogger("mp.model")  # the logger these messages always had


class Partitioner:
    """The partition of one DistributedModel's ``module``: ``placement`` (unpartitioned, as the model
    built it, until :meth:`partition` runs on the first step), ``plan`` (on global rank 0, where it is
    computed; None elsewhere and with pp=1), ``pinned`` (a partial checkpoint's partition, loaded
    before the first step: used instead of computing one), and ``tracing`` / ``timer`` while the first
    microbatch is traced or timed (the model's forward and backward read them)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        placement: Placement,
        runtime: PipelineRuntime | None,
        rank: int,
        trace_times: bool,
    ) -> None:
        self.module = module
        self.placement = placement
        """Where the model lives (mp_partition.Placement); replaced once, by :meth:`partition`."""
        self._runtime = runtime
        self._rank = rank
        self._pp = placement.pp_size
        self._pp_rank = placement.pp_rank
        self.trace_times = trace_times
        """Whether tracing measures module times (``trace_execution_times``, off on a CPU trace)."""
        self.plan: PartitionPlan | None = None
        """The partition plan (on global rank 0, where it is computed; None elsewhere and with pp=1)."""
        self.pinned: dict[str, int] | None = None
        """The partition a partial checkpoint was saved with (loaded before the first step)."""
        self.tracing = False
        """True while the first microbatch runs to be traced or timed (no pipeline, no backward)."""
        self.timer: StepTimer | None = None
        """The timed step's timer (mp_partition) while the first microbatch is timed, else None."""

    def partition(self, body: Callable[[int], Any]) -> None:
        """The first step's partitioning (``body(mb)`` runs microbatch ``mb`` of the step): collective
        over the job under pp > 1; afterwards ``placement`` is the partitioned one."""
        world = state.require()[1]
        if self._pp > 1:
            cfg = state.require()[0]
            payload: tuple[str, Any] = ("error", "rank 0 did not compute a partition")
            # The trace runs the model's forward: with tensor parallelism its distributed modules run
            # collectives in rank 0's TP group, so every member of that group traces (its own first
            # microbatch) and rank 0's plan is the one everybody uses.
            tracers = state.require()[2].group(GroupKind.TP, 0)
            # Whether rank 0 takes a given partition decides whether anybody traces: agreed first.
            pinned: list[Any] = [self.pinned is not None or cfg.load_partition]
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
            placed = replace(self.placement, assignment=dict(value))
            assignment = {**placed.assignment, **pin_tp_internals(self.module, placed.module_owner)}
            self.placement = replace(placed, assignment=assignment, partitioned=True)
            self.placement.free_remote(self.module)
            assert self._runtime is not None
            self._runtime.install(self.module, assignment)
            log.info(
                "rank %d (pp_rank %d) holds %d of %d parameters after partitioning",
                world.rank,
                self._pp_rank,
                sum(p.numel() for p in self.placement.local_parameters(self.module)),
                sum(p.numel() for p in self.module.parameters()),
            )
        self.placement = replace(self.placement, partitioned=True)

    def _decide_partition(self, body: Callable[[int], Any]) -> dict[str, int]:
        """On global rank 0: the partition of a partial checkpoint loaded before the first step, else the
        one in ``partition_file`` (``load_partition``), else a computed one."""
        cfg = state.require()[0]
        if self.pinned is not None:
            log.info("partition taken from the partial checkpoint loaded before the first step")
            return dict(self.pinned)
        if cfg.load_partition:
            assert cfg.partition_file is not None  # the config requires it
            assignment = read_partition(cfg.partition_file, self.module_paths(), self._pp)
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
        with Tracer(self.module, measure_time=self.trace_times) as tracer:
            self.tracing = True
            try:
                with task_context(TaskContext(0, ("<step>",))):
                    body(0)
            finally:
                self.tracing = False
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
            self.tracing, self.timer = True, timer
            try:
                with task_context(TaskContext(0, ("<step>",))):
                    body(0)
            finally:
                self.tracing, self.timer = False, None

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

    def module_paths(self) -> Iterator[str]:
        """The paths of the wrapped model's modules (what a partition assigns)."""
        return (name for name, _ in self.module.named_modules())

    def pin(self, saved: Any, fix: str) -> None:
        """Before the first step: partition as ``saved`` (a partial state's module path -> pp_rank)
        instead of computing a partition, after checking that it fits this model (``fix`` ends the
        error's message)."""
        self.pinned = check_assignment(
            saved,
            self.module_paths(),
            self._pp,
            source="the partial state's '_smp_partition' entry",
            fix=fix,
            error=IncompatibleCheckpointFoundError,
        )

    def display(self) -> None:
        """Print which pp_rank holds which modules: the partition report on the rank that computed the
        partition, the assignment (module path: pp_rank) on the others."""
        if self.plan is not None:
            print(self.plan.report())
        elif self._pp == 1:
            print(f"pipeline_parallel_degree=1: rank {self._rank} holds the whole model")
        else:
            for path, pp_rank in sorted(self.placement.assignment.items()):
                print(f"{path or '(root)'}: pp_rank {pp_rank}")
