"""The cost model: one layout's step time and per-device memory, from its stages and the cluster.

Per micro-batch of ``b`` samples, stage ``s`` (holding ``L_s`` layers, forward FLOPs ``F_s`` per sample):

* compute: forward ``b F_s / (tp R)``, backward twice that, plus one more forward when activation
  checkpointing recomputes it (``R``: the cluster's sustained FLOP/s); the operations other than matrix
  products add their bytes moved (``b M_s / tp`` forward, in the step's precision) at the cluster's
  ``elementwise_bandwidth``, with the same factors;
* tensor parallelism: the collectives of ATP's equation 2 for a 1-D mesh of ``tp`` devices
  (:func:`mp_tensor.atp.search.t_comm`: two all-reduces of ``b s h`` elements per layer forward, two
  backward, two more when the forward is recomputed), plus ``2 (tp - 1)`` latencies per all-reduce;
* pipeline p2p: ``b s h`` elements per stage boundary and direction, at the link's bandwidth and latency;
* pipeline calls: the cluster's ``call_overhead`` for each call of a stage's modules from another stage
  (mp's runtime: a request and a response forward, the same backward), half on the stage's forward,
  half on its backward;

and the schedule simulator (:func:`mp_pipeline.schedule.simulate`, the runtime's scheduler) orders the
micro-batches' forward and backward work over the stages: its makespan holds the bubble. After it, the
data-parallel gradient synchronization (ring all-reduce; with sharded data parallelism a reduce-scatter of
gradients and two all-gathers of parameters; under ``shard_optimizer_state`` the all-reduce and then
each rank's broadcast of the parameters it stepped, one per parameter tensor, as torch's
``ZeroRedundancyOptimizer`` does; what the last micro-batch's backward hides of it where mp
overlaps it, see ``overlap_dp``), and the optimizer
step (parameters and states streamed through device memory once). Activation offloading is taken as
overlapped with compute (its traffic is reported, not added). On a host with more ranks than CPU cores
(``Cluster.cores_per_host``) the ranks take turns: the step lasts at least the host's work (each rank's
forward and backward work, reduction and optimizer step) over its cores.

Memory per device, for the stage that needs most: parameters, gradients, fp32 master copies (mixed
precision) and Adam's two states, each divided by ``tp``; the master copies and optimizer state also by
the data-parallel degree under ``shard_optimizer_state``, everything by it under sharded data
parallelism; activations of the micro-batches in flight (the simulator's peak), one rank's of mp's
distributed model when the stages were profiled at the layout's ``tp`` (else the model's divided by
``tp``), halved in fp16/bf16; with checkpointing only each layer's input (``b s h`` elements) and what
runs outside the layers per micro-batch, and at the recompute of a layer in backward that layer's
activations in place of what its micro-batch ran after its layers (freed by then: a head's, a loss's),
whichever peak is higher; with offloading only ``activation_loading_horizon`` micro-batches'
checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from mp.plan.cluster import Cluster
from mp.plan.errors import PlanError
from mp.plan.stages import StageProfile

__all__ = ["Estimate", "Layout", "MemoryBreakdown", "TimeBreakdown", "estimate"]

Precision = Literal["fp32", "fp16", "bf16"]
Schedule = Literal["interleaved", "simple"]

_ADAM_STATES = 2
"""Adam/AdamW keep two fp32 states per parameter (exp_avg, exp_avg_sq)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run the model: degrees, micro-batching and memory savers."""

    pp: int
    tp: int
    rdp: int
    """Data-parallel replicas of the pipeline x tensor-parallel group (smp's rdp_size)."""
    microbatches: int
    schedule: Schedule = "interleaved"
    active_microbatches: int | None = None
    """None: mp's default min(pp + 2, microbatches)."""
    precision: Precision = "fp32"
    checkpointing: bool = False
    offload: bool = False
    shard_optimizer_state: bool = False
    sdp: int = 1
    """sharded_data_parallel_degree (1: off)."""
    activation_loading_horizon: int = 4
    tp_optimize: Literal["speed", "memory"] = "speed"
    """mp's ``optimize`` under tensor parallelism (what its distributed layers keep per rank)."""
    prescaled_batch: bool = True
    """mp's ``prescaled_batch`` under tensor parallelism (the TP group shares one batch)."""

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.rdp

    @property
    def half(self) -> bool:
        return self.precision != "fp32"

    def label(self) -> str:
        savers = [
            name
            for name, on in (
                ("ckpt", self.checkpointing),
                ("offload", self.offload),
                ("zero1", self.shard_optimizer_state),
                (f"sdp{self.sdp}", self.sdp > 1),
            )
            if on
        ]
        return (
            f"pp{self.pp} tp{self.tp} dp{self.rdp} m{self.microbatches} {self.schedule} {self.precision}"
            + ("".join(" " + s for s in savers))
        )

    def config(self) -> dict[str, Any]:
        """The mp (smp) config of this layout, for ``mp-launch --config``. Activation checkpointing is
        not a config key: the script applies it (``smp.set_activation_checkpointing``)."""
        cfg: dict[str, Any] = {
            "pipeline_parallel_degree": self.pp,
            "tensor_parallel_degree": self.tp,
            "microbatches": self.microbatches,
            "pipeline": self.schedule,
            "ddp": True,
        }
        if self.active_microbatches is not None:
            cfg["active_microbatches"] = self.active_microbatches
        if self.tp > 1:
            cfg["prescaled_batch"] = self.prescaled_batch
            cfg["optimize"] = self.tp_optimize
        if self.precision == "fp16":
            cfg["fp16"] = True
        elif self.precision == "bf16":
            cfg["bf16"] = True
        if self.offload:
            cfg["offload_activations"] = True
            cfg["activation_loading_horizon"] = self.activation_loading_horizon
        if self.shard_optimizer_state:
            cfg["shard_optimizer_state"] = True
        if self.sdp > 1:
            cfg["sharded_data_parallel_degree"] = self.sdp
        return cfg


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the device of the stage that needs most."""

    stage: int
    parameters: float
    gradients: float
    master: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.master + self.optimizer + self.activations


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one step on the critical stage, by cause (they sum to the step time)."""

    compute: float
    tp_comm: float
    p2p: float
    bubble: float
    dp_comm: float
    optimizer: float
    calls: float = 0.0
    """mp's pipeline runtime's cost of the remote calls (``Cluster.call_overhead`` each)."""
    memory_bound: float = 0.0
    """The operations other than matrix products, at ``Cluster.elementwise_bandwidth``."""
    shared_cores: float = 0.0
    """Waiting for a core: a host with more ranks than CPU cores (``Cluster.cores_per_host``) runs them
    in turn, and the step lasts at least the host's work over its cores."""

    @property
    def total(self) -> float:
        parts = (self.compute, self.tp_comm, self.p2p, self.calls, self.bubble, self.dp_comm, self.optimizer)
        return sum(parts) + self.memory_bound + self.shared_cores

    def bottleneck(self) -> str:
        parts = {
            "compute": self.compute,
            "TP collectives": self.tp_comm,
            "p2p": self.p2p,
            "pipeline bubble": self.bubble,
            "DP all-reduce": self.dp_comm,
            "optimizer step": self.optimizer,
            "pipeline calls": self.calls,
            "memory-bound ops": self.memory_bound,
            "shared cores": self.shared_cores,
        }
        return max(parts, key=lambda k: parts[k])


@dataclass(frozen=True)
class Estimate:
    """The prediction for one layout."""

    layout: Layout
    global_batch: int
    microbatch_size: int
    step_time: float
    time: TimeBreakdown
    memory: MemoryBreakdown
    fits: bool
    device_memory: int
    in_flight: int
    offload_bytes_per_step: float
    spans: tuple[tuple[int, int, str, float, float], ...] = field(default=(), repr=False)
    """(stage, microbatch, "FWD"/"BWD", start, end) of the simulated pipeline."""

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_time

    @property
    def bubble_fraction(self) -> float:
        return self.time.bubble / self.step_time


def _allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: 2 (n-1)/n of the buffer over the link, 2 (n-1) latencies."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def _group_link(cluster: Cluster, inner: int, size: int) -> tuple[float, float]:
    """Bandwidth and latency per device of a group of ``size`` devices spaced ``inner`` apart in rank
    order (TP innermost, then PP, then DP, as mp places them): within a host when the group's span fits
    one host, else over the host's NICs, shared by its devices."""
    if inner * size <= cluster.devices_per_host or cluster.hosts == 1:
        return cluster.intra_bandwidth, cluster.intra_latency
    share = min(cluster.devices_per_host, inner)
    return cluster.inter_bandwidth / share, cluster.inter_latency


def estimate(
    layout: Layout,
    stages: tuple[StageProfile, ...],
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    hidden: int,
    overlap_dp: bool | None = None,
    zero1_reduce_scatter: bool = False,
) -> Estimate:
    """Predicts the step time and peak memory of ``layout`` (see the module docstring).

    ``overlap_dp``: whether the data-parallel reduction overlaps the last micro-batch's backward; None
    follows mp (``overlapping_allreduce`` is on by default and applies without tensor parallelism) on
    a cluster whose devices overlap communication with compute. ``zero1_reduce_scatter``: under
    ``shard_optimizer_state``, reduce each gradient to the rank that steps it (smp's way, its paper's
    Appendix H.1) instead of mp's all-reduce; the parameters' broadcast follows either way.
    """
    from mp_pipeline import simulate
    from mp_tensor import ModelShape, algorithm_bandwidth, t_comm

    if len(stages) != layout.pp:
        raise PlanError(f"{len(stages)} stages given for pp={layout.pp}: expected one per pipeline stage")
    per_replica, rest = divmod(global_batch, layout.rdp * layout.microbatches)
    if rest or per_replica < 1:
        raise PlanError(
            f"global batch {global_batch} does not split into {layout.rdp} replicas x {layout.microbatches} "
            "microbatches: expected a multiple of their product; change the batch or the microbatches"
        )
    b, tp, half = per_replica, layout.tp, layout.half
    elt = 2 if half else 4
    rate = cluster.flops(half)
    act_bytes = b * seq_len * hidden * elt

    tp_bw, tp_lat = _group_link(cluster, 1, tp)
    algo = algorithm_bandwidth(tp_bw / 1e9, tp)
    pp_bw, pp_lat = _group_link(cluster, tp, 2) if layout.pp > 1 else (math.inf, 0.0)
    p2p = (act_bytes / pp_bw + pp_lat) if layout.pp > 1 else 0.0

    fwd: list[float] = []
    bwd: list[float] = []
    comp: list[float] = []
    mem_bound: list[float] = []
    tpc: list[float] = []
    p2ps: list[float] = []
    callc: list[float] = []
    for st in stages:
        f = b * st.flops / tp / rate
        f_mem = 0.0
        if cluster.elementwise_bandwidth > 0:  # memory-bound ops, divided over tp as the FLOPs are
            f_mem = b * st.traffic * (elt / 4) / tp / cluster.elementwise_bandwidth
        passes = 3 + (1 if layout.checkpointing else 0)  # forward, backward twice it, a recompute
        mem_bound.append(passes * f_mem)
        f += f_mem
        back = 2 * f + (f if layout.checkpointing else 0.0)
        t_tp = 0.0
        if tp > 1 and st.layers:
            shape = ModelShape(layers=st.layers, batch=b, seq=seq_len, hidden=hidden, bytes_per_element=elt)
            both = t_comm(shape, tp, 1, algo, math.inf)  # forward + backward all-reduces (4 per layer)
            n_allreduce = 4 * st.layers
            if layout.checkpointing:
                both *= 1.5
                n_allreduce = 6 * st.layers
            t_tp = both + n_allreduce * 2 * (tp - 1) * tp_lat
        t_tp_f = t_tp / (3 if layout.checkpointing else 2)
        send_f = p2p if st.index < layout.pp - 1 else 0.0
        send_b = p2p if st.index > 0 else 0.0
        calls = st.remote_calls * cluster.call_overhead if layout.pp > 1 else 0.0
        fwd.append(f + t_tp_f + send_f + calls / 2)
        bwd.append(back + (t_tp - t_tp_f) + send_b + calls / 2)
        callc.append(calls)
        comp.append(f + back - mem_bound[-1])
        tpc.append(t_tp)
        p2ps.append(send_f + send_b)

    active = layout.active_microbatches
    if active is None:  # mp's default (config key active_microbatches)
        active = min(layout.pp + 2, layout.microbatches)
    sim = simulate(
        layout.schedule,
        layout.microbatches,
        min(active, layout.microbatches),
        forward_costs=fwd,
        backward_costs=bwd,
    )
    makespan = sim.makespan
    crit = max(range(layout.pp), key=lambda s: fwd[s] + bwd[s])
    m = layout.microbatches
    busy = m * (fwd[crit] + bwd[crit])
    bubble = max(0.0, makespan - busy)

    # data parallelism and the optimizer, on the stage with the most parameters
    heavy = max(range(layout.pp), key=lambda s: stages[s].params)
    p_dev = stages[heavy].params / tp
    dp_bw, dp_lat = _group_link(cluster, tp * layout.pp, layout.rdp)
    grad_bytes = p_dev * elt
    # torch.distributed's collectives (ZeRO's broadcasts, FSDP2's gathers and reduce-scatters)
    c10d_bw = cluster.c10d_bandwidth or dp_bw
    c10d_lat = cluster.c10d_latency or dp_lat
    rs_bw = cluster.c10d_reduce_scatter_bandwidth or c10d_bw
    rs_lat = cluster.c10d_reduce_scatter_latency or c10d_lat
    if layout.sdp > 1:
        # FSDP2, a unit per layer and one for the rest: per unit an all-gather of parameters forward,
        # another backward, a reduce-scatter of gradients
        ranks = layout.rdp
        units = stages[heavy].layers + 1
        dp = (ranks - 1) / ranks * (2 * p_dev * elt / c10d_bw + grad_bytes / rs_bw)
        dp += units * (2 * c10d_lat + rs_lat)
    elif layout.shard_optimizer_state and zero1_reduce_scatter and layout.rdp > 1:
        ranks = layout.rdp  # each gradient reduced to its owner only (smp paper, Appendix H.1)
        dp = (ranks - 1) / ranks * grad_bytes / dp_bw + (ranks - 1) * dp_lat
    else:
        dp = _allreduce_time(grad_bytes, layout.rdp, dp_bw, dp_lat)
    after_step = 0.0
    if layout.shard_optimizer_state and layout.sdp == 1 and layout.rdp > 1:
        # torch's ZeroRedundancyOptimizer (mp's shard_optimizer_state): after the step each rank
        # broadcasts the parameters it stepped, one broadcast per parameter tensor
        ranks = layout.rdp
        after_step = (ranks - 1) / ranks * p_dev * elt / c10d_bw + stages[heavy].param_tensors * c10d_lat
    if overlap_dp is None:
        overlap_dp = cluster.overlaps_comm and tp == 1
    if overlap_dp:
        dp = max(0.0, dp - bwd[heavy])
    dp += after_step
    opt_shards = layout.rdp if (layout.shard_optimizer_state or layout.sdp > 1) else 1
    opt_bytes = p_dev / opt_shards * (elt + elt + (4 if half else 0) + 4 * _ADAM_STATES) * 2
    opt = opt_bytes / cluster.memory_bandwidth

    # memory of the stage that needs most
    in_flight = max(1, sim.peak_in_flight)
    best: MemoryBreakdown | None = None
    offload_traffic = 0.0
    for st in stages:
        p = st.params / tp
        shard = layout.sdp if layout.sdp > 1 else 1
        params_b = p * elt / shard
        grads_b = p * elt / shard
        master_b = (p * 4 if half else 0.0) / (shard * (layout.rdp if layout.shard_optimizer_state else 1))
        optim_b = p * 4 * _ADAM_STATES / (shard * (layout.rdp if layout.shard_optimizer_state else 1))
        if st.activation_tp not in (1, tp):
            raise PlanError(
                f"stage {st.index} holds activations profiled at tp={st.activation_tp} for a layout with "
                f"tp={tp}: expected 1 or {tp}; split the stages with that degree's tp_activations"
            )
        scale = b * (elt / 4) / (tp if st.activation_tp == 1 else 1)  # per rank already when profiled at tp
        if layout.checkpointing:
            kept = min(in_flight, layout.activation_loading_horizon) if layout.offload else in_flight
            outside = (st.activation_bytes - st.block_activation_bytes) * scale
            trailing = outside - st.leading_activation_bytes * scale
            ckpt = st.layers * act_bytes
            # the peak is either the end of a forward (every micro-batch in flight holds its layers'
            # inputs and what runs outside them) or the recompute of a layer in a backward: that
            # micro-batch has freed what ran after its layers and holds one layer's activations again
            acts = kept * (outside + ckpt) + max(0.0, st.max_block_activation_bytes * scale - trailing)
            if layout.offload:
                offload_traffic = max(offload_traffic, 2.0 * m * ckpt)
        else:
            acts = in_flight * st.activation_bytes * scale
        cand = MemoryBreakdown(st.index, params_b, grads_b, master_b, optim_b, acts)
        if best is None or cand.total > best.total:
            best = cand
    assert best is not None
    step = makespan + dp + opt
    shared = 0.0
    if cluster.ranks_per_core > 1:
        # the host's ranks compute on its cores in turn (one thread each): the step lasts at least their
        # work over the cores; one rank's waits (the bubble, a peer's collective) overlap another's work
        ranks_per_stage = tp * layout.rdp / cluster.hosts
        work = ranks_per_stage * sum(m * (fwd[s] + bwd[s]) + dp + opt for s in range(layout.pp))
        shared = max(0.0, work / cluster.cores_per_host - step)
    compute = m * comp[crit]
    time = TimeBreakdown(
        compute=compute,
        memory_bound=m * mem_bound[crit],
        tp_comm=m * tpc[crit],
        p2p=m * p2ps[crit],
        calls=m * callc[crit],
        bubble=bubble,
        dp_comm=dp,
        optimizer=opt,
        shared_cores=shared,
    )
    return Estimate(
        layout=layout,
        global_batch=global_batch,
        microbatch_size=b,
        step_time=step + shared,
        time=time,
        memory=best,
        fits=best.total <= cluster.device_memory_bytes,
        device_memory=cluster.device_memory_bytes,
        in_flight=in_flight,
        offload_bytes_per_step=offload_traffic,
        spans=tuple((s.stage, s.microbatch, s.phase.value, s.start, s.end) for s in sim.spans),
    )
