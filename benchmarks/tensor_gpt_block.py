"""A GPT block with tp=2: smp's DistributedTransformerLayer against torch.distributed.tensor.parallel.

One GPT block (pre-LayerNorm attention + MLP, causal, gelu_new, no dropout, float32; seed 004's
``mp_tensor.reference.TransformerLayer``) at a global batch of ``--batch`` sequences of ``--seq`` tokens,
forward + backward (``out.backward(g)`` with a fixed upstream gradient ``g``; the input needs its
gradient, as a block inside a model does), 2 ranks on gloo, one thread per rank. Timed:

* ours, built through ``smp.init({"tensor_parallel_degree": 2, "optimize": "speed",
  "prescaled_batch": True})`` and ``smp.nn.DistributedTransformerLayer``:

  - ``speed, prescaled_batch``: both ranks get the same ``batch`` samples (Megatron-style);
  - ``speed, TP across DP``: each rank its own ``batch/2`` samples (smp's default mode; the layer
    all-gathers the samples, so each rank works on all ``batch`` of them);
  - ``memory, TP across DP``: ``optimize="memory"``, each rank its own ``batch/2`` samples (all-to-all
    in, sharded activations, reduce-scatters). This is how the config feeds "memory": it rejects
    ``prescaled_batch`` unless ``optimize`` is "speed";
  - ``memory, prescaled``: the same module with ``prescaled_batch`` set through an explicit
    ``mp_tensor`` ``TPContext`` (which the config does not allow), the same ``batch`` samples on both
    ranks, for comparison.

  Every mode works on the same ``batch`` samples per rank with half the heads and half the MLP channels,
  so the per-rank arithmetic is the same; they differ in the communication. The variants other than
  the first use the context ``smp.init`` built with only ``optimize``/``prescaled_batch`` changed (same
  TP group, seed and dtype), the context a config with those values gives.
* peer: the same block with the same weights under ``parallelize_module`` (``ColwiseParallel`` on the
  fused q/k/v and on fc1, ``RowwiseParallel`` on the attention output and fc2) on a 2-rank gloo
  ``DeviceMesh``, both ranks fed the same ``batch`` samples (``_tensor_gpt_peer.py``);
* reference: the unsplit block in one process (rank 0; rank 1 waits), with 1 thread and with 2 threads
  (both cores, the hardware the two ranks share).

Before timing, each variant's output, input gradient and every parameter gradient (shards gathered) are
checked against the single-process block on the full batch, and ours against the peer. No gradient
reduction is needed for this block: every parameter of the distributed layer is a scaled-batch
parameter (its gradient already covers the TP group's samples; the group is the whole world, so the
reduced data-parallel group is one rank), which the checks confirm.

Timing: ``--rounds`` rounds, every variant once per round (``--steps`` steps after ``--warmup`` steps
done once before the rounds), the order rotated each round since the host is noisy. Step time = the
slowest rank's wall time per step; tokens/s = ``batch * seq`` (global tokens) / step time. Reported:
medians, quartiles and ranges over rounds; ours/peer = median over rounds of the peer's step time
over ours in the same round (> 1: ours faster).

    python -m benchmarks.tensor_gpt_block [--hidden 512 --heads 8 --batch 8 --seq 128 --rounds 20 --steps 2]

starts itself under ``mpiexec -n 2``. Writes ``benchmarks/results/tensor_gpt_block.{json,md}`` (rank 0).
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._launch import on_all_cores, relaunch, under_mpi

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 2


if __name__ == "__main__" and not under_mpi():
    sys.exit(relaunch(__file__, RANKS))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import mp as smp  # noqa: E402
from benchmarks._atp_comm import CommProbe, Replay  # noqa: E402
from benchmarks._tensor_gpt_peer import PeerBlock, parallelize_peer, peer_full_grads  # noqa: E402
from mp.config import load_config  # noqa: E402
from mp.tensor_api import tp_context  # noqa: E402
from mp_tensor.context import TPContext  # noqa: E402
from mp_tensor.nn import DistributedTransformerLayer, is_scaled_batch_parameter, param_spec  # noqa: E402
from mp_tensor.reference import TransformerLayer  # noqa: E402

TOL = 1e-4
"""Largest accepted max |difference| / max(max |reference|, 1) per tensor (float32, sums in another order;
absolute below 1, since some gradients are zero up to rounding: the key bias cannot change a softmax)."""


@dataclass
class Variant:
    key: str
    label: str
    kind: str
    """"ours", "peer" or "single"."""
    per_rank_batch: int
    step: Callable[[], None]
    threads: int = 1
    config: str = ""
    check: dict[str, Any] = field(default_factory=dict)
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per collective: calls per step and MB this rank passes in (the input tensors)."""
    replay: Replay | None = None
    """Ours: the recorded collectives of one step, to issue again without the computation."""
    step_s: list[float] = field(default_factory=list)
    replay_s: list[float] = field(default_factory=list)
    """Per replay round: the slowest rank's seconds per replay of one step's collectives."""


def block_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_attention_heads": args.heads,
        "attention_head_size": args.hidden // args.heads,
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "attention_dropout_prob": 0.0,
        "hidden_dropout_prob": 0.0,
        "activation": "gelu_new",
        "causal_mask_size": args.seq,
        "pre_layernorm": True,
        "post_layernorm": False,
    }


def _rel(got: Tensor, want: Tensor) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


def _input(full: Tensor, lo: int, hi: int) -> Tensor:
    return full[lo:hi].detach().clone().requires_grad_(True)


def _ours_full_grads(layer: DistributedTransformerLayer) -> dict[str, Tensor]:
    out = {}
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        spec = param_spec(p)
        if spec is None or spec.split_dim is None:
            out[name] = p.grad.detach()
            continue
        parts = [torch.empty_like(p.grad) for _ in range(layer.tp_size)]
        dist.all_gather(parts, p.grad.detach().contiguous(), group=layer.tp.group)
        out[name] = torch.cat(parts, dim=spec.split_dim)
    return out


def build(args: argparse.Namespace) -> tuple[list[Variant], dict[str, Any]]:
    """Every variant, checked against the single-process block (collective)."""
    rank, b = dist.get_rank(), args.batch
    kw = block_kwargs(args)
    torch.manual_seed(0)
    ref = TransformerLayer(**kw)
    x = torch.randn(b, args.seq, args.hidden)
    g = torch.randn(b, args.seq, args.hidden)
    xr = _input(x, 0, b)
    want = ref((xr, None))[0]
    want.backward(g)
    want = want.detach()
    assert xr.grad is not None
    want_dx = xr.grad.detach()
    want_grads = {}
    for n, p in ref.named_parameters():
        assert p.grad is not None, n
        want_grads[n] = p.grad.detach().clone()
    variants: list[Variant] = []
    info: dict[str, Any] = {}

    def single(threads: int) -> Variant:
        xs = _input(x, 0, b)

        def step() -> None:
            ref.zero_grad(set_to_none=True)
            xs.grad = None
            ref((xs, None))[0].backward(g)

        return Variant(f"single-{threads}t", f"single process, {threads} thread{'s' * (threads > 1)}",
                       "single", b, step, threads=threads)  # fmt: skip

    variants += [single(1), single(2)]

    # peer: torch's tensor parallelism, the same batch on both ranks
    peer = parallelize_peer(ref, init_device_mesh("cpu", (RANKS,)))
    xp = _input(x, 0, b)
    out = peer(xp)
    out.backward(g)
    assert xp.grad is not None
    grads = peer_full_grads(peer)
    check = {"output": _rel(out.detach(), want), "input.grad": _rel(xp.grad, want_dx)}
    check |= {f"{n}.grad": _rel(grads[n], want_grads[n]) for n in want_grads}
    peer_out = out.detach()

    def peer_step(module: PeerBlock = peer, xs: Tensor = xp) -> None:
        module.zero_grad(set_to_none=True)
        xs.grad = None
        module(xs).backward(g)

    variants.append(
        Variant("peer", "peer: torch TP, Colwise/Rowwise, same batch", "peer", b, peer_step, check=check)
    )

    # ours: the context smp.init built, and the same with optimize / prescaled_batch changed
    base = tp_context()
    assert base is not None and base.optimize == "speed" and base.prescaled_batch
    for key, label, ctx, config in (
        ("speed-prescaled", "ours: speed, prescaled_batch (same batch)", None, "smp.init config"),
        ("speed-tp-across-dp", "ours: speed, TP across DP (batch/2 per rank)",
         base.with_(prescaled_batch=False), "config valid (optimize speed)"),
        ("memory-tp-across-dp", "ours: memory, TP across DP (batch/2 per rank)",
         base.with_(optimize="memory", prescaled_batch=False), "config valid (optimize memory)"),
        ("memory-prescaled", "ours: memory, prescaled via TPContext (same batch)",
         base.with_(optimize="memory"), "mp_tensor TPContext only: the config rejects it"),
    ):  # fmt: skip
        torch.manual_seed(0)
        layer = (
            smp.nn.DistributedTransformerLayer(**kw)  # the context from smp.init
            if ctx is None
            else DistributedTransformerLayer(**kw, tp=ctx)
        )
        layer.load_full_state_dict(ref.state_dict())
        tpc: TPContext = layer.tp
        if not all(is_scaled_batch_parameter(p) for p in layer.parameters()):
            raise AssertionError(f"{key}: a parameter needs a data-parallel gradient reduction")
        lo, hi = (0, b) if tpc.prescaled_batch else (rank * b // RANKS, (rank + 1) * b // RANKS)
        xo, go = _input(x, lo, hi), g[lo:hi].contiguous()
        out = layer((xo, None))[0]
        out.backward(go)
        assert xo.grad is not None
        grads = _ours_full_grads(layer)
        check = {"output": _rel(out.detach(), want[lo:hi]), "input.grad": _rel(xo.grad, want_dx[lo:hi])}
        check |= {f"{n}.grad": _rel(grads[n], want_grads[n]) for n in want_grads}
        if tpc.prescaled_batch:
            check["output vs peer"] = _rel(out.detach(), peer_out)

        def ours_step(module: nn.Module = layer, xs: Tensor = xo, gs: Tensor = go) -> None:
            module.zero_grad(set_to_none=True)
            xs.grad = None
            module((xs, None))[0].backward(gs)

        variants.append(Variant(key, label, "ours", hi - lo, ours_step, config=config, check=check))

    # the worst difference over both ranks, per variant and tensor
    for v in variants:
        if not v.check:
            continue
        names = sorted(v.check)
        worst = torch.tensor([v.check[n] for n in names], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        v.check = dict(zip(names, worst.tolist(), strict=True))
        bad = {n: d for n, d in v.check.items() if not d <= TOL}
        if bad:
            raise AssertionError(f"{v.key} differs from the single-process block: {bad}")
    try:
        load_config({"tensor_parallel_degree": 2, "optimize": "memory", "prescaled_batch": True})
        info["config_memory_prescaled"] = "accepted"
    except ValueError as exc:
        info["config_memory_prescaled"] = f"rejected: {exc}"
    return variants, info


def count_collectives(v: Variant) -> None:
    """Record the collectives of one step of ``v`` (ours: every ``torch.distributed`` call, with sizes;
    the peer: DTensor's functional collectives, counts only, as ``CommDebugMode`` sees them)."""
    if v.kind == "ours":
        calls = CommProbe().record(v.step)
        v.replay = Replay(calls)
        for call in calls:
            entry = v.collectives.setdefault(call.name, {"calls": 0, "input_mb": 0.0})
            entry["calls"] += 1
            entry["input_mb"] += call.nbytes / 2**20
    elif v.kind == "peer":
        mode = CommDebugMode()  # type: ignore[no-untyped-call]
        with mode:
            v.step()
        for op, n in mode.get_comm_counts().items():
            v.collectives[str(op).split(".")[-1]] = {"calls": n}


def _slowest(value: float) -> float:
    """The largest of every rank's ``value`` (NaN on a rank that did not run); collective."""
    t = torch.tensor([value], dtype=torch.float64)
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return float(torch.stack(rows).nan_to_num(nan=-1.0).max())


def run(v: Variant, steps: int) -> float:
    """``steps`` steps of ``v``; the slowest rank's seconds per step (collective)."""
    dist.barrier()
    elapsed = float("nan")
    if v.kind != "single" or dist.get_rank() == 0:
        torch.set_num_threads(v.threads)
        with on_all_cores() if v.threads > 1 else contextlib.nullcontext():
            start = time.perf_counter()
            for _ in range(steps):
                v.step()
            elapsed = (time.perf_counter() - start) / steps
        torch.set_num_threads(1)
    return _slowest(elapsed)


def replay(v: Variant, steps: int) -> float:
    """``steps`` replays of ``v``'s recorded collectives; the slowest rank's seconds per replay."""
    assert v.replay is not None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        v.replay.run()
    return _slowest((time.perf_counter() - start) / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--replays", type=int, default=5, help="rounds of communication-only replays")
    args = parser.parse_args()
    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": 2, "optimize": "speed", "prescaled_batch": True})
    if dist.get_world_size() != RANKS:
        raise SystemExit(f"run under mpiexec -n {RANKS} (got {dist.get_world_size()} ranks)")
    variants, info = build(args)
    for v in variants:
        count_collectives(v)
        run(v, args.warmup)
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    for r in range(args.rounds):
        if r:
            load.append(os.getloadavg()[0])
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            v.step_s.append(run(v, args.steps))
    seconds = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    ours = [v for v in variants if v.replay is not None]
    for r in range(args.replays):  # the communication alone, interleaved the same way
        k = r % len(ours)
        for v in ours[k:] + ours[:k]:
            v.replay_s.append(replay(v, args.steps))
    if dist.get_rank() == 0:
        report(args, variants, info, seconds, load)
    smp.shutdown()


# -------------------------------------------------------------------------------------------- report


def _q(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _summary(values: list[float]) -> dict[str, float]:
    q1, q3 = _q(values)
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def _sign_test(k: int, n: int) -> float:
    """Two-sided sign-test p-value of ``k`` wins in ``n`` rounds if neither side were faster."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / (1 << n)
    return min(1.0, 2 * tail)


def _paired(ours: Variant, other: Variant) -> dict[str, Any]:
    """Per round: ``other``'s step time over ``ours`` (= our tokens/s over theirs); summary over rounds.

    Verdict: "faster" / "slower" when a two-sided sign test over the rounds rejects "neither is faster"
    (p < 0.05), else "within noise".
    """
    ratios = [o / s for s, o in zip(ours.step_s, other.step_s, strict=True)]
    wins, n = sum(r > 1 for r in ratios), len(ratios)
    p = _sign_test(wins, n)
    verdict = "within noise" if p >= 0.05 else ("faster" if wins > n - wins else "slower")
    return {**_summary(ratios), "rounds_faster": wins, "rounds": n, "sign_test_p": p, "verdict": verdict}


def report(
    args: argparse.Namespace, variants: list[Variant], info: dict[str, Any], seconds: float, load: list[float]
) -> None:
    tokens = args.batch * args.seq
    by = {v.key: v for v in variants}
    peer, one, two = by["peer"], by["single-1t"], by["single-2t"]
    rows: list[dict[str, Any]] = []
    for v in variants:
        rates = [tokens / t for t in v.step_s]
        rows.append(
            {
                "key": v.key,
                "variant": v.label,
                "kind": v.kind,
                "config": v.config,
                "per_rank_batch": v.per_rank_batch,
                "threads_per_process": v.threads,
                "tokens_per_s": _summary(rates),
                "ms_per_step": _summary([1e3 * t for t in v.step_s]),
                "over_peer": None if v is peer or v.kind == "single" else _paired(v, peer),
                "over_single_1_thread": _paired(v, one),
                "over_single_2_threads": _paired(v, two),
                "check_max_rel_diff": v.check or None,
                "collectives_per_step": v.collectives or None,
                "comm_replay_ms": _summary([1e3 * t for t in v.replay_s]) if v.replay_s else None,
                "step_ms_rounds": [1e3 * t for t in v.step_s],
            }
        )
    data = {
        "benchmark": "tensor_gpt_block",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ranks": RANKS,
        "backend": "gloo",
        "threads_per_rank": 1,
        "block": {**vars(args), **block_kwargs(args), "dtype": "float32", "global_tokens_per_step": tokens},
        "check_tolerance_rel": TOL,
        "config_memory_prescaled": info["config_memory_prescaled"],
        "timing_seconds": seconds,
        "load_average_1min_before_rounds_after": load,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tensor_gpt_block.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# GPT block, tp=2: smp's DistributedTransformerLayer vs torch.distributed.tensor.parallel",
        "",
        f"One pre-LayerNorm GPT block (hidden {args.hidden}, {args.heads} heads, MLP {4 * args.hidden}, "
        f"gelu_new, causal), float32, forward + backward; global batch {args.batch} x seq {args.seq} = "
        f"{tokens} tokens per step; 2 ranks on gloo, 1 thread each, {os.cpu_count()} cores. Median of "
        f"{args.rounds} interleaved rounds (order rotated) of {args.steps} steps; step time = slowest rank. "
        "*ours / peer*: median over rounds of the peer's step time over ours in the same round (> 1: ours "
        "faster), q1-q3 in brackets; *rounds faster, p*: rounds in which ours was faster than the peer and "
        "the two-sided sign-test p-value (verdict at p < 0.05). *vs 1 proc*: the single-process block's "
        "step time over this variant's, paired the same way (1 thread; 2 threads). Host load average "
        f"(1 min) {load[0]:.1f} before the timing, {statistics.median(load):.1f} median over the run, "
        f"{load[-1]:.1f} after, on {os.cpu_count()} cores: other jobs shared the machine.",
        "",
        "| variant | batch / rank | tokens/s (q1-q3) | min-max | ours / peer (q1-q3) | rounds faster, p "
        "| vs 1 proc 1 thr | vs 1 proc 2 thr |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["tokens_per_s"]
        p = r["over_peer"]
        peer_cell = f"**{p['median']:.2f}** ({p['q1']:.2f}-{p['q3']:.2f})" if p else "-"
        sign = f"{p['rounds_faster']}/{p['rounds']}, {p['sign_test_p']:.3f} ({p['verdict']})" if p else "-"
        s1, s2 = r["over_single_1_thread"], r["over_single_2_threads"]
        lines.append(
            f"| {r['variant']} | {r['per_rank_batch']} | "
            f"{t['median']:,.0f} ({t['q1']:,.0f}-{t['q3']:,.0f}) | {t['min']:,.0f}-{t['max']:,.0f} | "
            f"{peer_cell} | {sign} | {s1['median']:.2f} | {s2['median']:.2f} |"
        )
    lines += [
        "",
        "Checked before timing against the single-process block on the full batch (largest |difference| / "
        f"max(max |reference|, 1), worst of both ranks; tolerance {TOL:g}): output, input gradient, every "
        "parameter gradient (shards gathered); ours on the same batch also against the peer's output.",
        "",
        "| variant | output | input grad | worst parameter grad | output vs peer |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["check_max_rel_diff"]
        if not c:
            continue
        params = {k: d for k, d in c.items() if k not in ("output", "input.grad", "output vs peer")}
        worst = max(params, key=lambda k: params[k])
        vs_peer = f"{c['output vs peer']:.1e}" if "output vs peer" in c else "-"
        lines.append(
            f"| {r['variant']} | {c['output']:.1e} | {c['input.grad']:.1e} | "
            f"{params[worst]:.1e} ({worst}) | {vs_peer} |"
        )
    lines += [
        "",
        "Collectives per step on one rank (calls; MB of input tensors passed in). Ours: every "
        "`torch.distributed` call, recorded; the peer: DTensor's functional collectives as `CommDebugMode` "
        "counts them (no sizes).",
        "",
        f"*replay*: the same collectives issued back to back without the computation, median of "
        f"{args.replays} interleaved rounds after the timing (slowest rank), and its share of the median "
        "step; the peer's four all-reduces have the sizes of ours in speed/prescaled_batch.",
        "",
        "| variant | collectives per step | replay ms (share of step) |",
        "|---|---|---:|",
    ]
    for r in rows:
        c = r["collectives_per_step"]
        if not c:
            continue
        rep = r["comm_replay_ms"]
        rep_cell = (
            f"{rep['median']:.1f} ({100 * rep['median'] / r['ms_per_step']['median']:.0f} %)" if rep else "-"
        )
        cells = [
            f"{op} x{e['calls']}" + (f" ({e['input_mb']:.1f} MB)" if "input_mb" in e else "")
            for op, e in sorted(c.items())
        ]
        lines.append(f"| {r['variant']} | {', '.join(cells)} | {rep_cell} |")
    lines += [
        "",
        f"smp's config with optimize 'memory' and prescaled_batch: {info['config_memory_prescaled']}",
        "",
    ]
    (RESULTS / "tensor_gpt_block.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
