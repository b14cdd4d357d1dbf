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
from typing import Any

import torch.distributed as dist

from mp.errors import NotSupportedByFastModeError, SMPRuntimeError
from mp.model_dp import ReplicaSync
from mp.state import state
from mp.step_retry import ShortcutRetry, StepSnapshot
from mp_comm import GroupKind
from mp_pipeline import (
    FlowChangedError,
    PipelineRuntime,
    PipelineTimeoutError,
    agree_any,
    caused_by,
    flatten,
)

__all__ = ["StepRetry", "fast_mode_check"]

log = logging.getLogger(__name__)


class StepRetry:
    """Snapshot, agreement and take-back around one attempt of a step (DistributedModel.run_step).

    ``retry`` is None where steps are not taken back (``fast_mode`` or ``static_mode`` set, or no
    pipeline): then :meth:`before_attempt` takes no snapshot and :meth:`after_attempt` passes the
    attempt's error through. ``replicas`` gives the local tensors to snapshot, whether
    ``model.join()`` is active, and completes the replicas' started collectives before a take-back.
    """

    def __init__(
        self,
        *,
        runtime: PipelineRuntime | None,
        retry: ShortcutRetry | None,
        replicas: ReplicaSync,
        rank: int,
    ) -> None:
        self._runtime = runtime
        self._retry = retry
        self._replicas = replicas
        self._rank = rank

    def before_attempt(self, inputs: Any) -> StepSnapshot | None:
        """``inputs``: the step's per-microbatch arguments (their tensors' versions are kept)."""
        runtime, retry = self._runtime, self._retry
        if runtime is None or retry is None or not runtime.remote.shortcut:
            return None
        if self._replicas.joined is not None:
            # model.join(): finished replicas shadow only the data-parallel collectives of a step, so no
            # rank may add one to agree on a retry; every rank of the pipeline enters join at the same
            # step, and all run the full path from there
            runtime.give_up_shortcut()
            return None
        buffers = self._replicas.local_buffers()
        tensors = flatten(inputs)[1]
        return retry.before_step(runtime.shortcut_step, self._replicas.local_parameters(), buffers, tensors)

    def after_attempt(
        self, snapshot: StepSnapshot | None, error: BaseException | None, step: int
    ) -> tuple[BaseException | None, BaseException | None]:
        """After an attempt of step number ``step`` (1-based): ``(cause, error)``. ``cause`` is not
        None when every rank took the step back (the caller runs it again); otherwise ``error`` is the
        attempt's outcome on this rank (raised as usual; a failure elsewhere that cannot be repeated
        becomes one here too)."""
        retry, runtime = self._retry, self._runtime
        if snapshot is None or retry is None or runtime is None:
            return None, error
        if not snapshot.restorable:  # a step on the full path: only learn which buffers it changes
            if error is None:
                retry.completed(snapshot, self._replicas.local_parameters())
            return None, error
        group = _agreement_group()
        failed, unrepeatable = error is not None, error is not None and not _repeatable(error)
        if group is not None:
            agreed = self._agree([failed, unrepeatable], group, step)
            if agreed is None:
                return None, error
            failed, unrepeatable = agreed
        if not failed:
            retry.completed(snapshot, self._replicas.local_parameters())
            return None, None
        if unrepeatable:  # the ranks disagree about the step itself, or one is stuck: no second run
            return None, error or self._failed_elsewhere("it cannot run again", step)
        self._replicas.drain()
        problem = snapshot.restore()
        stuck: bool | None = problem is not None
        everyone = group if group is not None else state.process_groups.get(GroupKind.PP)
        if everyone is not None:  # every rank of the job is here: the step failed on all of them
            agreed = self._agree([problem is not None], everyone, step)
            stuck = None if agreed is None else agreed[0]
        if stuck is None or stuck:  # some rank cannot repeat the step: raise on every rank
            error = error or self._failed_elsewhere("could not be run again there", step)
            if problem is not None:
                error.add_note(f"mp could not run this step again on the full path: {problem}")
            return None, error
        cause = error or self._failed_elsewhere("runs again on the full path", step)
        if retry.give_up():
            runtime.give_up_shortcut()
            log.warning(
                "rank %d: step %d failed under fast mode's plan (%s: %s), the %dth time in %d steps; it "
                "runs again on the full path, and so do all later steps (set fast_mode: false to skip the "
                "attempts, or keep the flow the same in every step)",
                self._rank,
                step,
                type(cause).__name__,
                _first_line(cause),
                retry.repeated,
                retry.shortcut_steps,
            )
        else:
            runtime.relearn()
            log.info(
                "rank %d: step %d failed under fast mode's plan (%s: %s); it runs again on the full path "
                "and the plan is learned again",
                self._rank,
                step,
                type(cause).__name__,
                _first_line(cause),
            )
        return cause, None

    def _agree(self, flags: list[bool], group: dist.ProcessGroup, step: int) -> list[bool] | None:
        """OR of ``flags`` over ``group``; None if a member did not come within the pipeline timeout (it
        is not in this step: its own error, or this one, ends the job)."""
        assert self._runtime is not None
        try:
            return agree_any(flags, group, timeout=self._runtime.timeout)
        except PipelineTimeoutError:
            log.warning("rank %d: a rank did not come to agree on step %d's outcome", self._rank, step)
            return None

    def _failed_elsewhere(self, what: str, step: int) -> SMPRuntimeError:
        return SMPRuntimeError(
            f"rank {self._rank}: step {step} failed on another rank under fast mode's plan "
            f"and {what}; see that rank's error"
        )


def fast_mode_check(runtime: PipelineRuntime, error: BaseException | None) -> BaseException | None:
    """Fast mode: a flow that changed after the recording fails the step on every pipeline rank with
    NotSupportedByFastModeError. A change found while sending aborted the step everywhere already;
    one found only at its end (recorded messages left unsent) is agreed on over the pipeline."""
    if runtime.replaying_static:  # on every pipeline rank alike: the collective is safe
        group = state.process_groups.get(GroupKind.PP)
        mismatch = runtime.flow_mismatch if error is None else None
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


_UNREPEATABLE = frozenset(
    {"PipelineError", "PipelineTimeoutError", "PeerTimeoutError", "NotInStepError", "HeartbeatError"}
)
"""Failures that a second run cannot fix: ranks that disagree about the step (a step function or a
collective called on some ranks only) and ranks that stopped answering."""


def _first_line(error: BaseException) -> str:
    """The start of ``error``'s message, for a one-line log record."""
    return (str(error).splitlines() or [""])[0][:300]


def _repeatable(error: BaseException) -> bool:
    """Whether a step that failed with ``error`` (here, or on the rank that ``error`` reports) may run
    again: an Exception other than the runtime's own disagreements and timeouts."""
    if not isinstance(error, Exception):
        return False
    name = getattr(error, "exc_type", None) or type(error).__name__
    return name not in _UNREPEATABLE


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
