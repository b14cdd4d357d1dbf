"""`@smp.step`: run a function once per microbatch, pipelined, and return StepOutputs.

    @smp.step
    def train_step(model, data, target):
        loss = F.nll_loss(model(data), target)
        model.backward(loss)
        return loss

    loss = train_step(model, data, target).reduce_mean()

Works with or without parentheses, on module-level functions, closures and methods. Tensor arguments
are split along dim 0 (or ``input_split_axes[name]``) into ``microbatches`` slices (see
mp_pipeline.microbatch); the returned tensors become StepOutputs, other values per-microbatch lists.
Every rank calls the step; the function body runs on pp_rank 0 of each pipeline, and every rank of
the pipeline gets the results.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

from mp.errors import DistributedModelNotWrappedError, SMPValidationError, TensorSplitError
from mp.state import state
from mp_pipeline import (
    SplitError,
    SplitSpec,
    TaskContext,
    merge_microbatch_results,
    split_arguments,
    task_context,
)

__all__ = ["StepFunction", "step"]

_ACTIVE = threading.local()


class StepFunction:
    """A function decorated with ``@smp.step``."""

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        non_split_inputs: Sequence[str] | None = None,
        input_split_axes: Mapping[str, int] | None = None,
        detach_outputs: bool = True,
    ) -> None:
        if not callable(func):
            raise SMPValidationError(f"@smp.step needs a function; got {type(func).__name__}")
        try:
            self._spec = SplitSpec.for_function(func, non_split_inputs, input_split_axes)
        except SplitError as exc:
            raise TensorSplitError(str(exc)) from None
        self._func = func
        self._detach = detach_outputs
        functools.update_wrapper(self, func)

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cfg, _, _ = state.require()
        if getattr(_ACTIVE, "on", False):
            raise SMPValidationError(
                f"step function {self._func.__qualname__} was called inside another step function; "
                "call step functions from the training loop only"
            )
        try:
            inputs = split_arguments(self._spec, args, kwargs, cfg.microbatches)
        except SplitError as exc:
            raise TensorSplitError(str(exc)) from None
        model = state.model
        _ACTIVE.on = True
        try:
            if model is None:
                if cfg.pipeline_parallel_degree > 1:
                    raise DistributedModelNotWrappedError(
                        "a step function ran with pipeline_parallel_degree="
                        f"{cfg.pipeline_parallel_degree} but no smp.DistributedModel exists; wrap the "
                        "model with smp.DistributedModel(model) before the first step"
                    )
                results = []
                for mb, (a, k) in enumerate(inputs):
                    with task_context(TaskContext(mb, ("<step>",))):
                        results.append(self._func(*a, **k))
            else:
                with model.kv_cache.step():
                    results = model.run_step(self._func, inputs)
        finally:
            _ACTIVE.on = False
        return merge_microbatch_results(results, detach=self._detach)


@overload
def step(func: Callable[..., Any]) -> StepFunction: ...


@overload
def step(
    func: None = None,
    *,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
) -> Callable[[Callable[..., Any]], StepFunction]: ...


def step(
    func: Callable[..., Any] | None = None,
    *,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
) -> StepFunction | Callable[[Callable[..., Any]], StepFunction]:
    """Decorator for a training (or evaluation) step: ``@smp.step`` or ``@smp.step(...)``."""

    def wrap(f: Callable[..., Any]) -> StepFunction:
        return StepFunction(
            f,
            non_split_inputs=non_split_inputs,
            input_split_axes=input_split_axes,
            detach_outputs=detach_outputs,
        )

    if func is not None:
        return wrap(func)
    return wrap
