"""The pipeline stages of a model: mp's auto-partition of the profiled model, summed per stage.

For a pipeline degree ``pp`` the partitioner (:func:`mp_partition.auto_partition`, the algorithm the
runtime uses, on the profile's trace) assigns every module to a stage; each stage then carries the
parameters, activation bytes and forward FLOPs of its modules, and the layers (the model's repeated
blocks) it holds. Costs are those of one sample.
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


def _under(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def split_stages(
    profile: ModelProfile, pp: int, memory_weight: float | None = None
) -> tuple[StageProfile, ...]:
    """The ``pp`` stages mp's auto-partition makes of the profiled model (``memory_weight``: α, default
    smp's 0.8 as without measured times)."""
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
        assignment = {p: plan.assignment.get(p, 0) for p in profile.params}
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
                activation_bytes=sum(profile.activation_bytes.get(p, 0) for p in paths),
                block_activation_bytes=sum(per_block.values()),
                max_block_activation_bytes=max(per_block.values(), default=0),
                flops=sum(profile.flops.get(p, 0.0) for p in paths),
                layers=sum(1 for b in profile.block_paths if assignment.get(b) == s),
            )
        )
    return tuple(out)
