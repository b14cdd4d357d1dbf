"""Memory savers: per-rank memory and throughput of a GPT under mp's savers and torch's equivalents.

A GPT-2 (``--layers`` x ``--hidden``, vocab 2048, sequence 128, ``--batch`` sequences per rank) trained
with AdamW on 2 data-parallel ranks (pp=1), each variant in a fresh ``mpiexec -n 2`` world:

- ``mp``: no saver; ``torch``: the same with torch's DistributedDataParallel (gloo);
- ``mp_ckpt``: ``smp.set_activation_checkpointing`` on every block; ``torch_ckpt``: DDP with
  ``torch.utils.checkpoint`` (non-reentrant) on every block;
- ``mp_zero``: ``shard_optimizer_state``; ``torch_zero``: DDP with ``ZeroRedundancyOptimizer``;
- ``mp_bf16``: the ``bf16`` key (bf16 parameters, fp32 masters); ``torch_bf16``: DDP under
  ``torch.autocast("cpu", torch.bfloat16)`` (fp32 parameters: not the same recipe, torch's usual one);
- ``mp_pp2``: pp=2 (2 microbatches; each rank keeps half the model after partitioning);
- ``mp_sdp``: ``sharded_data_parallel_degree`` 2 (``sdp_param_persistence_threshold`` 0: every
  parameter sharded; smp's default clipping at norm 1.0); ``torch_fsdp``: FSDP2 ``fully_shard`` per block
  then the root, the same clipping with ``clip_grad_norm_``;
  ``mp_pp2_delayed``: the same built under ``smp.delay_param_initialization()``;
- on 4 ranks, the GPT-2 made whole-stack tensor-parallel (``smp.tensor_parallelism()``): ``mp_tp2``:
  tp=2 x dp=2; ``mp_sdp_tp2``: tp=2 x ``sharded_data_parallel_degree`` 2 (threshold 0);
  ``mp_sdp_tp2_bf16``: the same with ``bf16``.

Per rank: the RSS growth from building and wrapping the model (before the first step), the peak RSS
over the RSS before the model was built (``ru_maxrss``; the allocator keeps freed
memory, so it is an upper bound of the peak of live tensors), the bytes of parameters, gradients and
optimizer state after training, and the bytes autograd saved for backward in one training step
(saved-tensor hooks); throughput in tokens per second over the timed steps (the slowest rank's time).
The variants run in rotating order, ``--repeats`` times; the table gives medians.

Run: ``python -m benchmarks.memory`` (``--quick`` for a smoke run). Results go to
benchmarks/results/memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._launch import mpiexec, python_command, root_env, under_mpi

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VARIANTS = [
    "mp",
    "torch",
    "mp_ckpt",
    "torch_ckpt",
    "mp_zero",
    "torch_zero",
    "mp_bf16",
    "torch_bf16",
    "mp_pp2",
    "mp_pp2_delayed",
    "mp_sdp",
    "torch_fsdp",
    "mp_tp2",
    "mp_sdp_tp2",
    "mp_sdp_tp2_bf16",
]
SEQ, VOCAB = 128, 2048
RANKS = {"mp_tp2": 4, "mp_sdp_tp2": 4, "mp_sdp_tp2_bf16": 4}  # the others: 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gpt(layers: int, hidden: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    config.use_cache = False  # a recomputed block would append to the KV cache twice (HF turns it off too)
    return GPT2LMHeadModel(config)


def _local(t: Any) -> Any:
    """This rank's part of a tensor (a sharded DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_bytes(ts: Any) -> int:
    return sum(_local(t).numel() * t.element_size() for t in ts if t is not None)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mp.zero import sharding_of

    variant = args.worker
    torch.manual_seed(0)
    saved = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved["bytes"] += t.numel() * t.element_size()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    if variant.startswith("mp"):
        import mp as smp

        cfg: dict[str, Any] = {"microbatches": 1}
        if variant.startswith("mp_pp2"):
            cfg = {"pipeline_parallel_degree": 2, "microbatches": 2}
        if variant == "mp_zero":
            cfg["shard_optimizer_state"] = True
        if variant == "mp_bf16":
            cfg["bf16"] = True
        if variant.startswith("mp_sdp"):
            cfg.update(sharded_data_parallel_degree=2, sdp_param_persistence_threshold=0)
        if "tp2" in variant:
            cfg["tensor_parallel_degree"] = 2
        if variant.endswith("bf16"):
            cfg["bf16"] = True
        smp.init(cfg)
        base = _rss_bytes()
        with (
            smp.delay_param_initialization(enabled=variant == "mp_pp2_delayed"),
            smp.tensor_parallelism(enabled="tp2" in variant),
        ):
            net = _gpt(args.layers, args.hidden)
        model = smp.DistributedModel(net)
        built = _rss_bytes() - base
        if variant == "mp_ckpt":
            for block in net.transformer.h:
                smp.set_activation_checkpointing(block)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            return loss

        def one_step(ids: torch.Tensor, measure: bool) -> None:
            opt.zero_grad()
            if measure:
                with hooks:
                    train_step(ids)
            else:
                train_step(ids)
            opt.step()

        rank = smp.rank()

        def tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            params = list(model.local_parameters())
            masters = [m for p, m in opt.pairs() if m is not p] if hasattr(opt, "pairs") else []
            return params, masters
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        rank_env = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        size_env = os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
        dist.init_process_group("gloo", rank=int(rank_env), world_size=int(size_env))
        base = _rss_bytes()
        rank = dist.get_rank()
        net = _gpt(args.layers, args.hidden)
        if variant == "torch_ckpt":
            for block in net.transformer.h:
                original = block.forward

                def forward(*a: Any, _f: Any = original, **k: Any) -> Any:
                    return torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False, **k)

                block.forward = forward
        if variant == "torch_fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in net.transformer.h:
                fully_shard(block, mesh=mesh)
            ddp = fully_shard(net, mesh=mesh)
        else:
            ddp = DistributedDataParallel(net)
        built = _rss_bytes() - base
        if variant == "torch_zero":
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        else:
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def one_step(ids: torch.Tensor, measure: bool) -> None:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "torch_bf16"):
                if measure:
                    with hooks:
                        loss = ddp(input_ids=ids, labels=ids).loss
                else:
                    loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            if variant == "torch_fsdp":  # what mp_sdp does by default (smp's sdp_gradient_clipping 1.0)
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()

        def tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return list(net.parameters()), []

    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (args.batch, SEQ), generator=g) for _ in range(args.steps + 1)]
    one_step(batches[0], measure=True)  # the warm-up step measures what autograd saves
    dist.barrier()
    start = time.perf_counter()
    for ids in batches[1:]:
        one_step(ids, measure=False)
    dist.barrier()
    elapsed = time.perf_counter() - start
    params, masters = tensors()
    zero = sharding_of(opt)
    state_of = zero.zero.optim if zero is not None else opt.optim if hasattr(opt, "optim") else opt
    if hasattr(opt, "pairs"):  # the bf16 optimizer: the user's optimizer holds the state
        state_of = opt.optimizer
    opt_bytes = sum(
        _local(v).numel() * v.element_size()
        for s in state_of.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    row = {
        "variant": variant,
        "rank": rank,
        "built_rss_mb": built / 2**20,
        "peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20,
        "param_mb": _tensor_bytes(params) / 2**20,
        "master_mb": _tensor_bytes(masters) / 2**20,
        "grad_mb": _tensor_bytes([p.grad for p in params]) / 2**20,
        "optimizer_mb": opt_bytes / 2**20,
        "saved_activation_mb": saved["bytes"] / 2**20,
        "seconds": elapsed,
        "tokens_per_s": dist.get_world_size() * args.batch * SEQ * args.steps / elapsed,
    }
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(args.json).write_text(json.dumps(rows))


def _run(variant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    exe = mpiexec()
    assert exe is not None, "mpiexec not found; install it with `pip install mpich`"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            exe,
            "-n",
            str(RANKS.get(variant, 2)),
            *python_command(__file__),
            "--worker",
            variant,
            "--json",
            str(out),
        ]
        cmd += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--batch", str(args.batch)]
        cmd += ["--steps", str(args.steps)]
        env = {**root_env(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
        subprocess.run(cmd, env=env, check=True, capture_output=not args.verbose)
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def _table(results: dict[str, list[list[dict[str, Any]]]]) -> str:
    cols = [
        "built_rss_mb",
        "peak_rss_mb",
        "param_mb",
        "master_mb",
        "grad_mb",
        "optimizer_mb",
        "saved_activation_mb",
    ]
    lines = [
        "| variant | "
        + " | ".join(c.removesuffix("_mb").replace("_", " ") + " (MB)" for c in cols)
        + " | tokens/s | vs torch |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    peers = {
        "mp": "torch",
        "mp_ckpt": "torch_ckpt",
        "mp_zero": "torch_zero",
        "mp_bf16": "torch_bf16",
        "mp_sdp": "torch_fsdp",
        "mp_sdp_tp2": "mp_tp2",  # no torch peer: against tp=2 x dp=2
        "mp_sdp_tp2_bf16": "mp_tp2",
    }
    speed = {
        v: statistics.median(min(r["tokens_per_s"] for r in rep) for rep in reps)
        for v, reps in results.items()
    }
    for variant, reps in results.items():
        # per column: the larger of the two ranks in each repetition, median over repetitions
        cells = [f"{statistics.median(max(r[c] for r in rep) for rep in reps):.1f}" for c in cols]
        peer = peers.get(variant)
        ratio = f"{speed[variant] / speed[peer]:.2f}x" if peer in speed else ""
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {speed[variant]:.0f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument(
        "--variants",
        help="comma-separated subset to run; the other variants' rows are kept from results/memory.json",
    )
    args = parser.parse_args()
    if args.worker:
        assert under_mpi()
        _worker(args)
        return
    if args.quick:
        args.layers, args.hidden, args.batch, args.steps, args.repeats = 2, 64, 2, 1, 1
    chosen = args.variants.split(",") if args.variants else VARIANTS
    results: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    kept: list[str] = []
    if args.variants and (RESULTS / "memory.json").exists():
        earlier = json.loads((RESULTS / "memory.json").read_text())["results"]
        kept = [v for v in VARIANTS if v not in chosen and earlier.get(v)]
        results.update({v: earlier[v] for v in kept})
    for rep in range(args.repeats):
        order = chosen[rep % len(chosen) :] + chosen[: rep % len(chosen)]
        for variant in order:
            results[variant].append(_run(variant, args))
            print(f"repeat {rep} {variant}: {results[variant][-1]}", flush=True)
    meta = {
        "model": f"GPT-2 {args.layers} layers x {args.hidden}, vocab {VOCAB}, seq {SEQ}",
        "batch_per_rank": args.batch,
        "timed_steps": args.steps,
        "repeats": args.repeats,
        "ranks": 2,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kept_from_earlier_run": kept,
    }
    results = {v: reps for v, reps in results.items() if reps}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = (
        "# Memory savers: per-rank memory and throughput (benchmarks/memory.py)\n\n"
        f"{meta['model']}, AdamW, {args.batch} sequences per rank, 2 data-parallel ranks (pp=1) on "
        f"{meta['cpus']} CPUs, {args.steps} timed steps, median of {args.repeats} runs; memory columns: the "
        "larger rank's. built rss: RSS growth from building and wrapping the model. peak rss: ru_maxrss over "
        "the RSS before the model was built, after init (pp=2: saved activation is pp_rank 0's thread "
        "only). "
        "master: fp32 copies kept by the bf16 optimizer. saved activation: bytes autograd kept for "
        "backward in one step. vs torch: throughput against the torch variant below it (the *_tp2 rows: "
        "4 ranks, against mp_tp2)."
        + (f" Rows {', '.join(kept)}: kept from the earlier full run (its own repeats)." if kept else "")
        + "\n\n"
        + _table(results)
        + "\n"
    )
    (RESULTS / "memory.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
