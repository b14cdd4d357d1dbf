"""Activation memory per rank under tensor parallelism, from the distributed model mp actually runs.

Under ``tensor_parallel_degree`` > 1 mp replaces a model's registered modules by its distributed ones
(:func:`mp_tensor.replace_modules`: a Hugging Face GPT-2 becomes a whole distributed stack, a BERT layer a
``DistributedTransformerLayer``, ...). Those save different tensors for backward than the original
modules: sharded projections and heads, but also full-size activations where the layout gathers them
(``optimize="speed"`` keeps the layer norms and residuals replicated on every rank), and other kernels
(``scaled_dot_product_attention`` in place of eager attention). Dividing the original model's activations
by ``tp`` misses all of that, so the planner profiles the replacement itself: a copy of the profiled model
is replaced for a TP group of ``tp`` ranks held by torch's fake process group (every collective returns at
once with the right shapes, nothing is communicated), and one forward pass is traced on the profile's
device (the meta device for big models) as :func:`mp.plan.profile_model` traces the original.

The result, per rank: the activation bytes of each layer of the distributed model (in order; they stand
for the original's layers one to one) and of everything outside the layers, for one sample of the TP
group (with ``prescaled_batch`` off every rank feeds its own samples, so the group works on ``tp`` of them
per traced sample and the bytes are divided by ``tp``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from torch import nn

from mp.plan.errors import PlanError
from mp.plan.profile import ModelProfile, block_paths

__all__ = ["TPActivations", "profile_tp"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPActivations:
    """Activation bytes per rank of a TP group of ``tp`` ranks, for one sample of the group (fp32)."""

    tp: int
    optimize: str
    prescaled_batch: bool
    layer_bytes: tuple[int, ...]
    """Each layer of the distributed model, in order."""
    outside_bytes: int
    """Everything outside the layers (embeddings, head, loss)."""
    replaced: tuple[str, ...]
    """Classes mp replaced (empty: nothing distributable; the original model runs, divided by tp)."""


def _layers(root: nn.Module, count: int) -> tuple[str, ...]:
    """The distributed model's layers: its ModuleLists' (as :func:`mp.plan.profile.block_paths` finds
    the original's), else the children of the first ``nn.Sequential`` holding ``count`` of them (mp's
    distributed transformers chain their layers in ``seq_layers``)."""
    found = block_paths(root)
    if len(found) == count:
        return found
    for path, module in root.named_modules():
        if isinstance(module, nn.Sequential) and len(module) == count:
            kids = [
                f"{path}.{i}" if path else str(i)
                for i, c in enumerate(module)
                if any(True for _ in c.parameters())
            ]
            if len(kids) == count:
                return tuple(kids)
    return found


def profile_tp(
    profile: ModelProfile, tp: int, *, optimize: str = "speed", prescaled_batch: bool = True
) -> TPActivations | None:
    """The activations of the distributed model mp builds for ``profile``'s model at tensor degree ``tp``
    (see the module docstring). None when it cannot be profiled here: a process group already exists
    in this process (the fake one must be the default group), or the distributed model's layers do not
    pair one to one with the original's; the planner then divides the original's activations by
    ``tp`` and logs why."""
    if tp < 2:
        raise PlanError(f"profile_tp got tp={tp}: expected a tensor-parallel degree >= 2")
    import torch
    import torch.distributed as dist

    from mp_partition import trace_model
    from mp_tensor import TPContext, replace_modules

    if dist.is_initialized():
        _log.info(
            "tensor-parallel activations of %s not profiled: this process already has a process group "
            "(the planner's fake TP group must be the default one); dividing the model's by tp=%d",
            profile.name,
            tp,
        )
        return None
    # torch's fake process group: collectives complete at once with the right shapes
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend

    device = next((p.device for p in profile.model.parameters()), torch.device("meta"))
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=tp)
    try:
        net = copy.deepcopy(profile.model)
        ctx = TPContext(group=dist.group.WORLD, optimize=optimize, prescaled_batch=prescaled_batch)  # type: ignore[arg-type]
        before = {type(m) for m in net.modules()}
        with torch.device(device):
            root: nn.Module = replace_modules(net, ctx, default_enabled=True)
        replaced = tuple(sorted({type(m).__name__ for m in root.modules()} - {t.__name__ for t in before}))
        root.train()
        trace = trace_model(root, profile.example_args, profile.example_kwargs)
    finally:
        dist.destroy_process_group()
    if not replaced:
        _log.warning(
            "mp has no distributed implementation for any module of %s: at tp=%d every rank would run "
            "the whole model (its activations are profiled so), while parameters and FLOPs are still "
            "divided by tp; register one (smp.tp_register) or plan without tensor parallelism (tp=1)",
            profile.name,
            tp,
        )
    layers = _layers(root, len(profile.block_paths))
    if len(layers) != len(profile.block_paths):
        _log.info(
            "tensor-parallel activations of %s not profiled: the distributed model has %d layers, the "
            "original %d; dividing the model's by tp=%d",
            profile.name,
            len(layers),
            len(profile.block_paths),
            tp,
        )
        return None
    own = {p: trace.activation_bytes(p) for p, _ in root.named_modules()}  # each module's own saves
    per_layer = [
        sum(b for p, b in own.items() if p == layer or p.startswith(layer + ".")) for layer in layers
    ]
    outside = sum(own.values()) - sum(per_layer)
    div = 1 if prescaled_batch else tp  # without prescaled_batch the group works on tp samples per rank's one
    out = TPActivations(
        tp=tp,
        optimize=optimize,
        prescaled_batch=prescaled_batch,
        layer_bytes=tuple(b // div for b in per_layer),
        outside_bytes=outside // div,
        replaced=replaced,
    )
    _log.info(
        "tensor-parallel activations of %s at tp=%d (%s%s): %.3g MB per rank and sample (replaced: %s)",
        profile.name,
        tp,
        optimize,
        ", prescaled" if prescaled_batch else "",
        (sum(out.layer_bytes) + out.outside_bytes) / 1e6,
        ", ".join(replaced) or "nothing",
    )
    return out
