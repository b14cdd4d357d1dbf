"""The pipeline stages of a model: mp's auto-partition of the profiled model, summed per stage.

For a pipeline degree ``pp`` the partitioner (:func:`mp_partition.auto_partition`, the algorithm the
runtime uses, on the profile's trace) assigns every module to a stage; each stage then carries the
parameters, activation bytes and forward FLOPs of its modules, the layers (the model's repeated
blocks) it holds, and the remote calls it answers: the calls, per micro-batch, of its modules by a
module on another stage (the trace's call tree), each a request and a response in mp's pipeline
runtime. Costs are those of one sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from mp.plan.profile import ModelProfile

__all__ = ["StageProfile", "split_stages"]


@dataclass(frozen=True)
class StageProfile:
    """One pipeline stage, for one sample."""

    index: int
    params: int
    activation_bytes: int
    """Traced activation bytes of every module of the stage (fp32)."""
    block_activation_bytes: int
    """The part of ``activation_bytes`` inside layers (what activation checkpointing drops)."""
    max_block_activation_bytes: int
    """The largest single layer's activations (what recomputing one layer holds again)."""
    flops: float
    """Forward FLOPs."""
    layers: int
    param_tensors: int = 0
    """Parameter tensors of the stage."""
    remote_calls: int = 0
    """Calls per micro-batch of this stage's modules by a module on another stage (forward; each has
    its backward)."""


def _stage_of(path: str, assignment: dict[str, int]) -> int:
    """The stage of a module: its own, else its nearest assigned ancestor's (the root's: 0)."""
    while path not in assignment:
        if not path:
            return 0
        path = path.rpartition(".")[0]
    return assignment[path]


def _remote_calls(profile: ModelProfile, assignment: dict[str, int], pp: int) -> list[int]:
    """Per stage, how many calls of its modules come from a module on another stage (one sample's
    forward, from the trace's call tree: ``execution_order`` and each callee's call count)."""
    out = [0] * pp
    trace = profile.trace
    if trace is None or pp == 1:
        return out
    for caller, callees in trace.execution_order.items():
        here = _stage_of(caller, assignment)
        for callee in callees:
            there = _stage_of(callee, assignment)
            if there != here:
                out[there] += max(1, trace.stats(callee).calls)
    return out


def _under(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def split_stages(
    profile: ModelProfile, pp: int, memory_weight: float | None = None
) -> tuple[StageProfile, ...]:
    """The ``pp`` stages mp's auto-partition makes of the profiled model (``memory_weight``: α, default
    smp's 0.8 as without measured times)."""
    full: dict[str, int] = {}
    if pp == 1:
        assignment = {p: 0 for p in profile.params}
    else:
        from mp_partition import auto_partition

        plan = auto_partition(
            profile.model,
            pp,
            example_args=profile.example_args,
            example_kwargs=profile.example_kwargs,
            trace=profile.trace,
            memory_weight=memory_weight,
        )
        full = dict(plan.assignment)
        assignment = {p: _stage_of(p, full) for p in profile.params}
    calls = _remote_calls(profile, full, pp)
    block_of: dict[str, str] = {}
    for block in profile.block_paths:
        for path in profile.params:
            if _under(path, block):
                block_of[path] = block
    out = []
    for s in range(pp):
        paths = [p for p, d in assignment.items() if d == s]
        per_block: dict[str, int] = {}
        for p in paths:
            if p in block_of:
                per_block[block_of[p]] = per_block.get(block_of[p], 0) + profile.activation_bytes.get(p, 0)
        out.append(
            StageProfile(
                index=s,
                params=sum(profile.params[p] for p in paths),
                param_tensors=sum(profile.param_tensors.get(p, 0) for p in paths),
                activation_bytes=sum(profile.activation_bytes.get(p, 0) for p in paths),
                block_activation_bytes=sum(per_block.values()),
                max_block_activation_bytes=max(per_block.values(), default=0),
                flops=sum(profile.flops.get(p, 0.0) for p in paths),
                layers=sum(1 for b in profile.block_paths if assignment.get(b) == s),
                remote_calls=calls[s],
            )
        )
    return tuple(out)
