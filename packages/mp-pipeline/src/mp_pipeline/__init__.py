"""mp-pipeline: module servers, remote autograd across ranks, schedules and microbatching for mp.

The pipeline runtime (docs/pipeline.md): every rank runs a module server; a call to a module owned by
another rank becomes a request to that rank, with autograd wired across ranks; pp_rank 0 drives the
microbatches of the step function by a schedule ("simple" or "interleaved"). The umbrella ``mp``
builds ``smp.step``, ``smp.DistributedModel`` and ``smp.DistributedOptimizer`` on it. While
``RECORDER`` is enabled, every rank records its executions, requests and waits (``Timeline``).
"""

from mp_pipeline.context import TASK_HOOKS, ExecState, TaskContext, applied, capture, current, task_context
from mp_pipeline.dp import OverlappedReduction, agree_any, broadcast_tensors, buckets, reduce_gradients
from mp_pipeline.errors import (
    FlowChangedError,
    InvalidStepOutputError,
    NotInStepError,
    PipelineAbortedError,
    PipelineError,
    PipelineTimeoutError,
    RemoteExecutionError,
    SplitBackwardError,
    SplitError,
    caused_by,
)
from mp_pipeline.messages import Failure, Request, Response, StepAbort, StepEnd, StepId
from mp_pipeline.microbatch import SplitSpec, split_arguments
from mp_pipeline.remote import Remote, remote_error
from mp_pipeline.runtime import PipelineRuntime, StepDriver, default_timeout, pipelined_backward
from mp_pipeline.schedule import Phase, Scheduler, SimResult, Task, fixed_order, simulate
from mp_pipeline.server import Server
from mp_pipeline.split_backward import WeightGrad, WeightQueue, backward_input
from mp_pipeline.static import FlowRecorder, TemplateStore
from mp_pipeline.step_output import StepOutput, merge_microbatch_results
from mp_pipeline.structure import Slot, flatten, map_structure, unflatten
from mp_pipeline.timeline import RECORDER, Event, EventKind, ProcessTrace, Recorder, Timeline
from mp_pipeline.workers import Baton, WorkerPool, WorkerState

__version__ = "0.1.0"

__all__ = [
    "RECORDER",
    "TASK_HOOKS",
    "Baton",
    "Event",
    "EventKind",
    "ExecState",
    "Failure",
    "FlowChangedError",
    "FlowRecorder",
    "InvalidStepOutputError",
    "NotInStepError",
    "OverlappedReduction",
    "Phase",
    "PipelineAbortedError",
    "PipelineError",
    "PipelineRuntime",
    "PipelineTimeoutError",
    "ProcessTrace",
    "Recorder",
    "Remote",
    "RemoteExecutionError",
    "Request",
    "Response",
    "Scheduler",
    "Server",
    "SimResult",
    "Slot",
    "SplitBackwardError",
    "SplitError",
    "SplitSpec",
    "StepAbort",
    "StepDriver",
    "StepEnd",
    "StepId",
    "StepOutput",
    "Task",
    "TaskContext",
    "TemplateStore",
    "Timeline",
    "WeightGrad",
    "WeightQueue",
    "WorkerPool",
    "WorkerState",
    "__version__",
    "agree_any",
    "applied",
    "backward_input",
    "broadcast_tensors",
    "buckets",
    "capture",
    "caused_by",
    "current",
    "default_timeout",
    "fixed_order",
    "flatten",
    "map_structure",
    "merge_microbatch_results",
    "pipelined_backward",
    "reduce_gradients",
    "remote_error",
    "simulate",
    "split_arguments",
    "task_context",
    "unflatten",
]
