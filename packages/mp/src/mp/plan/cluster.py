"""Clusters the planner plans for: devices per host, hosts, memory, FLOP/s and the links between them.

The GPU presets hold published specifications (NVIDIA's data sheets for the SXM parts, AWS's instance
pages for the network of the p4d/p4de/p5/p5en hosts that carry them); the ``cpu`` preset describes this
kind of development host: its transport numbers come from mp's own benchmarks
(``benchmarks/results/comm_p2p.md``, ``comm_collectives.md``) and its FLOP/s from a short calibration
run (:func:`calibrate_cpu`), since a shared 2-core host has no data sheet.

``compute_efficiency`` is the fraction of peak FLOP/s that a training step sustains on large matrix
products. It is not a spec: for the GPUs it is 0.5, the order of what Megatron-LM reported for GPT
models on A100s (Narayanan et al., SC'21: 44-52% of peak across 1.7B-1T parameters, recomputation
counted as work), an independent published run, not one of the runs the planner is checked against.
That figure is a whole step's (its elementwise work, bubble and communication included), so as a rate
of the matrix products alone it is a lower bound. The operations other than matrix products are costed
apart, by the bytes they move at ``elementwise_bandwidth`` (the data sheet's memory bandwidth).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from mp.plan.errors import PlanError

__all__ = ["PRESETS", "Cluster", "calibrate_cpu", "get_cluster"]

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster. Bandwidths in bytes/s (one direction, per device), latencies in seconds."""

    name: str
    devices_per_host: int
    hosts: int
    device_memory_bytes: int
    """Memory one device offers to training (the context and communication buffers already taken out)."""
    peak_flops_half: float
    """Dense fp16/bf16 FLOP/s of one device."""
    peak_flops_fp32: float
    """Dense fp32 FLOP/s of one device (TF32 on the GPUs, as PyTorch's default matmul precision allows)."""
    compute_efficiency: float
    """Sustained fraction of peak on a training step's matrix products."""
    memory_bandwidth: float
    """Device memory bandwidth (the optimizer step streams parameters and states through it)."""
    intra_bandwidth: float
    """Per device, to another device of the same host (NVLink; shared memory on the CPU host)."""
    intra_latency: float
    inter_bandwidth: float
    """Per host, to the other hosts (the host's NICs together); devices of a host share it."""
    inter_latency: float
    offload_bandwidth: float
    """Device to host memory (PCIe), per device."""
    c10d_latency: float = 0.0
    """Seconds per call of a torch.distributed collective in the data-parallel group (what torch's
    ZeroRedundancyOptimizer and FSDP2 run under shard_optimizer_state and sdp; mp's own gradient
    reduction is not one); 0: the link's latency."""
    c10d_bandwidth: float = 0.0
    """Bytes/s of those collectives as a ring's bus bandwidth: a collective over ``n`` ranks moves
    ``(n - 1) / n`` of its buffer at this rate (a 2-rank benchmark's algorithm bandwidth, buffer / time,
    times 1/2); 0: the link's bandwidth."""
    c10d_reduce_scatter_latency: float = 0.0
    """Seconds per call of a torch.distributed reduce-scatter (FSDP2's gradients); 0: ``c10d_latency``."""
    c10d_reduce_scatter_bandwidth: float = 0.0
    """Bus bandwidth of a torch.distributed reduce-scatter (it also sums what it receives, and gloo's runs
    slower than its all-gather); 0: ``c10d_bandwidth``."""
    call_overhead: float = 0.0
    """Seconds a training step gains per call of a module on another pipeline stage (its forward
    request and response and its backward's), beyond the module's compute and the p2p transfer: mp's
    pipeline runtime's own cost per remote call. cpu: measured (pipeline_vs_torch.json, overhead
    section); h200: measured on one H200 (docs/gpu.md); the other GPU presets: 0, not measured there
    (pass one with ``with_``)."""
    elementwise_bandwidth: float = 0.0
    """Bytes/s at which a step's operations other than matrix products (elementwise, norms, softmax,
    dropout) move their data: each reads its inputs and writes its outputs in device memory, unfused, as
    eager PyTorch runs them (``ModelProfile.traffic``). GPU presets: the data sheet's memory bandwidth.
    0: not costed apart from ``compute_efficiency`` (the ``cpu`` preset's FLOP/s is calibrated on whole
    steps, which hold that work already)."""
    cores_per_host: int = 0
    """CPU cores per host that the ranks compute on, where the "devices" are CPU cores (the ``cpu``
    preset, one thread per rank as its calibration measures): a layout with more ranks on a host than
    it has cores time-shares them, and a step lasts at least the host's work over its cores
    (:func:`mp.plan.estimate.estimate`). 0: every device computes on its own (GPUs). ``calibrate_cpu``
    sets it to the CPUs the planning process may run on."""
    overlaps_comm: bool = True
    """Whether a collective runs beside compute (GPUs: on its own engine; the 2-core CPU host: no,
    benchmarks/results/dp_overlap.md measured the overlapped reduction 1.08x slower there)."""
    source: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source", "overlaps_comm"):
                continue
            if f.name == "cores_per_host":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise PlanError(
                        f"Cluster.cores_per_host={value!r} is invalid: expected an int >= 0 (0: a device "
                        "computes on its own)"
                    )
                continue
            if f.name in (
                "call_overhead",
                "c10d_latency",
                "c10d_bandwidth",
                "c10d_reduce_scatter_latency",
                "c10d_reduce_scatter_bandwidth",
                "elementwise_bandwidth",
            ):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise PlanError(
                        f"Cluster.{f.name}={value!r} is invalid: expected a number >= 0 (0: see the field)"
                    )
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise PlanError(
                    f"Cluster.{f.name}={value!r} is invalid: expected a positive number; "
                    f"pass it or start from a preset ({', '.join(sorted(PRESETS))})"
                )
        if not 0 < self.compute_efficiency <= 1:
            raise PlanError(
                f"Cluster.compute_efficiency={self.compute_efficiency!r} is invalid: expected (0, 1]"
            )

    @property
    def world(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def ranks_per_core(self) -> float:
        """Ranks per CPU core of a host when every device runs a rank (1: nothing time-shared)."""
        if self.cores_per_host <= 0:
            return 1.0
        return max(1.0, self.devices_per_host / self.cores_per_host)

    def flops(self, half: bool) -> float:
        """Sustained FLOP/s of one device."""
        return (self.peak_flops_half if half else self.peak_flops_fp32) * self.compute_efficiency

    def with_(self, **changes: object) -> Cluster:
        """A copy with some fields changed (hosts, devices_per_host, ...)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_RESERVED = 2 * _GIB
"""Device memory kept by the CUDA context, the allocator's fragmentation and NCCL's buffers."""

PRESETS: dict[str, Cluster] = {
    "a100-40gb": Cluster(
        name="a100-40gb",
        devices_per_host=8,
        hosts=1,
        device_memory_bytes=40 * _GIB - _RESERVED,
        peak_flops_half=312e12,
        peak_flops_fp32=156e12,
        compute_efficiency=0.5,
        memory_bandwidth=1.555e12,
        elementwise_bandwidth=1.555e12,
        intra_bandwidth=300e9,
        intra_latency=5e-6,
        inter_bandwidth=50e9,
        inter_latency=15e-6,
        offload_bandwidth=25e9,
        source="A100 SXM4 40GB data sheet; p4d.24xlarge: NVSwitch 600 GB/s (both directions), 400 Gb/s EFA",
    ),
    "a100-80gb": Cluster(
        name="a100-80gb",
        devices_per_host=8,
        hosts=1,
        device_memory_bytes=80 * _GIB - _RESERVED,
        peak_flops_half=312e12,
        peak_flops_fp32=156e12,
        compute_efficiency=0.5,
        memory_bandwidth=2.039e12,
        elementwise_bandwidth=2.039e12,
        intra_bandwidth=300e9,
        intra_latency=5e-6,
        inter_bandwidth=50e9,
        inter_latency=15e-6,
        offload_bandwidth=25e9,
        source="A100 SXM4 80GB data sheet; p4de.24xlarge: NVSwitch 600 GB/s, 400 Gb/s EFA",
    ),
    "h100": Cluster(
        name="h100",
        devices_per_host=8,
        hosts=1,
        device_memory_bytes=80 * _GIB - _RESERVED,
        peak_flops_half=989e12,
        peak_flops_fp32=494e12,
        compute_efficiency=0.5,
        memory_bandwidth=3.35e12,
        elementwise_bandwidth=3.35e12,
        intra_bandwidth=450e9,
        intra_latency=5e-6,
        inter_bandwidth=400e9,
        inter_latency=15e-6,
        offload_bandwidth=50e9,
        source="H100 SXM5 data sheet; p5.48xlarge: NVLink 900 GB/s, 3200 Gb/s EFA",
    ),
    "h200": Cluster(
        name="h200",
        devices_per_host=8,
        hosts=1,
        device_memory_bytes=141 * 10**9 - _RESERVED,
        peak_flops_half=989e12,
        peak_flops_fp32=494e12,
        compute_efficiency=0.5,
        memory_bandwidth=4.8e12,
        elementwise_bandwidth=4.8e12,
        intra_bandwidth=450e9,
        intra_latency=5e-6,
        inter_bandwidth=400e9,
        inter_latency=15e-6,
        offload_bandwidth=50e9,
        call_overhead=0.672e-3,
        source="H200 SXM data sheet; p5en.48xlarge: NVLink 900 GB/s, 3200 Gb/s EFA; 0.67 ms per remote "
        "call (docs/gpu.md: mp's per-call overhead on CUDA tensors, 2 ranks on one H200)",
    ),
    "cpu": Cluster(
        name="cpu",
        devices_per_host=2,
        hosts=1,
        device_memory_bytes=10 * _GIB,
        peak_flops_half=20e9,
        peak_flops_fp32=20e9,
        compute_efficiency=1.0,
        memory_bandwidth=10e9,
        intra_bandwidth=6e9,
        intra_latency=90e-6,
        inter_bandwidth=1e9,
        inter_latency=200e-6,
        offload_bandwidth=10e9,
        call_overhead=3.543e-3,
        c10d_latency=0.868e-3,
        c10d_bandwidth=0.845e9,
        c10d_reduce_scatter_latency=2.238e-3,
        c10d_reduce_scatter_bandwidth=0.373e9,
        overlaps_comm=False,
        source="this 2-core development host: p2p mp-mpi 6 GB/s and 90 us (comm_p2p.md); 3.5 ms per "
        "remote call (pipeline_vs_torch.md, per-call overhead: default config, every block on pp_rank 1, "
        "load 16-18); torch.distributed (gloo) collectives 0.87 ms and 0.85 GB/s of bus bandwidth, "
        "reduce-scatters 2.24 ms and 0.37 GB/s (comm_collectives.md, 2 ranks, 1 KB and 16 MB: 1.69 and "
        "0.75 GB/s of algorithm bandwidth); FLOP/s is a placeholder that calibrate_cpu() replaces "
        "by a measurement (mp-plan does so for --cluster cpu)",
    ),
}


def calibrate_cpu(cluster: Cluster | None = None, *, seconds: float = 0.5, size: int = 256) -> Cluster:
    """The ``cpu`` preset with its FLOP/s measured: float32 matmuls of ``size`` x ``size`` on one thread
    (a rank's share of the host, as mp-launch binds ranks) for about ``seconds``; ``cores_per_host``:
    the CPUs this process may run on (more ranks than that time-share them)."""
    import os

    import torch

    base = cluster or PRESETS["cpu"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        for _ in range(3):
            a @ b
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            n += 1
        rate = 2.0 * size**3 * n / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return base.with_(
        peak_flops_half=rate,
        peak_flops_fp32=rate,
        compute_efficiency=1.0,
        cores_per_host=cores,
        source=base.source.split("; FLOP/s")[0]
        + f"; FLOP/s measured now: {rate / 1e9:.1f} GFLOP/s per rank; {cores} cores",
    )


def get_cluster(
    name: str | Cluster, *, hosts: int | None = None, devices_per_host: int | None = None
) -> Cluster:
    """A preset by name (``a100-40gb``, ``a100-80gb``, ``h100``, ``h200``, ``cpu``), resized."""
    if isinstance(name, Cluster):
        base = name
    else:
        key = name.lower()
        if key not in PRESETS:
            raise PlanError(
                f"cluster {name!r} is unknown: expected one of {', '.join(sorted(PRESETS))}, or a Cluster"
            )
        base = PRESETS[key]
    changes: dict[str, object] = {}
    if hosts is not None:
        changes["hosts"] = hosts
    if devices_per_host is not None:
        changes["devices_per_host"] = devices_per_host
    return base.with_(**changes) if changes else base
