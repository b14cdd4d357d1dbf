"""mp's pipeline on models as users write them, against torch.distributed.pipelining and one process.

Four unmodified models (benchmarks/models.py): (a) a GPT whose ``forward`` loops over its
8 blocks (hidden 256, seq 128, vocab 1000, batch 16), (b) HF ``GPT2LMHeadModel`` (8 layers, n_embd 256,
vocab 1000), (c) HF ``T5ForConditionalGeneration`` (4 + 4 layers, d_model 256) and (d) a ResNet-style CNN
whose ``forward`` loops over its stages (ResNet-18's layout on 32x32 images, BatchNorm, batch 16). The
same initial weights, batch and AdamW for every system:

* ``mp``: what a user writes: ``smp.init({"pipeline_parallel_degree": 2, "microbatches": m})`` (every
  other key at its default: auto-partition, smp's default schedule), ``smp.DistributedModel(model)``,
  ``smp.DistributedOptimizer``, and an ``@smp.step`` function computing the loss as the user's script
  does (``F.cross_entropy(model(x), y)``, ``model(input_ids=x, labels=y).loss``) then
  ``model.backward(loss)``;
* ``torch GPipe`` / ``torch 1F1B``: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` on the best
  hand split found: the model as a chain of its own modules (embeddings, each block, head; the CNN's
  stem, residual blocks, head; T5's encoder and decoder), cut where the two stages' measured forward +
  backward times are closest;
* ``mp zero_bubble``: the same mp model with ``"pipeline": "zero_bubble"``'s one difference switched
  on for its steps (each owner splits a remote call's backward and runs the weight half while it would
  wait: the runtime's ``remote.weights`` queue), so that both mp rows interleave in one process (mp's
  config is global); its first step is not the model's first, so its loss is not compared (the
  equality is tests/integration/test_pipeline_zero_bubble.py's);
* ``torch ZBV``: torch's zero-bubble schedule (``ScheduleZBVZeroBubble``) on the hand split into 2p
  pieces, two stages per rank in a V (rank r holds stages r and 2p - 1 - r), chosen as above;
* ``single``: one process without pipeline on the full batch with 1 and 2 threads, and the batch as
  ``m`` accumulated microbatches on 1 thread (``single acc``, the bubble bound's reference).

pp = 2 on 2 ranks (the script starts itself under mpiexec, each rank bound to a core of its own as
mp-launch binds them; see _launch.py), m in {4, 8, 16}. ``--pp p`` runs p ranks (p stages; torch's hand
split then has p - 1 cuts, chosen the same way: the slowest stage fastest). ``--device cuda`` puts every
system's model and batch on the GPU (each rank on ``local_rank % GPUs``; ranks sharing one GPU need
``MP_SHARE_GPUS=1``, and torch's stages then send through gloo with the CUDA tensors staged through host
memory), ``--size`` changes the model's sizes (``hidden=1024,seq=512,batch=16``) and ``--systems`` runs a
subset (``single acc``, the reference of the loss check, always runs).

Before timing, every system's first-step loss is compared with the single process's on the same
microbatches (a mismatch stops the run), and mp's partition is printed. Per (model, m), every runner is
built once (mp's then runs untimed steps until it replays its learned program, the path of a user's steady
state), then ``--rounds`` rounds each time ``--steps`` steps of every runner in a rotating order (a
step is timed between two barriers that sleep while they wait). Reported per system: samples/s (median
step), the ratios vs torch 1F1B and vs the single process on 1 thread (paired per round, median over
rounds), each rank's busy fraction (the share of the step it computed: mp's from its pipeline timeline,
compute with its waits cut out; torch's from its stages' forward, loss and backward calls) and the
efficiency against the bubble bound, as in pipeline_vs_torch.py: ``T1 / p * (m + p - 1) / m`` over the
measured step, ``T1`` the ``single acc`` step of the same round.

    python -m benchmarks.pipeline_users [--models gpt cnn] [--microbatches 4 8] [--rounds 5] [--steps 2]
    python -m benchmarks.pipeline_users --smoke      # tiny sizes, 1 round, results in a temporary folder
    python -m benchmarks.pipeline_users --pp 4 --models gpt gpt2 --microbatches 8 --rounds 3

The last timed step of mp, mp zero_bubble, torch 1F1B and torch ZBV is also split per rank into compute,
waiting for a peer and the runtime's own time (benchmarks/_pipeline_where.py): the table "where the time
went" under each model's. ``--timeline [M ...]`` draws those steps, stacked, one row per rank, as
``pipeline_users_<model>_m<M>.png`` beside the results (``--timeline`` alone: every m >= 8 of the run).

Writes benchmarks/results/pipeline_users.json and .md (``--out`` elsewhere; both files are rewritten after
each (model, m), so a run cut short keeps what it finished). A full run takes about 10-15 minutes on a
quiet 2-core host.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._launch import on_all_cores, relaunch, rotated, under_mpi

HERE = Path(__file__).resolve().parent
P = 2
"""The default pipeline degree (--pp); the run's own is ``Run.p``."""
LR = 1e-4
SEED = 1234
SYSTEMS = (
    "mp",
    "mp zero_bubble",
    "torch 1F1B",
    "torch GPipe",
    "torch ZBV",
    "single 1 thread",
    "single 2 threads",
    "single acc",
)
OBSERVED = ("mp", "mp zero_bubble", "torch 1F1B", "torch ZBV")
"""The systems whose last timed step is split per rank (the table "where the time went", --timeline)."""


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with on_all_cores() if n > 1 else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(before)


class Single:
    """Plain PyTorch on rank 0 (rank 1 waits): the full batch, or ``m`` accumulated microbatches."""

    def __init__(self, case: Any, base: dict[str, Any], rank: int, *, m: int, threads: int) -> None:
        import torch

        self.case, self.m, self.threads, self.active = case, m, threads, rank == 0
        if self.active:
            self.model = case.build()
            self.model.load_state_dict(base)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def _step(self) -> float:
        total = 0.0
        for mb in zip(*(t.chunk(self.m) for t in self.case.batch), strict=True):
            loss = self.case.user_loss(self.model, mb) / self.m
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def first_step(self) -> float | None:
        return self.step()

    def step(self) -> float | None:
        if not self.active:
            return None
        with _threads(self.threads):
            return self._step()

    def close(self) -> None:
        pass


class Torch:
    """torch.distributed.pipelining: this rank's stage of the hand split, GPipe or 1F1B."""

    def __init__(
        self, case: Any, base: dict[str, Any], rank: int, *, m: int, cuts: list[int], schedule: str
    ) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from benchmarks._pipeline_where import LOSS, ActionClock
        from benchmarks.models import Chain
        from mp_pipeline.timeline import EventKind

        self.case, self.rank, self.last = case, rank, len(cuts)
        model = case.build()
        model.load_state_dict(base)
        pieces = case.pieces(model)
        bounds = [0, *cuts, len(pieces)]
        self.module = Chain(pieces[bounds[rank] : bounds[rank + 1]])
        device = case.batch[0].device
        if device.type == "cuda":
            from benchmarks._launch import stage_cuda_p2p_through_host

            stage_cuda_p2p_through_host()
            device = torch.device("cuda", torch.cuda.current_device())
        self.stage = PipelineStage(self.module, rank, len(bounds) - 1, device)
        self.busy, self.clock = 0.0, ActionClock(rank)
        for name, action in (("forward_one_chunk", EventKind.FWD), ("backward_one_chunk", EventKind.BWD)):
            timed = self.clock.wrap(self, getattr(self.stage, name), action, f"stage {rank}")
            setattr(self.stage, name, timed)  # compute, without the waits around it
        kind = ScheduleGPipe if schedule == "GPipe" else Schedule1F1B
        loss_fn = self.clock.wrap(self, case.loss_fn, EventKind.FWD, LOSS)  # the loss: compute too
        self.schedule = kind(self.stage, m, loss_fn=loss_fn)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)

    def step(self) -> float | None:
        import torch

        loss = None
        losses: list[torch.Tensor] = []
        with self.clock.step():
            if self.rank == 0:
                self.schedule.step(*self.case.stage_args(self.case.batch))
            elif self.rank < self.last:
                self.schedule.step()
            else:
                self.schedule.step(target=self.case.target(self.case.batch), losses=losses)
        if self.rank == self.last:
            loss = float(torch.stack([t.detach() for t in losses]).mean())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    first_step = step

    def close(self) -> None:
        pass


class TorchZBV:
    """torch.distributed.pipelining's ZBV zero-bubble schedule: this rank's two stages of the hand split
    into ``2p`` pieces (rank r: stages r and 2p - 1 - r; the first and the last stage on rank 0)."""

    def __init__(
        self, case: Any, base: dict[str, Any], rank: int, *, m: int, cuts: list[int], p: int
    ) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

        from benchmarks._pipeline_where import LOSS, WEIGHTS, ActionClock
        from benchmarks.models import Chain
        from mp_pipeline.timeline import EventKind

        self.case, self.rank = case, rank
        model = case.build()
        model.load_state_dict(base)
        pieces = case.pieces(model)
        bounds = [0, *cuts, len(pieces)]
        n = len(bounds) - 1
        assert n == 2 * p, f"{n} stages for {p} ranks: expected two per rank"
        device = case.batch[0].device
        if device.type == "cuda":
            from benchmarks._launch import stage_cuda_p2p_through_host

            stage_cuda_p2p_through_host()
            device = torch.device("cuda", torch.cuda.current_device())
        self.modules = [Chain(pieces[bounds[s] : bounds[s + 1]]) for s in (rank, n - 1 - rank)]
        stages: list[Any] = [
            PipelineStage(mod, s, n, device)
            for mod, s in zip(self.modules, (rank, n - 1 - rank), strict=True)
        ]
        self.busy, self.clock = 0.0, ActionClock(rank)
        for stage, s in zip(stages, (rank, n - 1 - rank), strict=True):
            for name, action, module in (
                ("forward_one_chunk", EventKind.FWD, f"stage {s}"),
                ("backward_one_chunk", EventKind.BWD, f"stage {s}"),  # the input half
                ("backward_weight_one_chunk", EventKind.BWD, f"stage {s}{WEIGHTS}"),
            ):
                setattr(stage, name, self.clock.wrap(self, getattr(stage, name), action, module))
        loss_fn = self.clock.wrap(self, case.loss_fn, EventKind.FWD, LOSS)
        self.schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
        params = [q for mod in self.modules for q in mod.parameters()]
        self.opt = torch.optim.AdamW(params, lr=LR)

    def step(self) -> float | None:
        import torch

        loss = None
        losses: list[torch.Tensor] = []
        with self.clock.step():
            if self.rank == 0:  # the first and the last stage
                self.schedule.step(
                    *self.case.stage_args(self.case.batch),
                    target=self.case.target(self.case.batch),
                    losses=losses,
                )
            else:
                self.schedule.step()
        if self.rank == 0:
            loss = float(torch.stack([t.detach() for t in losses]).mean())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    first_step = step

    def close(self) -> None:
        pass


class MpZeroBubble:
    """The "mp" runner's model with zero_bubble's split backward on for its steps (see the docstring)."""

    def __init__(self, mp: Any, p: int) -> None:
        from mp_pipeline import WeightQueue

        self.mp, self.queue, self.busy = mp, WeightQueue(p), 0.0

    def step(self) -> float:
        runtime = self.mp.model.runtime
        runtime.remote.weights = self.queue
        try:
            return float(self.mp.step())
        finally:
            runtime.remote.weights = None

    def first_step(self) -> None:
        self.step()

    def close(self) -> None:
        pass


class Mp:
    """mp as a user runs it: default config but for pp and microbatches, the model wrapped as is."""

    def __init__(
        self, case: Any, base: dict[str, Any], rank: int, *, m: int, p: int, extra: dict[str, Any]
    ) -> None:
        import torch

        import mp as smp

        smp.init({"pipeline_parallel_degree": p, "microbatches": m, **extra})
        # Untimed warm-up, so that every timed step runs the path of a user's steady state: per-rank
        # replay (the default) records steps 3 and 4 and replays from step 5 once they agree; static and
        # fast mode replay from the step after their recording.
        self.warmup = 7 if extra.get("static_mode") or extra.get("fast_mode") else 3
        net = case.build()
        net.load_state_dict(base)
        self.model = smp.DistributedModel(net)
        self.opt = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=LR))
        self.batch, self.rank, self.busy = case.batch, rank, 0.0

        @smp.step
        def train_step(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            loss: torch.Tensor = case.user_loss(model, batch)
            model.backward(loss)
            return loss

        self.train_step = train_step

    def step(self) -> float:
        loss = float(self.train_step(self.model, self.batch).reduce_mean())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def first_step(self) -> float:
        loss = self.step()
        for _ in range(self.warmup):
            self.step()
        return loss

    def partition(self) -> dict[str, int]:
        """Where execution crosses ranks: each module whose pp_rank differs from its parent's."""
        plan = self.model.plan
        if plan is not None:
            return dict(plan.split_points())
        a = dict(self.model.placement.assignment)  # ranks without the plan hold only the assignment
        return {p: r for p, r in a.items() if p and a.get(p.rpartition(".")[0], a.get("", 0)) != r}

    def close(self) -> None:
        import mp as smp

        smp.reset()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _round_ratio(rounds: dict[int, dict[str, float]], a: str, b: str, f: Any) -> float | None:
    return _median([f(r[a], r[b]) for r in rounds.values() if a in r and b in r])


def summarize(records: list[dict[str, Any]], batch: dict[str, int], p: int = P) -> list[dict[str, Any]]:
    """One row per (model, m, system): medians, paired ratios, busy fractions, bubble efficiency."""
    rows = []
    keys = sorted({(r["model"], r["m"]) for r in records}, key=lambda k: (k[0], k[1]))
    for model, m in keys:
        mine = [r for r in records if r["model"] == model and r["m"] == m]
        rounds: dict[int, dict[str, float]] = {}
        for rnd in sorted({r["round"] for r in mine}):
            by: dict[str, list[float]] = {}
            for r in mine:
                if r["round"] == rnd:
                    by.setdefault(r["system"], []).append(r["step_s"])
            rounds[rnd] = {s: statistics.median(v) for s, v in by.items()}
        for system in SYSTEMS:
            steps = [r for r in mine if r["system"] == system]
            if not steps:
                continue
            pipelined = system.startswith(("mp", "torch"))

            def bubble(t: float, acc: float, m: int = m) -> float:
                return acc / p * (m + p - 1) / m / t

            rows.append(
                {
                    "model": model,
                    "m": m,
                    "system": system,
                    "steps_timed": len(steps),
                    "step_ms": _median([r["step_s"] * 1e3 for r in steps]),
                    "samples_per_s": _median([batch[model] / r["step_s"] for r in steps]),
                    "vs_torch_1f1b": _round_ratio(rounds, system, "torch 1F1B", lambda a, b: b / a),
                    "vs_single_1_thread": _round_ratio(rounds, system, "single 1 thread", lambda a, b: b / a),
                    "busy": [_median([r["busy"][i] for r in steps]) for i in range(p)] if pipelined else None,
                    "efficiency_bubble": _round_ratio(rounds, system, "single acc", bubble)
                    if pipelined
                    else None,
                }
            )
    return rows


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(out: dict[str, Any]) -> str:
    p = int(out["args"].get("pp", P))
    device = out["args"].get("device", "cpu")
    where = "CPU, 1 thread and 1 core each" if device == "cpu" else f"{device}, 1 CPU thread and core each"
    busy_head = "busy r0/r1" if p == 2 else f"busy r0..r{p - 1}"
    lines = [
        "# mp's pipeline on unmodified models (benchmarks/pipeline_users.py)",
        "",
        f"pp = {p} on {p} ranks ({where}), {out['args']['rounds']} interleaved rounds of "
        f"{out['args']['steps']} step(s) per system; commit {out['host']['commit'][:10] or '?'}; host "
        f"load average (1 min) {out['host']['load_before']:.2f} before, {out['host']['load_after']:.2f} "
        f"after, {out['host']['cpus']} CPUs; {out['elapsed_s']:.0f} s.",
        "",
        "*vs torch 1F1B*, *vs single 1t*: that system's step time over this one's, paired per round "
        f"(> 1: this one is faster). *{busy_head}*: share of the step each rank computed. *eff. bubble*: "
        f"`T1 / {p} * (m + {p - 1}) / m` over the step, `T1` the single process's step on the same m "
        f"microbatches (1.00: a perfect {'two' if p == 2 else p}-stage pipeline). torch's split: the best "
        f"whole-piece cut{'' if p == 2 else 's'}, measured.",
    ]
    for model, info in out["models"].items():
        lines += ["", f"## {model}: {info['describe']}", ""]
        if out["args"].get("mp_config"):
            lines.append(f"- mp config beyond the default: `{json.dumps(out['args']['mp_config'])}`")
        for m, split in info["torch_split"].items():
            lines.append(f"- m = {m}: torch's hand split {split}; mp's partition: {info['mp_partition'][m]}")
            if m in info.get("torch_zbv_split", {}):
                lines.append(f"- m = {m}: torch ZBV's split {info['torch_zbv_split'][m]}")
        lines += [
            "",
            f"| m | system | samples/s | vs torch 1F1B | vs single 1t | {busy_head} | eff. bubble |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in out["rows"] if r["model"] == model):
            busy = "/".join(_fmt(v) for v in r["busy"]) if r["busy"] else "-"
            cells = [str(r["m"]), r["system"], _fmt(r["samples_per_s"], ".1f"), _fmt(r["vs_torch_1f1b"])]
            cells += [_fmt(r["vs_single_1_thread"]), busy, _fmt(r["efficiency_bubble"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines += _where_lines(info.get("where", {}), p)
    return "\n".join(lines) + "\n"


def _where_lines(where: dict[Any, dict[str, list[dict[str, Any]]]], p: int) -> list[str]:
    """The table "where the time went" of one model (``info["where"]``: m -> system -> ranks)."""
    from benchmarks._pipeline_where import RankTime, cause

    if not where:
        return []
    lines = [
        "",
        "Where the time went, the last timed step of each pipelined system (ms per rank): *compute* = "
        "its actions (mp: the recorder's executions, on pp_rank 0 the step function's forward and "
        "backward, less the runtime's path of each call to another rank; torch: its stages' forward, loss "
        "and backward calls), *waiting* = blocked receiving from a peer outside any action, *own* = the "
        "rest of its step (scheduling, messages, the guard and posting of each call).",
        "",
        "| m | system | rank | step | compute | waiting | own | beyond compute |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, systems in where.items():
        for system, ranks in systems.items():
            for d in ranks:
                t = RankTime(**d)
                cells = [str(m), system, str(t.rank)]
                cells += [f"{v:.1f}" for v in (t.step, t.compute, t.wait, t.own)]
                lines.append("| " + " | ".join([*cells, cause(t, p)]) + " |")
    return lines


@dataclass
class Run:
    """What one rank carries through the run: its communicator, the records and what rank 0 reports."""

    comm: Any
    rank: int
    args: argparse.Namespace
    records: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_markdown: str = ""

    @property
    def p(self) -> int:
        return int(self.args.pp)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def _hand_split(run: Run, case: Any, model: Any, m: int, stages: int = 0) -> tuple[list[int], str]:
    """torch's cuts into ``stages`` pieces (default: one per rank) for ``m`` microbatches (measured on
    rank 0, shared) and their description."""
    from benchmarks.models import best_cuts, piece_times

    times = run.comm.bcast(piece_times(case, model, m) if run.rank == 0 else None, root=0)
    cuts = best_cuts(times, stages or run.p)
    spans = list(itertools.pairwise([0, *cuts, len(times)]))
    ranges = " | ".join(f"{a}-{b - 1}" for a, b in spans)
    ms = " | ".join(f"{sum(times[a:b]) * 1e3:.1f}" for a, b in spans)
    return cuts, f"pieces {ranges} of {len(times)} ({ms} ms)"


def _build(run: Run, case: Any, base: dict[str, Any], m: int, cuts: list[int]) -> dict[str, Any]:
    """Every system's runner for ``m`` (those of --systems, and ``single acc``), each after its first
    step; the losses checked, mp's partition recorded."""
    rank = run.rank
    makers: dict[str, Any] = {
        "single acc": lambda: Single(case, base, rank, m=m, threads=1),
        "single 1 thread": lambda: Single(case, base, rank, m=1, threads=1),
        "single 2 threads": lambda: Single(case, base, rank, m=1, threads=2),
        "torch GPipe": lambda: Torch(case, base, rank, m=m, cuts=cuts, schedule="GPipe"),
        "torch 1F1B": lambda: Torch(case, base, rank, m=m, cuts=cuts, schedule="1F1B"),
        "mp": lambda: Mp(case, base, rank, m=m, p=run.p, extra=run.args.mp_config),
    }
    if "torch ZBV" in run.args.systems:
        try:
            cuts2, split2 = _hand_split(run, case, case.build(), m, stages=2 * run.p)
        except ValueError as exc:  # fewer whole pieces than ZBV's 2p stages (T5: encoder | decoder)
            split2 = f"not run: {exc}"
        else:
            makers["torch ZBV"] = lambda: TorchZBV(case, base, rank, m=m, cuts=cuts2, p=run.p)
        run.info[case.name].setdefault("torch_zbv_split", {})[m] = split2
    chosen = set(run.args.systems) | {"single acc"}
    if "mp zero_bubble" in chosen:
        chosen.add("mp")
    runners = {s: make() for s, make in makers.items() if s in chosen}
    if "mp zero_bubble" in chosen:
        runners["mp zero_bubble"] = MpZeroBubble(runners["mp"], run.p)
    first = {s: run.comm.allgather(r.first_step()) for s, r in runners.items()}
    losses = {s: next((v for v in got if v is not None), None) for s, got in first.items()}
    ref = losses["single acc"]
    assert ref is not None
    for s in (
        "mp",
        "torch GPipe",
        "torch 1F1B",
        "torch ZBV",
    ):  # the full batch is another sum (and BatchNorm's stats)
        if s not in losses:
            continue
        loss = losses[s]
        if loss is None or abs(loss - ref) > 1e-5 * max(1.0, abs(ref)):
            raise SystemExit(f"{case.name} m={m}: {s}'s first-step loss {loss} != the single process's {ref}")
    partition = runners["mp"].partition() if "mp" in runners else {}
    text = ", ".join(f"{p or '(root)'} -> pp_rank {r}" for p, r in partition.items()) or "-"
    info = run.info[case.name]
    info["mp_partition"][m] = text
    info["first_step_loss"][m] = losses
    run.say(f"   m={m}: first-step losses equal the single process's ({ref:.6f}); mp's partition: {text}")
    return runners


def _observing(runner: Any, mp_like: bool, rank: int) -> contextlib.AbstractContextManager[None]:
    """The observed step's blocking receives recorded, and mp's path of each call to another rank (mp:
    into its recorder, already on for its steps; torch: into the runner's clock, started here)."""
    from benchmarks._pipeline_where import recording_mp, recording_torch_waits
    from mp_pipeline.timeline import RECORDER

    if mp_like:
        return recording_mp(RECORDER, rank)
    runner.clock.recorder.start()
    return recording_torch_waits(runner.clock)


def _runtime_only(trace: Any) -> Any:
    """``trace`` without the WAIT events :func:`_observing` added (its busy figure as every step's)."""
    from benchmarks._pipeline_where import CALL, RECV

    kept = tuple(e for e in trace.events if e.phase not in (RECV, CALL))
    return dataclasses.replace(trace, events=kept)


def _time(run: Run, case: Any, m: int, group: int, runners: dict[str, Any]) -> dict[str, Any]:
    """``--rounds`` rounds of ``--steps`` timed steps of every runner, in a rotating order. Returns, on
    rank 0, the merged timeline of the last timed step of each system of :data:`OBSERVED`."""
    import torch

    from benchmarks._launch import idle_barrier
    from mp_pipeline.timeline import RECORDER, Timeline

    comm, rank, args = run.comm, run.rank, run.args
    cuda = args.device == "cuda"
    observed: dict[str, Any] = {}
    for rnd in range(args.rounds):
        for system in rotated(list(runners), rnd + group):
            runner = runners[system]
            mp_like = system.startswith("mp")
            for i in range(args.steps):
                observe = system in OBSERVED and rnd == args.rounds - 1 and i == args.steps - 1
                idle_barrier(comm)
                if mp_like:
                    RECORDER.start()
                runner.busy = 0.0
                t0 = time.perf_counter()
                with _observing(runner, mp_like, rank) if observe else contextlib.nullcontext():
                    runner.step()
                if cuda:
                    torch.cuda.synchronize()
                idle_barrier(comm)
                elapsed = time.perf_counter() - t0
                busy = runner.busy
                trace = None
                if mp_like:  # the timeline's compute, its waits cut out (as in every step: not the
                    trace = RECORDER.stop()  # observed step's receives and calls)
                    segments = Timeline.merge([_runtime_only(trace)]).compute_segments(rank)
                    busy = sum(b - a for _, segs in segments for a, b in segs) / 1e9
                if observe:
                    traces = comm.gather(trace if mp_like else runner.clock.recorder.stop(), root=0)
                    if rank == 0:
                        observed[system] = Timeline.merge(traces)
                fractions = comm.gather(busy / elapsed, root=0)
                if rank == 0:
                    record = {"model": case.name, "m": m, "system": system, "round": rnd}
                    run.records.append({**record, "step_s": elapsed, "busy": fractions})
        this = [r for r in run.records if (r["model"], r["m"], r["round"]) == (case.name, m, rnd)]
        run.say(
            f"   m={m} round {rnd}: " + ", ".join(f"{r['system']} {r['step_s'] * 1e3:.0f} ms" for r in this)
        )
    return observed


def _where(run: Run, case: Any, m: int, observed: dict[str, Any]) -> None:
    """Rank 0: each observed system's step split per rank (into ``info["where"]``) and, for the m that
    ``--timeline`` draws, the stacked picture ``pipeline_users_<model>_m<m>.png``."""
    from benchmarks._pipeline_where import render, split

    if run.rank != 0 or not observed:
        return
    order = [s for s in OBSERVED if s in observed]
    run.info[case.name].setdefault("where", {})[m] = {
        s: [t.as_dict() for t in split(observed[s])] for s in order
    }
    drawn = run.args.timeline
    if drawn is None:
        return
    if not drawn:  # --timeline alone: m >= 8 (the targets' rows), or every m of a run without them
        drawn = [k for k in run.args.microbatches if k >= 8] or list(run.args.microbatches)
    if m in drawn:
        panels = [(s, observed[s], s == "mp zero_bubble") for s in order]
        path = _folder(run.args) / f"pipeline_users_{case.name}_m{m}.png"
        title = f"{case.name}, m = {m}, pp = {run.p}: the last timed step of each system"
        if render(panels, path, title=title) is None:
            run.say("   no timeline picture: matplotlib is not installed")


def _size(text: str) -> dict[str, int]:
    """``hidden=1024,seq=512`` -> {"hidden": 1024, "seq": 512}."""
    try:
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--size {text!r}; expected key=integer pairs: hidden=1024,seq=512"
        ) from None


def _write(run: Run, batch: dict[str, int], load_before: float, started: float) -> None:
    """Rank 0 (re)writes the JSON and the markdown with every (model, m) finished so far."""
    import torch

    if run.rank != 0:
        return
    args = run.args
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True)
    out = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": run.info,
        "rows": summarize(run.records, batch, run.p),
        "records": run.records,
        "host": {
            "commit": commit.stdout.strip(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        },
        "elapsed_s": time.monotonic() - started,
    }
    folder = _folder(args)
    (folder / "pipeline_users.json").write_text(json.dumps(out, indent=1))
    (folder / "pipeline_users.md").write_text(markdown(out))
    run.last_markdown = markdown(out)


def _folder(args: argparse.Namespace) -> Path:
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="pipeline_users_")) if args.smoke else HERE / "results"
    folder: Path = args.out
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def main() -> None:
    from benchmarks.models import MODELS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16], help="values of m")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per (model, m)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each system per round")
    parser.add_argument("--smoke", action="store_true", help="tiny models, m = 4, 1 round of 1 step")
    parser.add_argument(
        "--timeline",
        type=int,
        nargs="*",
        default=None,
        metavar="M",
        help="also draw the last timed step of each pipelined system per rank, stacked, for these m "
        "(alone: every m >= 8 of the run, or every m if it has none)",
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: results/)")
    parser.add_argument("--pp", type=int, default=P, help="pipeline degree = ranks (default 2)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="models' and batches' device"
    )
    parser.add_argument("--size", type=_size, default={}, help="model sizes: hidden=1024,seq=512,batch=16")
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to time (default: all)"
    )
    parser.add_argument(
        "--mp-config",
        type=json.loads,
        default={},
        help="extra smp config keys for mp, as JSON (e.g. '{\"fast_mode\": true}'); default: none",
    )
    args = parser.parse_args()
    if not under_mpi():
        sys.exit(relaunch(__file__, args.pp))
    if args.smoke:
        args.microbatches, args.rounds, args.steps = [4], 1, 1

    import torch

    from benchmarks.models import make_case
    from mp_comm.world import init_world

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    world = init_world()  # owns torch.distributed's default group (and this rank's GPU); smp.init adopts it
    assert world.mpi_comm is not None, "started by mpiexec: the world has an MPI communicator"
    comm = world.mpi_comm.Dup()
    run = Run(comm, comm.Get_rank(), args)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    batch: dict[str, int] = {}
    for name in args.models:
        case = make_case(name, smoke=args.smoke, seed=SEED, size=args.size)
        if args.device == "cuda":
            gpu = torch.device("cuda", torch.cuda.current_device())

            def on_gpu(build: Any = case.build, gpu: torch.device = gpu) -> Any:
                return build().to(gpu)

            case = dataclasses.replace(
                case,
                build=on_gpu,
                batch=tuple(t.to(gpu) for t in case.batch),
                describe=f"{case.describe}, on {torch.cuda.get_device_name()}",
            )
        torch.manual_seed(SEED)
        ref = case.build()
        base = {k: v.clone() for k, v in ref.state_dict().items()}
        batch[name] = int(case.batch[0].shape[0])
        info: dict[str, Any] = {"describe": case.describe, "torch_split": {}, "mp_partition": {}}
        info["first_step_loss"] = {}
        run.info[name] = info
        run.say(f"== {name}: {case.describe}")
        for group, m in enumerate(args.microbatches):
            cuts, info["torch_split"][m] = _hand_split(run, case, ref, m)
            run.say(f"   m={m}: torch's hand split: {info['torch_split'][m]}")
            runners = _build(run, case, base, m, cuts)
            _where(run, case, m, _time(run, case, m, group, runners))
            for r in runners.values():
                r.close()
            del runners
            gc.collect()
            _write(run, batch, load_before, started)
    if run.rank == 0:
        print(run.last_markdown)
        print(f"wrote {_folder(args) / 'pipeline_users.json'} and .md")
    comm.Free()


if __name__ == "__main__":
    main()
