"""smp's ``trace_memory_usage`` made real: a per-rank memory report (mechanism: ``mp_memory.memory_report``).

With ``DistributedModel(..., trace_memory_usage=True)``, or the environment variable ``MP_MEMORY_REPORT=1``
(``mp-launch --memory-report`` sets it), every task of a step (pp_rank 0's step function and each rank's
module servers) counts the tensors autograd keeps for backward, and after the first step (once the
optimizer has stepped, or at the end of the step without an optimizer) each rank logs its report on the
``mp.memory`` logger. :func:`memory_report` gives the report on request, at any time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mp.errors import DistributedModelNotWrappedError
from mp.state import state
from mp.zero import sharding_of
from mp_memory import ActivationTracker, MemoryReport, tensor_bytes
from mp_partition import Placement
from mp_pipeline import TASK_HOOKS

if TYPE_CHECKING:
    from mp.model import DistributedModel

__all__ = ["MEMORY_REPORT_ENV", "install_memory_trace", "local_report", "memory_report"]

MEMORY_REPORT_ENV = "MP_MEMORY_REPORT"
"""Set to 1 to trace and log every rank's memory report after the first step (mp-launch --memory-report)."""

log = logging.getLogger("mp.memory")

_HOOK: list[Any] = []
"""The task hook of the current model's trace (one model per process)."""


def _requested(trace_memory_usage: bool) -> bool:
    return trace_memory_usage or os.environ.get(MEMORY_REPORT_ENV, "").strip() not in ("", "0")


def install_memory_trace(model: DistributedModel, trace_memory_usage: bool) -> ActivationTracker | None:
    """Trace ``model``'s activations when asked (module docstring), and log the report after step 1."""
    for old in _HOOK:  # a model wrapped before (smp.reset in between) traces no more
        with contextlib.suppress(ValueError):
            TASK_HOOKS.remove(old)
    _HOOK.clear()
    if not _requested(trace_memory_usage):
        return None
    tracker = ActivationTracker()

    def hook() -> contextlib.AbstractContextManager[None]:
        if state.model is not model or not model.in_step:
            return contextlib.nullcontext()
        return tracker.hooks()

    TASK_HOOKS.append(hook)
    _HOOK.append(hook)
    if _requested(False):  # asked for on the command line: shown whatever the logging setup
        log.setLevel(logging.INFO)
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.propagate = False
    model.register_post_step_hook(_after_first_step)
    return tracker


def _after_first_step(model: DistributedModel, optimizer: Any) -> None:
    """Log the report once the first step's optimizer step is done (its state then exists)."""
    if optimizer is None:
        log.info("%s", memory_report(model).format())
        return
    original = optimizer.step
    instance_level = "step" in vars(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        if instance_level:
            optimizer.step = original
        else:
            del optimizer.step
        out = original(*args, **kwargs)
        log.info("%s", memory_report(model).format())
        return out

    optimizer.step = step


def _optimizer_tensors(optimizer: Any, model_params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's state tensors, and the parameters it steps that are not the model's (fp32
    masters of half-precision parameters)."""
    own = {id(p) for p in model_params}
    inner = getattr(optimizer, "optimizer", None)  # fp16/bf16: the user's optimizer, on the masters
    candidates = [optimizer, inner]
    for opt in (optimizer, inner):
        sharding = sharding_of(opt) if opt is not None else None
        if sharding is not None and sharding.zero is not None:  # ZeRO-1: this rank's share
            candidates.append(sharding.zero.optim)
    found: list[torch.Tensor] = []
    for opt in candidates:
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        for s in opt.state.values():
            found += [v for v in s.values() if isinstance(v, torch.Tensor)]
        found += [p for g in opt.param_groups for p in g["params"] if id(p) not in own]
    return found


def memory_report(model: DistributedModel | None = None) -> MemoryReport:
    """This rank's memory now: its parameters, their gradients, the optimizer state, and the peak
    activations of the traced steps (None unless ``trace_memory_usage=True`` or ``MP_MEMORY_REPORT=1``).
    Local: no collective, any rank may call it at any time."""
    model = state.model if model is None else model
    if model is None:
        raise DistributedModelNotWrappedError(
            "smp.memory_report() reports a DistributedModel's memory; got no model. Call it after "
            "smp.DistributedModel(model)"
        )
    return local_report(model.module, model.placement, model.memory_trace, state.optimizer)


def local_report(
    module: nn.Module, placement: Placement, tracker: ActivationTracker | None, optimizer: Any
) -> MemoryReport:
    """The memory report of this rank's part of ``module`` (by ``placement``): its parameters and
    gradients, ``optimizer``'s state (None: no optimizer) and ``tracker``'s peak activations."""
    params: list[torch.Tensor] = list(placement.local_parameters(module))
    on_cuda = torch.cuda.is_available() and any(p.is_cuda for p in params)
    return MemoryReport(
        rank=state.require()[1].rank,
        parameters=tensor_bytes(params),
        gradients=tensor_bytes(p.grad for p in params if p.grad is not None),
        optimizer_state=tensor_bytes(_optimizer_tensors(optimizer, params)) if optimizer is not None else 0,
        peak_activations=tracker.peak if tracker is not None else None,
        device_peak=torch.cuda.max_memory_allocated() if on_cuda else None,
    )
