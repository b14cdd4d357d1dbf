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
from mp.plan.tp_profile import TPActivations

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
    leading_activation_bytes: int = 0
    """The part of ``activation_bytes`` outside layers that runs before the stage's first layer (an
    embedding's); the rest outside layers (a head's, a loss's) has been freed by its backward when the
    stage's layers are recomputed."""
    traffic: float = 0.0
    """Forward bytes read and written by operations other than matrix products (fp32, as profiled)."""
    activation_tp: int = 1
    """The activation fields are those of one rank of a TP group of this size, profiled on mp's
    distributed model (:func:`mp.plan.tp_profile.profile_tp`); 1: the model as built (the estimate
    divides them by the layout's tp)."""


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


def _leading(profile: ModelProfile) -> set[str]:
    """Modules outside the layers that run before the first layer: the trace's call tree in call order
    (depth first), up to the first layer. A module that contains layers (the model, its stack) counts as
    running after them: its own operations around the layers are a loss or a head in the models mp
    runs (an embedding is a child of its own)."""
    trace = profile.trace
    blocks = set(profile.block_paths)
    if trace is None or not blocks:
        return set()
    out: set[str] = set()
    stack = [""]
    while stack:
        path = stack.pop()
        if path in blocks:
            return out
        if not any(_under(b, path) or not path for b in blocks):
            out.add(path)
        stack.extend(reversed(trace.execution_order.get(path, ())))
    return out


def split_stages(
    profile: ModelProfile,
    pp: int,
    memory_weight: float | None = None,
    tp_activations: TPActivations | None = None,
) -> tuple[StageProfile, ...]:
    """The ``pp`` stages mp's auto-partition makes of the profiled model (``memory_weight``: α, default
    smp's 0.8 as without measured times). With ``tp_activations`` (mp's distributed model profiled at a
    TP degree), the stages' activations are one rank's of that TP group: each layer's that of the
    distributed layer in its place, and what lies outside the layers scaled as the distributed model's
    outside compares with the original's (exact at pp=1, where one stage holds all of it)."""
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
    leading = _leading(profile)
    block_of: dict[str, str] = {}
    for block in profile.block_paths:
        for path in profile.params:
            if _under(path, block):
                block_of[path] = block
    acts = dict(profile.activation_bytes)
    if tp_activations is not None:
        layer_of = {b: i for i, b in enumerate(profile.block_paths)}
        outside_total = sum(b for p, b in acts.items() if p not in block_of)
        ratio = tp_activations.outside_bytes / outside_total if outside_total else 0.0
        for p, value in acts.items():
            if p not in block_of:
                acts[p] = round(value * ratio)
            else:  # a layer's bytes on its root path, 0 on the paths under it
                acts[p] = tp_activations.layer_bytes[layer_of[block_of[p]]] if p == block_of[p] else 0
    out = []
    for s in range(pp):
        paths = [p for p, d in assignment.items() if d == s]
        per_block: dict[str, int] = {}
        for p in paths:
            if p in block_of:
                per_block[block_of[p]] = per_block.get(block_of[p], 0) + acts.get(p, 0)
        out.append(
            StageProfile(
                index=s,
                params=sum(profile.params[p] for p in paths),
                param_tensors=sum(profile.param_tensors.get(p, 0) for p in paths),
                activation_bytes=sum(acts.get(p, 0) for p in paths),
                block_activation_bytes=sum(per_block.values()),
                max_block_activation_bytes=max(per_block.values(), default=0),
                leading_activation_bytes=sum(
                    acts.get(p, 0) for p in paths if p in leading and p not in block_of
                ),
                flops=sum(profile.flops.get(p, 0.0) for p in paths),
                traffic=sum(profile.traffic.get(p, 0.0) for p in paths),
                layers=sum(1 for b in profile.block_paths if assignment.get(b) == s),
                remote_calls=calls[s],
                activation_tp=tp_activations.tp if tp_activations is not None else 1,
            )
        )
    return tuple(out)
