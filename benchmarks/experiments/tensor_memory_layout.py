"""One GPT block in "memory" mode at tp=2: its reduce-scattered linear maps rank-major (mp's layout) against
the strided layout they had before (``F.linear``, then a reduce-scatter along the last dimension).

The block is ``smp.nn.DistributedTransformerLayer`` (the benchmark GPT-2's sizes by default: hidden
256, 4 heads, pre-LayerNorm, gelu_new, causal, no dropout, float32), built through
``smp.init({"tensor_parallel_degree": 2, "optimize": "memory"})``, each rank fed its own ``batch/2``
samples (TP across DP), forward + backward with a fixed upstream gradient. The *strided* variant is the
same module with its four reduce-scatters per pass (q/k/v stacked, attention output, MLP in, MLP out)
computed as before: the partial output in ``F.linear``'s layout, reduce-scattered along the channels, so
MPICH's path copies it block-major first and the backward all-gather receives into a strided datatype.
Both are checked equal (output, input and parameter gradients), then timed interleaved (``--rounds``
rounds, ``--steps`` steps each, order alternating; the slowest rank's time), and one step of each is
profiled on rank 0 (the top operators by self CPU time).

    python -m benchmarks.experiments.tensor_memory_layout [--batch 8 --seq 128 --hidden 256 --heads 4]

starts itself under ``mpiexec -n 2``; writes ``benchmarks/results/tensor_memory_layout.{json,md}``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from benchmarks._launch import relaunch, under_mpi

RANKS = 2
if __name__ == "__main__" and not under_mpi():
    sys.exit(relaunch(__file__, RANKS))

import mp as smp  # noqa: E402
from mp.tensor_api import tp_context  # noqa: E402
from mp_comm import collectives as col  # noqa: E402
from mp_tensor.hf import block as hf_block  # noqa: E402
from mp_tensor.nn import attention, output  # noqa: E402
from mp_tensor.nn.rank_major import linear_reduce_scatter  # noqa: E402
from mp_tensor.nn.transformer import DistributedTransformerLayer  # noqa: E402

MODULES = (attention, output, hf_block)


def strided(
    pairs: Sequence[tuple[Tensor, Tensor]], group: Any, outputs: Sequence[int] | None = None
) -> list[Tensor]:
    """The previous layout: ``F.linear`` partials (outputs of one shape stacked), reduce-scattered on -1."""
    index = list(range(len(pairs))) if outputs is None else list(outputs)
    sums: dict[int, Tensor] = {}
    for (x, w), i in zip(pairs, index, strict=True):
        y = F.linear(x, w)
        sums[i] = y if i not in sums else sums[i] + y
    parts = [sums[i] for i in range(len(sums))]
    if len(parts) > 1 and len({p.shape for p in parts}) == 1:
        return list(col.reduce_scatter(torch.stack(parts, dim=-2), -1, group).unbind(-2))
    return [col.reduce_scatter(p, -1, group) for p in parts]


def use(impl: Callable[..., list[Tensor]]) -> None:
    for module in MODULES:
        module.linear_reduce_scatter = impl  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "results" / "tensor_memory_layout")
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": RANKS, "optimize": "memory"})
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = DistributedTransformerLayer(
        num_attention_heads=a.heads, attention_head_size=a.hidden // a.heads, hidden_size=a.hidden,
        intermediate_size=4 * a.hidden, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
        activation="gelu_new", causal_mask_size=a.seq, pre_layernorm=True, post_layernorm=False,
        tp=tp_context(),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    local = a.batch // RANKS
    x = torch.randn(a.batch, a.seq, a.hidden, generator=gen)[rank * local : (rank + 1) * local]
    g = torch.randn(a.batch, a.seq, a.hidden, generator=gen)[rank * local : (rank + 1) * local]
    xs = x.clone().requires_grad_(True)

    def step() -> tuple[Tensor, Tensor, list[Tensor]]:
        layer.zero_grad(set_to_none=True)
        xs.grad = None
        out = layer((xs, None))[0]
        out.backward(g)
        assert xs.grad is not None
        return out.detach(), xs.grad.detach(), [q.grad.detach().clone() for q in layer.parameters()]  # type: ignore[union-attr]

    impls = {"rank-major": linear_reduce_scatter, "strided": strided}
    results: dict[str, Any] = {}
    for key, impl in impls.items():
        use(impl)
        results[key] = step()
    (o1, d1, g1), (o2, d2, g2) = results["rank-major"], results["strided"]
    diff = max(
        [(o1 - o2).abs().max().item(), (d1 - d2).abs().max().item()]
        + [(u - v).abs().max().item() for u, v in zip(g1, g2, strict=True)]
    )
    times: dict[str, list[float]] = {k: [] for k in impls}
    ratios: list[float] = []
    load = [os.getloadavg()]
    for r in range(a.rounds):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))
        per: dict[str, float] = {}
        for key in order:
            use(impls[key])
            step()  # warm
            dist.barrier()
            start = time.perf_counter()
            for _ in range(a.steps):
                step()
            t = torch.tensor([(time.perf_counter() - start) / a.steps], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            per[key] = float(t)
            times[key].append(per[key])
        ratios.append(per["strided"] / per["rank-major"])
    load.append(os.getloadavg())
    profiles: dict[str, list[tuple[str, float]]] = {}
    for key, impl in impls.items():
        use(impl)
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        profiles[key] = [(e.key, e.self_cpu_time_total / 1e3) for e in rows[:8]]
    use(linear_reduce_scatter)
    if rank == 0:
        report = {
            "args": vars(a),
            "max_abs_diff": diff,
            "step_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "ratio_strided_over_rank_major": sorted(ratios),
            "median_ratio": statistics.median(ratios),
            "rounds_rank_major_faster": sum(r > 1 for r in ratios),
            "load_avg_before_after": load,
            "profile_top_self_cpu_ms": profiles,
        }
        Path(a.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(a.out + ".md").write_text(_markdown(report))
        print(_markdown(report))
    smp.shutdown()


def _markdown(r: dict[str, Any]) -> str:
    a = r["args"]
    q = r["ratio_strided_over_rank_major"]
    lines = [
        "# One GPT block, memory mode, tp=2: rank-major against strided reduce-scatters",
        "",
        f"`DistributedTransformerLayer` hidden {a['hidden']}, {a['heads']} heads, seq {a['seq']}, "
        f"global batch {a['batch']} (each rank its half), forward + backward, float32, 2 ranks under "
        f"mpiexec (MPICH), 1 thread each. {a['rounds']} interleaved rounds of {a['steps']} steps. "
        f"Outputs and gradients of the two agree to {r['max_abs_diff']:.1e}. Load average before/after: "
        + ", ".join("/".join(f"{v:.1f}" for v in la) for la in r["load_avg_before_after"])
        + ".",
        "",
        "| layout | step ms, median |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in r["median_ms"].items()]
    lines += [
        "",
        f"Strided over rank-major, per round: median **{r['median_ratio']:.2f}x** "
        f"(range {q[0]:.2f}-{q[-1]:.2f}), "
        f"rank-major faster in {r['rounds_rank_major_faster']}/{len(q)} rounds.",
        "",
        "Top operators by self CPU time in one profiled step (rank 0, ms):",
        "",
    ]
    for key, rows in r["profile_top_self_cpu_ms"].items():
        lines.append(f"- {key}: " + ", ".join(f"{name} {ms:.1f}" for name, ms in rows))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
