"""mp-plan: choose a layout for a model on a cluster and predict its step time and memory.

    import mp
    result = mp.plan("gpt2-xl", cluster="a100-40gb", hosts=2, global_batch=512, seq_len=1024)
    print(result.report())
    result.best.layout.config()      # the mp config of the top layout, for mp-launch --config

The planner joins mp's parts: the model is built and traced on the meta device as ``mp-partition`` does
(:mod:`mp.plan.profile`), split into stages by mp's auto-partition (:mod:`mp.plan.stages`), costed with
ATP's collective model and the pipeline schedule simulator (:mod:`mp.plan.estimate`) on a cluster preset
(:mod:`mp.plan.cluster`), searched (:mod:`mp.plan.search`) and reported (:mod:`mp.plan.report`,
``mp-plan`` in :mod:`mp.plan.cli`). ``mp.plan`` is both this package and the function :func:`plan`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mp.plan.cluster import PRESETS, Cluster, calibrate_cpu, get_cluster
from mp.plan.errors import PlanError
from mp.plan.estimate import Estimate, Layout, MemoryBreakdown, TimeBreakdown, estimate
from mp.plan.profile import ModelProfile, profile_model
from mp.plan.search import SearchSpace, search
from mp.plan.stages import StageProfile, split_stages
from mp.plan.tp_profile import TPActivations, profile_tp

__all__ = [
    "PRESETS",
    "Cluster",
    "Estimate",
    "Layout",
    "MemoryBreakdown",
    "ModelProfile",
    "PlanError",
    "PlanResult",
    "SearchSpace",
    "StageProfile",
    "TPActivations",
    "TimeBreakdown",
    "calibrate_cpu",
    "estimate",
    "get_cluster",
    "plan",
    "profile_model",
    "profile_tp",
    "search",
    "split_stages",
]


@dataclass(frozen=True)
class PlanResult:
    """The ranked estimates (fitting layouts first, by predicted step time) and what they were made of."""

    profile: ModelProfile
    cluster: Cluster
    global_batch: int
    estimates: tuple[Estimate, ...]

    @property
    def fitting(self) -> tuple[Estimate, ...]:
        return tuple(e for e in self.estimates if e.fits)

    @property
    def best(self) -> Estimate:
        """The top layout; :class:`PlanError` when none fits."""
        if not self.fitting:
            worst = self.estimates[0]
            raise PlanError(
                f"no layout of {self.profile.name} fits {self.cluster.name} x {self.cluster.world}: the "
                f"smallest needs {worst.memory.total / 1e9:.1f} GB per device, over "
                f"{self.cluster.device_memory_bytes / 1e9:.1f} GB; add hosts, allow checkpointing/offloading/"
                "sharding, or lower the batch or sequence length"
            )
        return self.fitting[0]

    def config(self) -> dict[str, Any]:
        """The top layout's mp config, checked by mp's config validation."""
        from mp.plan.report import checked_config

        return checked_config(self.best)

    def report(self, top: int = 10) -> str:
        from mp.plan.report import format_estimates

        p = self.profile
        title = (
            f"mp-plan: {p.name} ({p.num_parameters / 1e9:.3g}B parameters, {p.layers} layers, hidden "
            f"{p.hidden}), global batch {self.global_batch} x seq {p.seq_len}"
        )
        shown = list(self.fitting) or list(self.estimates)
        return format_estimates(shown, self.cluster, top=top, title=title, searched=len(self.estimates))


def plan(
    model: str | ModelProfile,
    *,
    global_batch: int,
    seq_len: int = 1024,
    cluster: str | Cluster = "a100-40gb",
    hosts: int | None = None,
    devices_per_host: int | None = None,
    precision: str | None = None,
    pp: int | None = None,
    tp: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    checkpointing: bool | None = None,
    offload: bool | None = None,
    shard_optimizer_state: bool | None = None,
    sdp: bool | None = None,
    memory_weight: float | None = None,
    overrides: Mapping[str, Any] | None = None,
    factory_kwargs: Mapping[str, Any] | None = None,
    decoder_seq_len: int | None = None,
    hidden: int | None = None,
    overlap_dp: bool | None = None,
    zero1_reduce_scatter: bool = False,
    optimize: str = "speed",
    prescaled_batch: bool = True,
) -> PlanResult:
    """Plans ``model`` (HF preset/model_type/config path or ``package.module:factory``, or a profile)
    for ``global_batch`` sequences of ``seq_len`` on ``cluster``; any fixed option pins that choice.

    ``precision`` defaults to bf16 on GPU presets and fp32 on ``cpu``. ``overlap_dp`` (None: as mp
    does, see :func:`mp.plan.estimate.estimate`) says whether the data-parallel reduction hides behind
    the last backward; ``zero1_reduce_scatter`` costs ``shard_optimizer_state`` as smp ran it (gradients
    reduced to their owner) instead of as mp runs it (all-reduced). ``optimize`` and
    ``prescaled_batch``: mp's settings of those keys for layouts with tp > 1 (what its distributed
    layers keep per rank, profiled on them: :mod:`mp.plan.tp_profile`).
    """
    clus = get_cluster(cluster, hosts=hosts, devices_per_host=devices_per_host)
    if precision is None:
        precision = "fp32" if clus.name == "cpu" else "bf16"
    if precision not in ("fp32", "fp16", "bf16"):
        raise PlanError(f"precision {precision!r} is invalid: expected 'fp32', 'fp16' or 'bf16'")
    if optimize not in ("speed", "memory"):
        raise PlanError(f"optimize {optimize!r} is invalid: expected 'speed' or 'memory'")
    if schedule not in (None, "interleaved", "simple"):
        raise PlanError(f"schedule {schedule!r} is invalid: expected 'interleaved' or 'simple'")
    prof = (
        model
        if isinstance(model, ModelProfile)
        else profile_model(
            model,
            seq_len=seq_len,
            overrides=overrides,
            factory_kwargs=factory_kwargs,
            decoder_seq_len=decoder_seq_len,
            hidden=hidden,
        )
    )
    space = SearchSpace(
        pp=pp,
        tp=tp,
        microbatches=microbatches,
        schedule=schedule,  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        checkpointing=checkpointing,
        offload=offload,
        shard_optimizer_state=shard_optimizer_state,
        sdp=sdp,
        tp_optimize=optimize,  # type: ignore[arg-type]
        prescaled_batch=prescaled_batch,
    )
    found = search(
        prof,
        clus,
        global_batch=global_batch,
        space=space,
        memory_weight=memory_weight,
        overlap_dp=overlap_dp,
        zero1_reduce_scatter=zero1_reduce_scatter,
    )
    return PlanResult(profile=prof, cluster=clus, global_batch=global_batch, estimates=tuple(found))


class _CallableModule(types.ModuleType):
    """``mp.plan(...)`` calls :func:`plan`; ``mp.plan.X`` is this package's X."""

    def __call__(self, *args: Any, **kwargs: Any) -> PlanResult:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
