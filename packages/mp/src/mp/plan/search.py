"""The layout search: every layout of the cluster's devices that the options allow, estimated and ranked.

Pipeline degrees divide the world; tensor degrees divide what is left, stay within a host and divide the
hidden size; the rest is data parallelism. Micro-batch counts are divisors of each replica's batch
from pp up, doubling, the schedules mp's two, and the memory savers every combination
mp's config accepts (sharded data parallelism only without a pipeline, as smp; offloading only with
checkpointing). Layouts are ranked by predicted step time among those that fit in device memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from mp.plan.cluster import Cluster
from mp.plan.errors import PlanError
from mp.plan.estimate import Estimate, Layout, Precision, Schedule, estimate
from mp.plan.profile import ModelProfile
from mp.plan.stages import StageProfile, split_stages
from mp.plan.tp_profile import TPActivations, profile_tp

__all__ = ["SearchSpace", "search"]

_log = logging.getLogger(__name__)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatch_choices(per_replica: int, pp: int, limit: int) -> list[int]:
    """Divisors of the replica's batch from ``pp`` up, doubling (``pp``, ``2 pp``, ``4 pp``, ...), and
    the whole batch split into single samples: at most ``limit`` of them."""
    divs = [d for d in _divisors(per_replica) if d >= pp]
    picked: list[int] = []
    for d in divs:
        if not picked or d >= 2 * picked[-1]:
            picked.append(d)
    if divs and divs[-1] not in picked:
        picked.append(divs[-1])
    return picked[: limit - 1] + picked[-1:] if len(picked) > limit else picked


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the search may choose; a fixed value (not None) pins that choice."""

    pp: int | None = None
    tp: int | None = None
    microbatches: int | None = None
    schedule: Schedule | None = None
    precision: Precision = "fp32"
    checkpointing: bool | None = None
    offload: bool | None = None
    shard_optimizer_state: bool | None = None
    sdp: bool | None = None
    active_microbatches: int | None = None
    max_microbatch_choices: int = 6
    tp_optimize: Literal["speed", "memory"] = "speed"
    """mp's ``optimize`` for tp > 1 (not searched)."""
    prescaled_batch: bool = True
    """mp's ``prescaled_batch`` for tp > 1 (not searched)."""

    def layouts(self, cluster: Cluster, global_batch: int, hidden: int, max_pp: int) -> Iterator[Layout]:
        world = cluster.world
        pps = [self.pp] if self.pp is not None else [p for p in _divisors(world) if p <= max_pp]
        for pp in pps:
            if world % pp:
                raise PlanError(
                    f"pp={pp} does not divide the cluster's {world} devices: expected a divisor of {world}"
                )
            tps = (
                [self.tp]
                if self.tp is not None
                else [t for t in _divisors(world // pp) if t <= cluster.devices_per_host and hidden % t == 0]
            )
            for tp in tps:
                if (world // pp) % tp:
                    raise PlanError(
                        f"tp={tp} does not divide the {world // pp} devices left by pp={pp}: "
                        "expected a divisor"
                    )
                rdp = world // (pp * tp)
                if global_batch % rdp:
                    continue
                per_replica = global_batch // rdp
                if self.microbatches is not None:
                    ms = [self.microbatches] if per_replica % self.microbatches == 0 else []
                else:
                    ms = _microbatch_choices(per_replica, pp, self.max_microbatch_choices)
                ckpts = [self.checkpointing] if self.checkpointing is not None else [False, True]
                for m in ms:
                    schedules: Sequence[Schedule] = (
                        [self.schedule]
                        if self.schedule is not None
                        else (["interleaved", "simple"] if m > 1 else ["simple"])
                    )
                    for schedule in schedules:
                        for ckpt in ckpts:
                            offloads = (
                                [self.offload]
                                if self.offload is not None
                                else ([False, True] if ckpt else [False])
                            )
                            for off in offloads:
                                if off and not ckpt:
                                    continue
                                for zero1, sdp in self._sharding(pp, rdp):
                                    active = self.active_microbatches
                                    if active is not None and active > m:
                                        active = m
                                    yield Layout(
                                        pp=pp,
                                        tp=tp,
                                        rdp=rdp,
                                        microbatches=m,
                                        schedule=schedule,
                                        active_microbatches=active,
                                        precision=self.precision,
                                        checkpointing=ckpt,
                                        offload=off,
                                        shard_optimizer_state=zero1,
                                        sdp=sdp,
                                        tp_optimize=self.tp_optimize,
                                        prescaled_batch=self.prescaled_batch,
                                    )

    def _sharding(self, pp: int, rdp: int) -> list[tuple[bool, int]]:
        out: list[tuple[bool, int]] = []
        zero1s = [self.shard_optimizer_state] if self.shard_optimizer_state is not None else [False, True]
        for z in zero1s:
            if z and rdp == 1 and self.shard_optimizer_state is None:
                continue
            out.append((z, 1))
        if self.sdp is not False and pp == 1 and rdp > 1 and not self.shard_optimizer_state:
            out.append((False, rdp))
        if self.sdp is True:
            out = [o for o in out if o[1] > 1]
        return out


def search(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    global_batch: int,
    space: SearchSpace,
    memory_weight: float | None = None,
    overlap_dp: bool | None = None,
    zero1_reduce_scatter: bool = False,
) -> list[Estimate]:
    """Every layout's estimate, the fitting ones first, each group by predicted step time."""
    if global_batch < 1:
        raise PlanError(f"global batch {global_batch!r} is invalid: expected an int >= 1")
    max_pp = max(1, min(profile.layers or 1, cluster.world))
    stages: dict[tuple[int, int], tuple[StageProfile, ...]] = {}
    tp_acts: dict[int, TPActivations | None] = {}
    out: list[Estimate] = []
    for layout in space.layouts(cluster, global_batch, profile.hidden, max_pp):
        key = (layout.pp, layout.tp)
        if key not in stages:
            if layout.tp > 1 and layout.tp not in tp_acts:  # what mp's distributed model keeps per rank
                tp_acts[layout.tp] = profile_tp(
                    profile, layout.tp, optimize=space.tp_optimize, prescaled_batch=space.prescaled_batch
                )
            stages[key] = split_stages(profile, layout.pp, memory_weight, tp_acts.get(layout.tp))
        out.append(
            estimate(
                layout,
                stages[key],
                cluster,
                global_batch=global_batch,
                seq_len=profile.seq_len,
                hidden=profile.hidden,
                overlap_dp=overlap_dp,
                zero1_reduce_scatter=zero1_reduce_scatter,
            )
        )
    if not out:
        raise PlanError(
            f"no layout of {cluster.world} devices takes a global batch of {global_batch}: expected a batch "
            "divisible by the data-parallel degree; change the batch, the cluster or the pinned degrees"
        )
    _log.info("estimated %d layouts", len(out))
    out.sort(key=lambda e: (not e.fits, e.step_time, e.memory.total))
    return out
