"""The errors of mp-pipeline. Each message names what was received, what was expected and the fix.

The umbrella (`mp`) re-raises :class:`SplitError` as smp's ``TensorSplitError``; the others reach the
user as they are (they derive from ``RuntimeError``/``ValueError`` as smp's did).
"""

from __future__ import annotations

from typing import Any

MICROBATCH_ATTR = "_mp_microbatch"
"""The attribute the pipeline sets on an exception raised in a microbatch's task (to the microbatch), so
that the failure it reports names the microbatch; read back with getattr."""

__all__ = [
    "FlowChangedError",
    "InvalidStepOutputError",
    "NotInStepError",
    "PipelineAbortedError",
    "PipelineError",
    "PipelineTimeoutError",
    "RemoteExecutionError",
    "SplitBackwardError",
    "SplitError",
    "caused_by",
    "collective_mismatch",
]


class PipelineError(RuntimeError):
    """Base class of the pipeline runtime's failures."""


def collective_mismatch(opening: str, also: str = "") -> PipelineError:
    """A collective over the pipeline that some of its ranks did not call: ``opening``, the fix, and
    ``also`` (another way out) after it."""
    return PipelineError(
        f"{opening}: call it on every rank of the pipeline at the same point of the script (e.g. under "
        f"`if smp.rdp_rank() == 0:` rather than `if smp.rank() == 0:`){also}"
    )


class RemoteExecutionError(PipelineError):
    """A module executed for this rank on another rank raised; the message carries that rank's
    traceback. ``rank`` is the global rank where it raised, ``module`` the module path ("" is the
    model itself, "<step>" the step function), ``microbatch`` and ``phase`` where it happened."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        module: str,
        microbatch: int,
        phase: str,
        remote_traceback: str,
        exc_type: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.module = module
        self.microbatch = microbatch
        self.phase = phase
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        """The class name of the original exception."""

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_remote,
            (
                str(self),
                self.rank,
                self.module,
                self.microbatch,
                self.phase,
                self.remote_traceback,
                self.exc_type,
            ),
        )


def _rebuild_remote(  # noqa: PLR0917 - pickle calls it positionally
    message: str, rank: int, module: str, microbatch: int, phase: str, remote_traceback: str, exc_type: str
) -> RemoteExecutionError:
    return RemoteExecutionError(
        message,
        rank=rank,
        module=module,
        microbatch=microbatch,
        phase=phase,
        remote_traceback=remote_traceback,
        exc_type=exc_type,
    )


class PipelineAbortedError(PipelineError):
    """The step was aborted because another rank of the pipeline (or a data-parallel replica) failed;
    the message carries that rank's error and traceback; ``exc_type`` names the original exception's
    class."""

    def __init__(self, message: str, exc_type: str = "", failure: Any = None) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.failure = failure
        """The original failure (an mp_pipeline.messages.Failure), for passing it on."""


class FlowChangedError(PipelineError):
    """Fast mode: a step's execution flow differs from the one recorded in the first steps."""


def caused_by(exc: BaseException, cls: type[BaseException]) -> bool:
    """Whether ``exc`` is ``cls`` or reports one raised on another rank (RemoteExecutionError,
    PipelineAbortedError)."""
    return isinstance(exc, cls) or getattr(exc, "exc_type", None) == cls.__name__


class PipelineTimeoutError(PipelineError):
    """A rank waited longer than the pipeline timeout for a message (a peer is stuck or dead)."""


class SplitError(ValueError):
    """Step inputs cannot be split into microbatches as asked (smp's TensorSplitError)."""


class SplitBackwardError(PipelineError):
    """A split backward (mp_pipeline.split_backward) was used out of order: mismatched outputs and
    gradients, or a call's weight half run twice."""


class InvalidStepOutputError(ValueError):
    """A StepOutput was built from something other than a list or tuple of microbatch outputs."""


class NotInStepError(RuntimeError):
    """A pipeline operation (a remote module call, a pipelined backward) ran outside a step."""
