"""DistributedModel's side of fast mode's plan: a step that failed under it runs again (mp's default), or
raises NotSupportedByFastModeError (``fast_mode: true``, smp's fast mode).

With ``fast_mode`` unset, the pipeline follows fast mode's plan (mp_pipeline.fast, mp_pipeline.posted)
from its second step. Before each such step every rank takes a :class:`~mp.step_retry.StepSnapshot`.
When the step fails on any rank, every rank of the job learns it (a failed step already ends on every
rank of its pipeline; replicas and tensor-parallel peers agree over the world), completes the
data-parallel collectives some replica started, puts its state back, forgets the plan, and the caller
runs the step again on the full path. A step that fails there fails for a reason of its own, and its
error is raised as without the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mp.errors import NotSupportedByFastModeError, SMPRuntimeError
from mp.model_partition import PartitionMixin
from mp.state import state
from mp.step_retry import ShortcutRetry, StepSnapshot
from mp_comm import GroupKind
from mp_pipeline import FlowChangedError, PipelineRuntime, agree_any, caused_by
from mp_pipeline.dp import OverlappedReduction

__all__ = ["RetryMixin"]

log = logging.getLogger(__name__)


class RetryMixin(PartitionMixin):
    """Snapshot, agreement and take-back around one attempt of a step (DistributedModel._run_step)."""

    _runtime: PipelineRuntime | None
    _retry: ShortcutRetry | None
    _overlap: OverlappedReduction | None
    _rank: int
    _step_count: int

    if TYPE_CHECKING:

        def local_buffers(self) -> Iterator[torch.Tensor]: ...

    def _before_attempt(self, inputs: list[torch.Tensor]) -> StepSnapshot | None:
        """``inputs``: the step function's tensor arguments, whole (before the microbatch split)."""
        runtime, retry = self._runtime, self._retry
        if runtime is None or retry is None or not runtime.remote.shortcut:
            return None
        buffers = list(self.local_buffers())
        return retry.before_step(runtime.shortcut_step, self._local_params(), buffers, inputs)

    def _repeat_step(
        self, snapshot: StepSnapshot | None, error: BaseException | None
    ) -> BaseException | None:
        """After an attempt: None when it stands (``error`` then is raised as usual), or the error that
        made every rank take the step back, in which case the caller runs it again."""
        retry = self._retry
        if snapshot is None or retry is None:
            return None
        if not snapshot.restorable:  # a step on the full path: only learn which buffers it changes
            if error is None:
                retry.completed(snapshot, self._local_params())
            return None
        group = _agreement_group()
        failed = error is not None
        if group is not None:
            failed = agree_any([failed], group)[0]
        if not failed:
            retry.completed(snapshot, self._local_params())
            return None
        self._drain_overlap()
        problem = snapshot.restore()
        stuck = problem is not None
        everyone = group if group is not None else state.process_groups.get(GroupKind.PP)
        if everyone is not None:  # rare (a failed step): every rank of the job is here
            stuck = agree_any([stuck], everyone)[0]
        if stuck:  # some rank cannot repeat the step: raise on every rank
            if error is None:
                error = SMPRuntimeError(
                    f"rank {self._rank}: step {self._step_count + 1} failed on another rank under fast "
                    "mode's plan and could not be run again there; see that rank's error"
                )
            if problem is not None:
                error.add_note(f"mp could not run this step again on the full path: {problem}")
            return None
        assert self._runtime is not None
        cause = error if error is not None else SMPRuntimeError("the step failed on another rank")
        if retry.give_up():
            self._runtime.give_up_shortcut()
            log.warning(
                "rank %d: step %d failed under fast mode's plan (%s: %s), the %dth time in %d steps; it "
                "runs again on the full path, and so do all later steps (set fast_mode: false to skip the "
                "attempts, or keep the flow the same in every step)",
                self._rank,
                self._step_count + 1,
                type(cause).__name__,
                str(cause).splitlines()[0][:300] if str(cause) else "",
                retry.repeated,
                retry.shortcut_steps,
            )
        else:
            self._runtime.relearn()
            log.info(
                "rank %d: step %d failed under fast mode's plan (%s); it runs again on the full path and "
                "the plan is learned again",
                self._rank,
                self._step_count + 1,
                type(cause).__name__,
            )
        return cause

    def _fast_mode_check(self, error: BaseException | None) -> BaseException | None:
        """Fast mode: a flow that changed after the recording fails the step on every pipeline rank with
        NotSupportedByFastModeError. A change found while sending aborted the step everywhere already;
        one found only at its end (recorded messages left unsent) is agreed on over the pipeline."""
        assert self._runtime is not None
        if self._runtime.replaying_static:  # on every pipeline rank alike: the collective is safe
            group = state.process_groups.get(GroupKind.PP)
            mismatch = self._runtime.flow_mismatch if error is None else None
            changed = mismatch is not None
            if group is not None:
                changed = agree_any([changed], group)[0]
            if changed and error is None:
                error = FlowChangedError(mismatch or "another rank of the pipeline sent other messages")
        if error is not None and caused_by(error, FlowChangedError):
            fast = NotSupportedByFastModeError(
                f"the execution flow of the step changed after static mode recorded it: {error}. Fast "
                "mode needs the same flow in every step: set 'fast_mode' to False (with static_mode the "
                "runtime then falls back to full messages when the flow changes)."
            )
            fast.__cause__ = error
            return fast
        return error

    def _drain_overlap(self) -> None:
        """Complete the gradient collectives that some data-parallel replica started in the attempt."""
        overlap = self._overlap
        group = state.process_groups.get(GroupKind.DP)
        if group is None or dist.get_world_size(group) == 1:
            return
        launched = overlap is not None and overlap.launched > 0
        if agree_any([launched], group)[0] and overlap is not None:
            overlap.drain()  # out of place: the local gradients stay as they are
        elif overlap is not None:
            overlap.disarm()


def _agreement_group() -> dist.ProcessGroup | None:
    """Where a failed attempt must be known: every rank of the job when it has replicas or TP peers (a
    pipeline's own ranks already end a failed step together), else nobody else."""
    groups = state.process_groups
    world, pp = groups.get(GroupKind.WORLD), groups.get(GroupKind.PP)
    if world is None or dist.get_world_size(world) == 1:
        return None
    if pp is not None and dist.get_world_size(pp) == dist.get_world_size(world):
        return None
    return world
