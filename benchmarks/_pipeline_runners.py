"""The runners that train the variants of benchmarks/pipeline_vs_torch.py, on each rank.

A variant (:class:`benchmarks._pipeline_variants.Spec`) is a system (single process, mp or
torch.distributed.pipelining), its schedule and the microbatch count; :func:`make_runner` builds its
runner. Every runner starts from the same
initial weights (``base``), trains on the same global batch with AdamW and is built and closed on both
ranks (collectively where the system needs it). A step is timed between two :func:`idle_barrier` calls,
and :class:`CpuMeter` says where each rank's CPU went meanwhile.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from benchmarks._launch import on_all_cores
from benchmarks._pipeline_gpt import GPT, BackStage, GPTConfig, StageProbe
from benchmarks._pipeline_variants import BOTH_RANKS, Spec

__all__ = [
    "CpuMeter",
    "CpuSample",
    "MpRunner",
    "Runner",
    "SingleRunner",
    "TorchRunner",
    "make_runner",
]


class Runner(Protocol):
    """One system's training steps on this rank (:func:`make_runner` builds them)."""

    stage_times: dict[str, list[float]]
    probe: StageProbe | None

    def first_step(self) -> tuple[float | None, dict[str, Any]]:
        """One training step; (the loss where this rank knows it, this rank's gradients before the
        optimizer step)."""

    def step(self) -> None: ...

    def close(self) -> None: ...


_TICK = 0.01  # /proc clock ticks (USER_HZ is 100 on Linux)


def _thread_cpu(native_id: int) -> float:
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK  # utime, stime (fields 14 and 15 of stat)


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds this rank used over a window: in all, in its main thread, in mp's MPI progress thread."""

    total: float
    main: float
    progress: float


class CpuMeter:
    """CPU time of this process over a window, split into the main thread, the mp-comm MPI progress thread
    (found by name) and the rest (mp's module-server workers, gloo's threads)."""

    def start(self) -> None:
        self._progress = [
            t.native_id
            for t in threading.enumerate()
            if t.name.startswith("mp-comm-mpi") and t.native_id is not None
        ]
        self._t0 = (_process_cpu(), time.thread_time(), sum(_thread_cpu(i) for i in self._progress))

    def stop(self) -> CpuSample:
        total, main, progress = self._t0
        return CpuSample(
            total=_process_cpu() - total,
            main=time.thread_time() - main,
            progress=sum(_thread_cpu(i) for i in self._progress) - progress,
        )


def _model(cfg: GPTConfig, base: dict[str, torch.Tensor]) -> GPT:
    model = GPT(cfg)
    model.load_state_dict(base)
    return model


def _grads(named: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + n: p.grad.detach().clone() for n, p in named if p.grad is not None}


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """`n` torch threads for the block; with more than one, on all the host's cores (the ranks are
    bound to one each: see _launch.on_all_cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with on_all_cores() if n > 1 else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(before)


class SingleRunner:
    """Plain PyTorch on rank 0 (rank 1 does nothing): the full batch at once (m = 1), or ``m``
    accumulated microbatches run stage by stage with each stage timed.

    With ``both_ranks`` rank 1 trains its own copy at the same time, with no communication: the control
    that measures how much two processes computing at once slow each other down on this host (what
    any two-stage pipeline's stages pay too, beyond the bubble)."""

    def __init__(
        self,
        cfg: GPTConfig,
        base: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        rank: int,
        m: int,
        threads: int,
        lr: float,
        both_ranks: bool = False,
    ) -> None:
        self.active = rank == 0 or both_ranks
        self.probe: StageProbe | None = None
        self.m = m
        self.stage_times: dict[str, list[float]] = {k: [] for k in ("f0", "f1", "b1", "b0", "opt")}
        self.x, self.y = x, y
        self.xs, self.ys = x.chunk(m), y.chunk(m)
        self.threads = threads
        if self.active:
            self.model = _model(cfg, base)
            if m > 1 and not both_ranks:  # the probe's analysis expects one rank's events
                self.probe = StageProbe(self.model)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def _forward_backward(self) -> float:
        if self.m == 1:
            loss = self.model(self.x, self.y)
            loss.backward()
            return float(loss)
        total = 0.0
        parts = {k: 0.0 for k in ("f0", "f1", "b1", "b0")}
        for xm, ym in zip(self.xs, self.ys, strict=True):
            t0 = time.perf_counter()
            h = self.model.front(xm)
            t1 = time.perf_counter()
            h_in = h.detach().requires_grad_()
            loss = self.model.back(h_in, ym) / self.m
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            h.backward(h_in.grad)
            t4 = time.perf_counter()
            total += float(loss)
            for k, v in (("f0", t1 - t0), ("f1", t2 - t1), ("b1", t3 - t2), ("b0", t4 - t3)):
                parts[k] += v / self.m
        for k, v in parts.items():
            self.stage_times[k].append(v)
        return total

    def _optimize(self) -> None:
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.m > 1:
            self.stage_times["opt"].append(time.perf_counter() - t0)

    def first_step(self) -> tuple[float | None, dict[str, torch.Tensor]]:
        if not self.active:
            return None, {}
        with _threads(self.threads):
            loss = self._forward_backward()
            grads = _grads(self.model.named_parameters())
            self._optimize()
        return loss, grads

    def step(self) -> None:
        if not self.active:
            return
        with _threads(self.threads):
            self._forward_backward()
            self._optimize()

    def close(self) -> None:
        pass


class MpRunner:
    """mp: smp.init / DistributedModel / DistributedOptimizer / @smp.step, front on pp_rank 0 and back
    on pp_rank 1 by manual partitioning."""

    def __init__(
        self,
        cfg: GPTConfig,
        base: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        m: int,
        schedule: str,
        lr: float,
    ) -> None:
        """``schedule``: "simple" or "interleaved", with " static" for static mode, or with " active N"
        for ``active_microbatches`` N (otherwise smp's default, pp + 2)."""
        import mp as smp

        self.stage_times: dict[str, list[float]] = {}
        self.static = schedule.endswith(" static")
        words = schedule.split()
        config: dict[str, Any] = {
            "pipeline_parallel_degree": 2,
            "microbatches": m,
            "pipeline": words[0],
            "auto_partition": False,
            "default_partition": 0,
            "static_mode": self.static,
        }
        if "active" in words:
            config["active_microbatches"] = int(words[words.index("active") + 1])
        smp.init(config)
        net = _model(cfg, base)
        self.probe: StageProbe | None = StageProbe(net)
        smp.set_partition(net.front, 0)
        smp.set_partition(net.back, 1)
        self.model = smp.DistributedModel(net)
        self.opt = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=lr))
        self.x, self.y = x, y

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = model(x, y)
            model.backward(loss)
            return loss  # type: ignore[no-any-return]

        self.train_step = train_step

    def first_step(self) -> tuple[float | None, dict[str, torch.Tensor]]:
        out = self.train_step(self.model, self.x, self.y)
        loss = float(out.reduce_mean())
        net = self.model.module
        grads = _grads((n, p) for n, p in net.named_parameters() if self.model.is_local_parameter(p))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.static:  # the steps static mode records before it replays (also warm-up)
            from mp_pipeline.static import default_record_steps

            for _ in range(default_record_steps()):
                self.step()
        return loss, grads

    def step(self) -> None:
        self.train_step(self.model, self.x, self.y)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        import mp as smp

        smp.reset()


class TorchRunner:
    """torch.distributed.pipelining: PipelineStage on front (rank 0) / back (rank 1), ScheduleGPipe or
    Schedule1F1B, ``back.loss`` as the schedule's loss_fn; each rank steps AdamW on its stage."""

    def __init__(
        self,
        cfg: GPTConfig,
        base: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        rank: int,
        m: int,
        schedule: str,
        lr: float,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.stage_times: dict[str, list[float]] = {}
        self.rank = rank
        net = _model(cfg, base)
        self.probe: StageProbe | None = StageProbe(net)
        self.module: torch.nn.Module = net.front if rank == 0 else BackStage(net.back)
        self.prefix = "front." if rank == 0 else ""  # BackStage's parameters are already back.*
        stage = PipelineStage(self.module, rank, 2, torch.device("cpu"))
        kind = ScheduleGPipe if schedule == "GPipe" else Schedule1F1B
        self.schedule = kind(stage, m, loss_fn=net.back.loss)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self.x, self.y = x, y

    def _run(self) -> float | None:
        if self.rank == 0:
            self.schedule.step(self.x)
            return None
        losses: list[torch.Tensor] = []
        self.schedule.step(target=self.y, losses=losses)
        return float(torch.stack([t.detach() for t in losses]).mean())

    def first_step(self) -> tuple[float | None, dict[str, torch.Tensor]]:
        loss = self._run()
        grads = _grads(self.module.named_parameters(), self.prefix)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss, grads

    def step(self) -> None:
        self._run()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


def make_runner(
    spec: Spec,
    *,
    cfg: GPTConfig,
    base: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    lr: float,
) -> Runner:
    if spec.system == "single":
        return SingleRunner(
            cfg,
            base,
            x,
            y,
            rank=rank,
            m=spec.m,
            threads=spec.threads,
            lr=lr,
            both_ranks=spec.schedule == BOTH_RANKS,
        )
    if spec.system == "mp":
        return MpRunner(cfg, base, x, y, m=spec.m, schedule=spec.schedule, lr=lr)
    if spec.system == "torch":
        return TorchRunner(cfg, base, x, y, rank=rank, m=spec.m, schedule=spec.schedule, lr=lr)
    raise ValueError(f"unknown system {spec.system!r}; expected single, mp or torch")
