"""mp-plan's predictions against measurements: the seeds' papers' clusters, and runs on this machine.

Papers (nothing runs; every model is built on the meta device):

- GPT-3 175B, smp paper §7.2: 120 x 8 A100 40GB, pp=6, tp=8, fp16, checkpointing, offloading, optimizer
  state sharding, prescaled batch, global batch 2560, 64 microbatches, sequence 2048: 26.5 sequences/s.
  Target: the layout fits, the predicted throughput is within 30%.
- RoBERTa and BERT 10B, smp paper §7.1 Tables 1-2: 16 x 8 A100, tp=4, pp=1, checkpointing, optimizer
  state sharding, sequence 512, batches 1024 and 8192: 385 and 327 sequences/s. Target: the same order.
- T5-11B, smp paper Appendix D (Figures 9-10), pp=8: the encoder/decoder partition counts at alpha 1.0
  (4/4) and 0.2 (3/5), over assumed source and target lengths (the paper gives none).
- ATP: the planner's TP time equals ATP's equation 2 for the (tp, 1) mesh of an NVSwitch node at the
  preset's per-direction NVLink bandwidth (300 GB/s; ATP's nvswitch preset counts both directions, 600).

This machine (2 cores, load noted): each configuration's compute rate is calibrated on a single-process,
1-thread step of the same model (FLOPs of one step over its time); then the parallel layouts are
predicted and compared with mp's measured step time and per-rank memory:

- benchmarks/results/pipeline_users.json (HF GPT-2 8 x 256, pp=2, m = 4, 8, 16): calibration from the
  same run's "single 1 thread" rows;
- benchmarks/results/tensor_hf_gpt2.json (HF GPT-2 4 x 256, vocab 8192, tp=2): calibration from the same
  run's "single process, 1 thread" rows (quiet condition);
- fresh runs of benchmarks/memory.py's GPT-2 and configurations (4 x 256, vocab 2048, 8 sequences per
  rank: dp=2, shard_optimizer_state, checkpointing, pp=2, sdp=2 on 2 ranks; tp=2 x dp=2 on 4) by this
  script's own worker, calibrated by a single-process step measured before and after them. Memory per
  rank: parameters, gradients and optimizer state, and the peak of the distinct storages that autograd's
  saved tensors keep alive during a steady step, in every thread (mp's pipeline runs stages in worker
  threads; saved-tensor hooks are thread-local), parameters' own storage left out (:class:`_SavedTracker`).
  Ranks beyond the host's cores take turns on them: the planner's ``Cluster.cores_per_host``.

Run: ``python -m benchmarks.plan_accuracy [--part papers|machine|predict|all]``; results go to
benchmarks/results/plan_accuracy.json and .md (the part not run is kept from the JSON; ``predict`` runs
the model again on the measurements the JSON keeps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

PAPER_GPT3 = 26.5
PAPER_BERT = {"RoBERTa": 385.0, "BERT": 327.0}


def _load() -> tuple[Any, Any, Any]:
    from mp import plan
    from mp.plan.report import to_dict

    return plan, to_dict, plan.get_cluster


# ------------------------------------------------------------------------------------------- papers
def gpt3() -> list[dict[str, Any]]:
    """The paper's layout, costed as mp runs it and as smp ran it (the DP reduction overlapped with the
    last backward, optimizer-state sharding's gradients reduced to their owner: the paper's H.1)."""
    plan, to_dict, _ = _load()
    prof = plan.profile_model(
        "gpt2",
        seq_len=2048,
        overrides={"n_embd": 12288, "n_layer": 96, "n_head": 96, "n_positions": 2048, "vocab_size": 50257},
    )
    rows = []
    for overlap, reduce_scatter, label in ((None, False, "mp"), (True, True, "as smp")):
        res = plan.plan(
            prof,
            global_batch=2560,
            cluster="a100-40gb",
            hosts=120,
            pp=6,
            tp=8,
            microbatches=64,
            schedule="interleaved",
            checkpointing=True,
            offload=True,
            shard_optimizer_state=True,
            precision="fp16",
            overlap_dp=overlap,
            zero1_reduce_scatter=reduce_scatter,
        )
        est = res.estimates[0]
        row = to_dict(est)
        row["dp_mode"] = label
        row["parameters"] = prof.num_parameters
        row["forward_flops_per_sample"] = prof.forward_flops
        row["paper_samples_per_s"] = PAPER_GPT3
        row["ratio"] = est.samples_per_s / PAPER_GPT3
        row["within_30pct"] = abs(row["ratio"] - 1) <= 0.30
        # the sustained fraction of peak that would give the paper's step time, the rest unchanged
        t = est.time
        other = est.step_time - t.compute
        paper_step = 2560 / PAPER_GPT3
        row["implied_compute_efficiency"] = (
            res.cluster.compute_efficiency * t.compute / max(paper_step - other, 1e-9)
        )
        # the paper's rate per GPU: FLOPs per sequence with recomputation (4 forwards) x seq/s / GPUs
        row["paper_tflops_per_gpu"] = 4 * prof.forward_flops * PAPER_GPT3 / 960 / 1e12
        rows.append(row)
    return rows


def bert_roberta() -> list[dict[str, Any]]:
    plan, to_dict, _ = _load()
    rows = []
    specs = [
        (
            "RoBERTa",
            "roberta",
            {
                "hidden_size": 4096,
                "num_hidden_layers": 48,
                "num_attention_heads": 32,
                "intermediate_size": 16384,
            },
            1024,
        ),
        (
            "BERT",
            "bert",
            {
                "hidden_size": 2560,
                "num_hidden_layers": 127,
                "num_attention_heads": 40,
                "intermediate_size": 10240,
            },
            8192,
        ),
    ]
    for name, model_type, overrides, batch in specs:
        prof = plan.profile_model(model_type, seq_len=512, overrides=overrides)
        for overlap, label in ((None, "mp"), (True, "as smp")):
            res = plan.plan(
                prof,
                global_batch=batch,
                cluster="a100-40gb",
                hosts=16,
                pp=1,
                tp=4,
                checkpointing=True,
                offload=False,
                shard_optimizer_state=True,
                precision="fp16",
                overlap_dp=overlap,
                zero1_reduce_scatter=overlap is True,
            )
            row = to_dict(res.best)
            row.update(
                model=name,
                parameters=prof.num_parameters,
                dp_mode=label,
                paper_samples_per_s=PAPER_BERT[name],
            )
            rows.append(row)
    return rows


T5_SOURCES = (128, 256, 512)
T5_TARGETS = (32, 64, 114, 128, 256)


def t5_partitions() -> list[dict[str, Any]]:
    """The encoder/decoder split of T5-11B at pp=8 over assumed source and target lengths (the paper gives
    none): one sample traced on the meta device per pair, partitioned at alpha 1.0 and 0.2."""
    import torch

    from mp_partition import auto_partition, build_hf_model, trace_model

    rows = []
    for src in T5_SOURCES:
        for tgt in T5_TARGETS:
            built = build_hf_model("t5-11b", device="meta", seq_len=src)
            kwargs = dict(built.example_kwargs)
            kwargs["decoder_input_ids"] = torch.zeros(1, tgt, dtype=torch.long, device="meta")
            trace = trace_model(built.model, (), kwargs)
            params = {n: p.numel() * 4 for n, p in built.model.named_parameters()}
            side = {
                part: sum(v for k, v in params.items() if k.startswith(part + "."))
                + sum(trace.activation_bytes(k) for k in trace.modules if k.startswith(part + "."))
                for part in ("encoder", "decoder")
            }
            for alpha in (1.0, 0.2):
                p = auto_partition(built.model, 8, example_kwargs=kwargs, memory_weight=alpha, trace=trace)
                enc = sorted({v for k, v in p.assignment.items() if k.startswith("encoder.block")})
                dec = sorted({v for k, v in p.assignment.items() if k.startswith("decoder.block")})
                costs = [s.cost for s in p.partitions]
                rows.append(
                    {
                        "source_len": src,
                        "target_len": tgt,
                        "alpha": alpha,
                        "encoder_partitions": len(enc),
                        "decoder_partitions": len(dec),
                        "decoder_memory_share": side["decoder"] / (side["encoder"] + side["decoder"]),
                        "paper": "4/4" if alpha == 1.0 else "3/5",
                        "cost_min": min(costs),
                        "cost_max": max(costs),
                    }
                )
    return rows


def atp_consistency() -> dict[str, Any]:
    from mp_tensor.atp import nvswitch_node
    from mp_tensor.atp.search import ModelShape, estimate_mesh

    plan, _, get_cluster = _load()
    tp, layers, b, s, h = 8, 16, 2, 2048, 12288
    atp = estimate_mesh(
        tp, 1, nvswitch_node(8, 300.0), ModelShape(layers=layers, batch=b, seq=s, hidden=h)
    ).t_comm
    stage = plan.StageProfile(
        index=0,
        params=1,
        activation_bytes=0,
        block_activation_bytes=0,
        max_block_activation_bytes=0,
        flops=0.0,
        layers=layers,
    )
    clus = get_cluster("a100-40gb").with_(intra_latency=1e-30)
    est = plan.estimate(
        plan.Layout(pp=1, tp=tp, rdp=1, microbatches=1, precision="bf16"),
        (stage,),
        clus,
        global_batch=b,
        seq_len=s,
        hidden=h,
    )
    return {
        "atp_t_comm_s": atp,
        "planner_tp_s": est.time.tp_comm,
        "equal": abs(atp - est.time.tp_comm) < 1e-9 * atp,
    }


# ------------------------------------------------------------------------------------------ machine
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu(rate: float, cores: int | None = None) -> Any:
    """The cpu preset at ``rate`` FLOP/s per rank, on this host's cores (``cores``: 0 gives each rank a
    core of its own), as calibrate_cpu makes it."""
    _, _, get_cluster = _load()
    return get_cluster("cpu").with_(
        peak_flops_fp32=rate,
        peak_flops_half=rate,
        compute_efficiency=1.0,
        cores_per_host=_cores() if cores is None else cores,
    )


def _step_flops(prof: Any, batch: int) -> float:
    return 3.0 * prof.forward_flops * batch


def pipeline_users() -> list[dict[str, Any]]:
    plan, to_dict, _ = _load()
    data = json.loads((RESULTS / "pipeline_users.json").read_text())
    prof = plan.profile_model(
        "gpt2",
        seq_len=128,
        overrides={
            "vocab_size": 1000,
            "n_positions": 128,
            "n_embd": 256,
            "n_layer": 8,
            "n_head": 8,
            "tie_word_embeddings": False,
        },
    )
    rows = []
    for m in (4, 8, 16):
        single = [
            r["step_s"]
            for r in data["records"]
            if r["model"] == "gpt2" and r["m"] == m and r["system"] == "single 1 thread"
        ]
        measured = next(
            r for r in data["rows"] if r["model"] == "gpt2" and r["m"] == m and r["system"] == "mp"
        )
        rate = _step_flops(prof, 16) / statistics.median(single)
        res = plan.plan(
            prof,
            global_batch=16,
            cluster=_cpu(rate),
            pp=2,
            tp=1,
            microbatches=m,
            schedule="interleaved",
            checkpointing=False,
            shard_optimizer_state=False,
        )
        est = res.estimates[0]
        rows.append(
            {
                "source": "pipeline_users.json (gpt2)",
                "layout": est.layout.label(),
                "calibration_step_s": statistics.median(single),
                "predicted_step_s": est.step_time,
                "measured_step_s": measured["step_ms"] / 1000,
                "ratio": est.step_time / (measured["step_ms"] / 1000),
                "predicted": to_dict(est),
            }
        )
    return rows


def tensor_hf_gpt2() -> list[dict[str, Any]]:
    plan, to_dict, _ = _load()
    data = json.loads((RESULTS / "tensor_hf_gpt2.json").read_text())
    args = data["args"]
    prof = plan.profile_model(
        "gpt2",
        seq_len=args["seq"],
        overrides={
            "vocab_size": args["vocab"],
            "n_positions": args["seq"],
            "n_embd": args["hidden"],
            "n_layer": args["layers"],
            "n_head": args["heads"],
        },
    )
    steps = dict(data["step_seconds"])["quiet"]
    single = statistics.median(steps["single-1t"])
    rate = _step_flops(prof, args["batch"]) / single
    res = plan.plan(
        prof,
        global_batch=args["batch"],
        cluster=_cpu(rate),
        pp=1,
        tp=2,
        microbatches=1,
        checkpointing=False,
        shard_optimizer_state=False,
        sdp=False,
    )
    est = res.estimates[0]
    rows = []
    for variant in ("mp-speed", "mp-speed-prescaled"):
        measured = statistics.median(steps[variant])
        rows.append(
            {
                "source": f"tensor_hf_gpt2.json ({variant}, quiet)",
                "layout": est.layout.label(),
                "calibration_step_s": single,
                "predicted_step_s": est.step_time,
                "measured_step_s": measured,
                "ratio": est.step_time / measured,
                "predicted": to_dict(est),
            }
        )
    return rows


MEMORY_VARIANTS = {
    # variant: (ranks, layout pins, global batch)
    "mp": (2, {"pp": 1, "tp": 1, "microbatches": 1}, 16),
    "mp_zero": (2, {"pp": 1, "tp": 1, "microbatches": 1, "shard_optimizer_state": True}, 16),
    "mp_ckpt": (2, {"pp": 1, "tp": 1, "microbatches": 1, "checkpointing": True}, 16),
    "mp_pp2": (2, {"pp": 2, "tp": 1, "microbatches": 2, "schedule": "interleaved"}, 8),
    "mp_sdp": (2, {"pp": 1, "tp": 1, "microbatches": 1, "sdp": True}, 16),
    # mp's defaults under TP, as the worker runs it: optimize "memory", no prescaled batch
    "mp_tp2": (4, {"pp": 1, "tp": 2, "microbatches": 1, "optimize": "memory", "prescaled_batch": False}, 32),
}


def _memory_model() -> tuple[Any, Any]:
    """benchmarks/memory.py's GPT-2, with one sample's ids and labels (its loss is in the model)."""
    import torch

    from benchmarks.memory import SEQ, _gpt

    return (
        _gpt(4, 256),
        (),
        {"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "labels": torch.zeros(1, SEQ, dtype=torch.long)},
    )


def memory_model() -> Any:
    return _memory_model()


def _single_step(batch: int, steps: int = 3) -> tuple[float, float]:
    """One process, one thread: the fastest of ``steps`` AdamW steps of memory.py's GPT-2 on ``batch``
    sequences (after one warm-up step), in wall-clock seconds and in the process's CPU seconds."""
    import torch

    from benchmarks.memory import SEQ, VOCAB, _gpt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        net = _gpt(4, 256)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        times, cpu = [], []
        for i in range(steps + 1):
            ids = torch.randint(0, VOCAB, (batch, SEQ))
            start, start_cpu = time.perf_counter(), time.process_time()
            opt.zero_grad()
            net(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if i:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        return min(times), min(cpu)
    finally:
        torch.set_num_threads(threads)


class _SavedTracker:
    """Activation memory as autograd holds it: the bytes of the distinct storages that saved tensors
    keep alive, live over time, in every thread (saved-tensor hooks are thread-local, and mp's pipeline
    runs a stage's modules in its worker threads), parameters' own storage left out. A storage counts
    from the first saved tensor on it until the last one is released."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [saved tensors alive, bytes]
        self.params: set[int] = set()
        self.live = 0
        self.peak = 0
        self.on = False

    def hooks(self) -> Any:
        import weakref

        import torch

        tracker = self

        class Packed:
            __slots__ = ("__weakref__", "t")

            def __init__(self, t: Any) -> None:
                self.t = t

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if not tracker.on or ptr in tracker.params or t.device.type == "meta":
                return t
            box = Packed(t)
            tracker.add(ptr, storage.nbytes())
            weakref.finalize(box, tracker.release, ptr)
            return box

        def unpack(x: Any) -> Any:
            return x.t if isinstance(x, Packed) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def add(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            ref = self.refs.setdefault(ptr, [0, nbytes])
            if ref[0] == 0:
                self.live += ref[1]
                self.peak = max(self.peak, self.live)
            ref[0] += 1

    def release(self, ptr: int) -> None:
        with self.lock:
            ref = self.refs.get(ptr)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                self.live -= ref[1]
                del self.refs[ptr]

    def track_recompute(self) -> None:
        """Also count what activation checkpointing recomputes in backward. torch.utils.checkpoint
        (non-reentrant) saves a recomputed layer's tensors under its own saved-tensor hooks, innermost,
        so :meth:`hooks` never sees them: each is stored in the frame's ``recomputed`` map under a
        handle until its backward unpacks it (the handle is dropped then). The wrapper counts a tensor's
        storage from that save until its handle dies (torch 2.x internals; checked on torch 2.13)."""
        import weakref

        import torch.utils.checkpoint as tuc

        tracker = self
        original_init = tuc._recomputation_hook.__init__

        def init(hook: Any, frame_ref: Any, gid: Any) -> None:
            original_init(hook, frame_ref, gid)
            pack = hook.pack_hook

            def counted(x: Any) -> Any:
                out = pack(x)
                frame = frame_ref()
                if not tracker.on or frame is None or x.device.type == "meta":
                    return out
                holder = frame.weak_holders[frame.recomp_counter[gid] - 1]()
                handle = holder.handles.get(gid) if holder is not None else None
                storage = x.untyped_storage()
                ptr = storage.data_ptr()
                if handle is None or ptr in tracker.params:
                    return out
                tracker.add(ptr, storage.nbytes())
                weakref.finalize(handle, tracker.release, ptr)
                return out

            hook.pack_hook = counted

        tuc._recomputation_hook.__init__ = init  # type: ignore[method-assign,assignment]

    def install(self) -> None:
        """Push the hooks in the calling thread and in every thread started from now on, and count
        recomputed activations (:meth:`track_recompute`)."""
        import threading

        original = threading.Thread.run
        tracker = self

        def run(thread: threading.Thread) -> None:
            with tracker.hooks():
                original(thread)

        threading.Thread.run = run  # type: ignore[method-assign]
        self.hooks().__enter__()
        self.track_recompute()


MEASURE_STEPS = 3


def _worker(variant: str, out: str, steps: int) -> None:
    """One rank of a measured run (under mpiexec): memory.py's GPT-2 and config for ``variant``, one
    warm-up step (mp partitions and learns the pipeline's flow), one step whose activation memory is
    tracked (:class:`_SavedTracker`), then ``steps`` timed steps."""
    import resource

    import torch
    import torch.distributed as dist

    import mp as smp
    from benchmarks.memory import SEQ, VOCAB, _gpt, _local, _tensor_bytes

    tracker = _SavedTracker()
    tracker.install()
    cfg: dict[str, Any] = {"microbatches": 1}
    if variant == "mp_pp2":
        cfg = {"pipeline_parallel_degree": 2, "microbatches": 2}
    if variant == "mp_zero":
        cfg["shard_optimizer_state"] = True
    if variant == "mp_sdp":
        cfg.update(sharded_data_parallel_degree=2, sdp_param_persistence_threshold=0)
    if variant == "mp_tp2":
        cfg["tensor_parallel_degree"] = 2
    smp.init(cfg)
    torch.manual_seed(0)
    with smp.tensor_parallelism(enabled=variant == "mp_tp2"):
        net = _gpt(4, 256)
    model = smp.DistributedModel(net)
    if variant == "mp_ckpt":
        for block in net.transformer.h:
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(smp.rank())
    batches = [torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(steps + 2)]
    times, cpu = [], []
    for i, ids in enumerate(batches):
        if i == 1:  # after the warm-up: partitioned, flow learned
            params = list(model.local_parameters())
            tracker.params = {_local(p).untyped_storage().data_ptr() for p in params}
            tracker.on = True
        opt.zero_grad()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        train_step(ids)
        opt.step()
        dist.barrier()
        if i == 1:
            tracker.on = False
        if i >= 2:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    from mp.zero import sharding_of

    zero = sharding_of(opt)
    if zero is not None and zero.zero is not None:
        state_of = zero.zero.optim  # this rank's share
    else:
        state_of = opt.optim if hasattr(opt, "optim") else opt
    opt_bytes = sum(
        _local(v).numel() * v.element_size()
        for st in state_of.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    row = {
        "variant": variant,
        "rank": smp.rank(),
        "pp_rank": smp.pp_rank(),
        "param_mb": _tensor_bytes(params) / 2**20,
        "grad_mb": _tensor_bytes([p.grad for p in params]) / 2**20,
        "optimizer_mb": opt_bytes / 2**20,
        "activation_peak_mb": tracker.peak / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": times,
        "cpu_s": cpu,
    }
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if smp.rank() == 0:
        Path(out).write_text(json.dumps(rows))


def _run_worker(variant: str, steps: int) -> list[dict[str, Any]]:
    import subprocess
    import tempfile

    from benchmarks._launch import mpiexec, python_command, root_env

    exe = mpiexec()
    assert exe is not None, "mpiexec not found; install it with `pip install mpich`"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [exe, "-n", str(MEMORY_VARIANTS[variant][0]), *python_command(__file__)]
        cmd += ["--worker", variant, "--worker-json", str(out), "--worker-steps", str(steps)]
        env = {**root_env(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29527"}
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def memory_runs(variants: list[str], repeats: int = 2) -> list[dict[str, Any]]:
    """Each variant ``repeats`` times (its fastest run counts), between two single-process calibrations
    (their fastest step counts): on this shared host the fastest of several runs is the least disturbed.
    Memory per rank: parameters, gradients and optimizer state after the run, and the activation peak of
    a steady step (:class:`_SavedTracker`); the rank that needs most counts, as in the prediction."""
    first = _single_step(8, steps=5)
    measured: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    for _ in range(repeats):
        for variant in variants:
            measured[variant].append(_run_worker(variant, MEASURE_STEPS))
    last = _single_step(8, steps=5)
    calibration, calibration_cpu = [first[0], last[0]], [first[1], last[1]]
    return [memory_row(variant, calibration, measured[variant], calibration_cpu) for variant in variants]


def _step_of(rs: list[dict[str, Any]]) -> float:
    """A run's step time: the slowest rank's median step."""
    return max(statistics.median(r["step_s"]) for r in rs)


def memory_row(
    variant: str,
    calibration: list[float],
    runs: list[list[dict[str, Any]]],
    calibration_cpu: list[float] | None = None,
) -> dict[str, Any]:
    """The prediction for ``variant`` next to its measured runs (kept in the row, so that
    ``--part predict`` can predict again from them). With ``calibration_cpu`` (the single-process step's
    CPU seconds) also each rank's work: the predicted step but its bubble (compute, collectives, p2p and
    remote calls, which the CPU runs: MPI waits by polling, gloo copies), at the CPU-time calibration, one
    core per rank, against the rank's measured CPU seconds per step: on a host shared with other jobs the
    wall-clock step also holds the waits for a core."""
    plan, to_dict, _ = _load()
    prof = plan.profile_model("benchmarks.plan_accuracy:memory_model", seq_len=128, hidden=256, device="cpu")
    single = min(calibration)
    rate = _step_flops(prof, 8) / single
    ranks, pins, batch = MEMORY_VARIANTS[variant]
    fastest = min(runs, key=_step_of)
    measured_step = _step_of(fastest)
    # the calibration is one rank on a core of its own; more ranks than cores take turns on them (the
    # planner's cores_per_host)
    cores = _cores()
    clus = _cpu(rate).with_(devices_per_host=ranks)
    kwargs = {"checkpointing": False, "shard_optimizer_state": False, "sdp": False, "offload": False}
    kwargs.update(pins)
    res = plan.plan(prof, global_batch=batch, cluster=clus, **kwargs)
    est = res.estimates[0]
    mem = est.memory
    mb = 2**20
    per_rank = [
        {
            "parameters": r["param_mb"],
            "gradients": r["grad_mb"],
            "optimizer": r["optimizer_mb"],
            "activations": r["activation_peak_mb"],
        }
        for r in fastest
    ]
    measured_mem = max(per_rank, key=lambda d: sum(d.values()))  # the rank that needs most
    predicted_mem = {
        "parameters": mem.parameters / mb,
        "gradients": mem.gradients / mb,
        "optimizer": (mem.optimizer + mem.master) / mb,
        "activations": mem.activations / mb,
    }
    # process CPU time of a step (every thread of the rank), the slowest rank's median: the work done,
    # apart from waiting for the other rank or for a core
    cpu_s = max((statistics.median(r["cpu_s"]) for r in fastest if r.get("cpu_s")), default=None)
    work_s = None
    if calibration_cpu:  # the same layout at the CPU-time rate, one core per rank (CPU time is per rank)
        rate_cpu = _step_flops(prof, 8) / min(calibration_cpu)
        clus_cpu = _cpu(rate_cpu, cores=0).with_(devices_per_host=ranks)
        cpu_est = plan.plan(prof, global_batch=batch, cluster=clus_cpu, **kwargs).estimates[0]
        work_s = cpu_est.step_time - cpu_est.time.bubble  # all but idling: MPI and gloo spend CPU
    total_p, total_m = sum(predicted_mem.values()), sum(measured_mem.values())
    print(
        f"{variant}: predicted {est.step_time:.3f} s, measured {measured_step:.3f} s; memory "
        f"{total_p:.1f} vs {total_m:.1f} MB",
        flush=True,
    )
    return {
        "source": f"fresh run {variant} ({ranks} ranks, fastest of {len(runs)})",
        "variant": variant,
        "layout": est.layout.label(),
        "calibration_step_s": single,
        "calibration_runs_s": calibration,
        "measured_runs_s": [_step_of(rs) for rs in runs],
        "runs": runs,
        "predicted_step_s": est.step_time,
        "measured_step_s": measured_step,
        "ratio": est.step_time / measured_step,
        "predicted_tokens_per_s": est.samples_per_s * 128,
        "predicted_memory_mb": predicted_mem,
        "measured_memory_mb": measured_mem,
        "measured_memory_per_rank_mb": per_rank,
        "memory_ratio": total_p / total_m,
        "measured_cpu_s": cpu_s,
        "calibration_cpu_s": calibration_cpu,
        "predicted_work_s": work_s,
        "ranks_per_core": ranks / cores,
        "measured_peak_rss_mb": max(r["peak_rss_mb"] for r in fastest),
        "predicted": to_dict(est),
    }


# ------------------------------------------------------------------------------------------ output
def _pct(x: float) -> str:
    return f"{(x - 1) * 100:+.0f}%"


def markdown(data: dict[str, Any]) -> str:
    out = ["# mp-plan: predicted against measured (benchmarks/plan_accuracy.py)", ""]
    papers = data.get("papers")
    if papers:
        gs = papers["gpt3"]
        out += [
            "## The smp paper's clusters (models on the meta device; cluster preset a100-40gb)",
            "",
            "mp: costed as mp runs the layout (no DP overlap under TP; shard_optimizer_state as torch's "
            "ZeroRedundancyOptimizer: all-reduce, then the parameters' broadcast). as smp: the DP reduction "
            "overlapped with the last backward and each gradient reduced to the rank that steps it (the smp "
            "paper's Appendix H.1), then the broadcast.",
            "",
            "| run (source) | layout | predicted | paper | gap | fits (GB per device) | bottleneck |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for g in gs:
            out.append(
                f"| GPT-3 175B, 120 x 8 A100 40GB, {g['dp_mode']} (smp paper §7.2) | {g['layout']} | "
                f"{g['samples_per_s']:.1f} seq/s "
                f"| {PAPER_GPT3} seq/s | {_pct(g['ratio'])} | {'yes' if g['fits'] else 'NO'} "
                f"({g['memory_bytes']['total'] / 1e9:.1f} of {g['memory_bytes']['device'] / 1e9:.1f}) | "
                f"{g['bottleneck']} |"
            )
        for r in papers["bert"]:
            out.append(
                f"| {r['model']} 10B, 16 x 8 A100, {r['dp_mode']} (Tables 1-2) | {r['layout']} | "
                f"{r['samples_per_s']:.0f} seq/s | {r['paper_samples_per_s']:.0f} seq/s | "
                f"{_pct(r['samples_per_s'] / r['paper_samples_per_s'])} | {'yes' if r['fits'] else 'NO'} "
                f"({r['memory_bytes']['total'] / 1e9:.1f}) | {r['bottleneck']} |"
            )
        out.append("")
        for g in gs:
            t = g["time_s"]
            out.append(
                f"GPT-3 step ({g['dp_mode']}) {g['step_time_s']:.1f} s: compute {t['compute']:.1f}, "
                f"memory-bound ops {t.get('memory_bound', 0.0):.1f}, TP "
                f"{t['tp_comm']:.1f}, p2p {t['p2p']:.1f}, bubble {t['bubble']:.1f}, DP {t['dp_comm']:.1f} s; "
                f"the paper's 26.5 seq/s would need a sustained {g['implied_compute_efficiency']:.2f} of "
                "peak (the preset assumes 0.5)."
            )
        g = gs[0]
        out += [
            "",
            f"Offloaded {g['offload_bytes_per_step'] / 1e9:.0f} GB per step per device (as overlapped). "
            f"The paper's rate per GPU: {g['paper_tflops_per_gpu']:.0f} TFLOP/s "
            f"({g['paper_tflops_per_gpu'] / 312:.0%} of the A100's 312), counting "
            f"{g['forward_flops_per_sample'] / 1e12:.0f} TFLOP per sequence forward, four forwards with "
            "recomputation.",
            "",
        ]
        orders = {}
        for mode in {r["dp_mode"] for r in papers["bert"]}:
            rs = {r["model"]: r["samples_per_s"] for r in papers["bert"] if r["dp_mode"] == mode}
            orders[mode] = "RoBERTa > BERT" if rs["RoBERTa"] > rs["BERT"] else "BERT > RoBERTa"
        out.append(
            "BERT/RoBERTa order (paper: RoBERTa > BERT): "
            + "; ".join(f"{k}: {v}" for k, v in sorted(orders.items()))
        )
        out += [
            "",
            "T5-11B, pp=8 (smp paper Appendix D: 4/4 encoder/decoder partitions at alpha 1.0, 3/5 at 0.2; "
            "no sequence lengths given). Encoder / decoder partitions at alpha 1.0 by assumed source (rows) "
            "and target (columns) length, one sample, with the decoder's share of parameters and "
            "activations:",
            "",
            "| source \\ target | " + " | ".join(str(t) for t in T5_TARGETS) + " |",
            "|---:|" + "---|" * len(T5_TARGETS),
        ]
        t5 = papers["t5"]
        for src in T5_SOURCES:
            cells = []
            for tgt in T5_TARGETS:
                r = next(
                    (
                        r
                        for r in t5
                        if r["source_len"] == src and r["target_len"] == tgt and r["alpha"] == 1.0
                    ),
                    None,
                )
                cells.append(
                    "-"
                    if r is None
                    else f"{r['encoder_partitions']}/{r['decoder_partitions']} "
                    f"({r.get('decoder_memory_share', float('nan')):.0%})"
                )
            out.append(f"| {src} | " + " | ".join(cells) + " |")
        low = sorted(
            {f"{r['encoder_partitions']}/{r['decoder_partitions']}" for r in t5 if r["alpha"] == 0.2}
        )
        out += ["", f"At alpha 0.2: {', '.join(low)} at every length pair (paper: 3/5)."]
        a = papers["atp"]
        out += [
            "",
            f"ATP: planner TP time {a['planner_tp_s'] * 1e3:.3f} ms = equation 2 on the (8, 1) mesh "
            f"{a['atp_t_comm_s'] * 1e3:.3f} ms: {'equal' if a['equal'] else 'DIFFERENT'}.",
            "",
        ]
    machine = data.get("machine")
    if machine:
        out += [
            "## This machine (2 cores; compute rate from a 1-process 1-thread step of the same model)",
            "",
            "Host 1-minute load average at the start and end of each run: "
            + ", ".join(
                f"{a:.1f} to {b:.1f}"
                for a, b in zip(machine["load"][::2], machine["load"][1::2], strict=True)
            )
            + ".",
            "",
            "| source | layout | calibration s | predicted s | measured s | gap | work predicted / CPU "
            "measured s | memory predicted / measured MB |",
            "|---|---|---:|---:|---:|---:|---|---|",
        ]
        for r in machine["rows"]:
            mem = ""
            if "predicted_memory_mb" in r:
                p, m = r["predicted_memory_mb"], r["measured_memory_mb"]
                mem = (
                    f"{sum(p.values()):.1f} / {sum(m.values()):.1f} ({_pct(r['memory_ratio'])}); act "
                    f"{p['activations']:.1f} / {m['activations']:.1f}"
                )
            out.append(
                f"| {r['source']} | {r['layout']} | {r['calibration_step_s']:.3f} | "
                f"{r['predicted_step_s']:.3f} | "
                f"{r['measured_step_s']:.3f} | {_pct(r['ratio'])} | "
                f"{_work(r)} | {mem} |"
            )
        out += [
            "",
            "Work: the predicted step but its bubble at the single-process step's CPU-time rate, one core "
            "per rank, against the slowest rank's CPU seconds per step (every thread; MPI polls while it "
            "waits, gloo copies): what each rank computed, apart from waiting for a core on this shared "
            "host.",
        ]
        ranked = machine.get("ranking")
        if ranked:
            out += [
                "",
                "Among the 2-rank layouts (tokens trained per second): measured order "
                f"{', '.join(ranked['measured_order'])}; "
                f"predicted order: {', '.join(ranked['predicted_order'])}; in the predicted top 2: "
                f"{'yes' if ranked['in_top2'] else 'NO'}.",
            ]
    return "\n".join(out) + "\n"


def _work(r: dict[str, Any]) -> str:
    w, c = r.get("predicted_work_s"), r.get("measured_cpu_s")
    if w is None or c is None:
        return ""
    return f"{w:.3f} / {c:.3f} ({_pct(w / c)})"


def _ranking(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The 2-rank memory.py layouts by throughput: sequences a step really trains (the global batch; under
    pp=2 both ranks load a batch but train one) times 128 tokens over the step time."""
    two = [r for r in rows if r.get("variant") and not r["variant"].endswith("tp2")]
    if len(two) < 2:
        return None
    for r in two:
        tokens = r["predicted_tokens_per_s"] * r["predicted_step_s"]  # tokens per step
        r["measured_tokens_per_s_trained"] = tokens / r["measured_step_s"]
    best = max(two, key=lambda r: r["measured_tokens_per_s_trained"])["variant"]
    order = [r["variant"] for r in sorted(two, key=lambda r: -r["predicted_tokens_per_s"])]
    return {
        "measured_best": best,
        "measured_order": [
            r["variant"] for r in sorted(two, key=lambda r: -r["measured_tokens_per_s_trained"])
        ],
        "predicted_order": order,
        "in_top2": best in order[:2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("papers", "machine", "predict", "all"), default="all")
    parser.add_argument("--variants", default=",".join(MEMORY_VARIANTS), help="measured variants to run")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per measured variant (the fastest counts)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    parser.add_argument("--worker-steps", type=int, default=MEASURE_STEPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.worker_json, args.worker_steps)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = RESULTS / "plan_accuracy.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if args.part in ("papers", "all"):
        data["papers"] = {
            "gpt3": gpt3(),
            "bert": bert_roberta(),
            "t5": t5_partitions(),
            "atp": atp_consistency(),
        }
        print("papers done", flush=True)
    if args.part in ("machine", "all"):
        load0 = os.getloadavg()[0]
        rows = pipeline_users() + tensor_hf_gpt2()
        chosen = [v for v in args.variants.split(",") if v]
        mem_rows = memory_runs(chosen, repeats=args.repeats)
        load = [load0, os.getloadavg()[0]]
        if set(chosen) != set(MEMORY_VARIANTS) and data.get("machine"):  # keep the other variants' rows
            kept = [r for r in data["machine"]["rows"] if r.get("variant") and r["variant"] not in chosen]
            mem_rows = sorted(kept + mem_rows, key=lambda r: list(MEMORY_VARIANTS).index(r["variant"]))
            load = data["machine"]["load"] + load
        rows += mem_rows
        data["machine"] = {"rows": rows, "load": load}
    if args.part == "predict":  # the model again, on the measurements kept in the JSON
        kept = data["machine"]
        rows = pipeline_users() + tensor_hf_gpt2()
        rows += [
            memory_row(r["variant"], r["calibration_runs_s"], r["runs"], r.get("calibration_cpu_s"))
            for r in kept["rows"]
            if "runs" in r
        ]
        kept["rows"] = rows
    if data.get("machine"):
        data["machine"]["ranking"] = _ranking(data["machine"]["rows"])
    path.write_text(json.dumps(data, indent=1, default=str))
    (RESULTS / "plan_accuracy.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
