"""ATP meshes against Megatron-style 1-D tensor parallelism on this machine (4 ranks).

One GPT block (pre-LayerNorm transformer layer, forward + backward, float32) is timed for

* peer: PyTorch's own 1-D tensor parallelism, ``torch.distributed.tensor.parallel`` with
  ``ColwiseParallel`` on the QKV and first MLP linears and ``RowwiseParallel`` on the output and second
  MLP linears (Megatron-LM's layout), on a layer with the same weights;
* ours: ``ATPTransformerLayer`` on ``DeviceMesh(4, 1)`` (Megatron's layout in ATP), ``(2, 2)`` and
  ``(1, 4)``, each with chunks 1, 2 and 4, and ``(4, 1)`` with the ordered (deterministic) all-reduce.

First the meshes' all-reduce bandwidths are calibrated here (``calibrate``) and the search
(``choose_mesh``, equation 2) run on them for this layer: it predicts each mesh's communication time and
selects one. Every configuration is built once and checked against the single-device layer, and the
collectives one step of each ATP configuration issues are recorded (``_atp_comm.CommProbe``, which wraps
``torch.distributed``'s entry points from outside the library). Then, ``--reps`` rounds, interleaved
since the host is noisy, each configuration runs

* ``--steps`` training steps (the slowest rank's time per step), during which the probe adds up the time
  every rank spends blocked in a collective (the call, or the launch and ``wait`` of an asynchronous one);
* ``--steps`` replays of its recorded collectives: the same calls, sizes, groups and order, synchronous,
  without the GEMMs (the slowest rank's time), i.e. the step's communication on its own, which is what
  equation 2 predicts.

Reported per configuration (medians over rounds): ms per step, tokens/s (``b*s`` tokens per step),
the peer's time over ours (median of the per-round ratios), the replayed communication time and the
blocked time and their shares of the step; per mesh: predicted against measured communication time and
the error; and whether the selected mesh is slower than the 1-D layouts (a sign test over the rounds),
with the calibration repeated to show how stable the selection is.

    python -m benchmarks.atp_meshes [--hidden 256 --heads 8 --batch 8 --seq 256 --reps 11 --steps 3]

starts itself under ``mpiexec -n 4`` (or run it as ``mpiexec -n 4 python -m benchmarks.atp_meshes``).
Writes ``benchmarks/results/atp_meshes.json`` and ``.md`` (rank 0).
"""

import argparse
import copy
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

from benchmarks._launch import relaunch, under_mpi

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 4
PEER = "peer torch TP 1-D"


if __name__ == "__main__" and not under_mpi():
    sys.exit(relaunch(__file__, RANKS))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from benchmarks._atp_comm import CATEGORIES, LINEAR, CommProbe, Replay  # noqa: E402
from mp_comm.world import init_world  # noqa: E402
from mp_tensor.atp import (  # noqa: E402
    ATPTransformerLayer,
    ModelShape,
    SearchResult,
    TransformerLayer,
    calibrate,
    choose_mesh,
    create_mesh,
)
from mp_tensor.atp.layer import ACTIVATION_SPEC, attention_core  # noqa: E402
from mp_tensor.atp.spec import distribute  # noqa: E402


class PeerLayer(nn.Module):
    """The reference layer with QKV rows head-major, so that a column split keeps whole heads."""

    def __init__(self, ref: TransformerLayer) -> None:
        super().__init__()
        ref = copy.deepcopy(ref)  # parallelize_module turns the parameters into DTensors
        self.ln1, self.proj, self.ln2, self.fc1, self.fc2 = ref.ln1, ref.proj, ref.ln2, ref.fc1, ref.fc2
        self.head_dim = ref.hidden // ref.heads
        self.qkv = nn.Linear(ref.hidden, 3 * ref.hidden)
        with torch.no_grad():
            for name in ("weight", "bias"):
                t = getattr(ref.qkv, name)
                rest = t.shape[1:]
                heads_major = t.reshape(3, ref.heads, self.head_dim, *rest).transpose(0, 1)
                getattr(self.qkv, name).copy_(heads_major.reshape(3 * ref.hidden, *rest))

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, -1, 3, self.head_dim).unbind(3)
        context = attention_core(q, k, v, causal=True)
        x = x + self.proj(context.reshape(b, s, -1))
        out: Tensor = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return out


def _step_fn(module: nn.Module, x: Tensor, g: Tensor) -> Callable[[], Tensor]:
    """One training step of ``module``; ``x`` needs its gradient, as the input of a block inside a model."""
    x = x.detach().contiguous().requires_grad_(True)

    def step() -> Tensor:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out: Tensor = module(x)
        out.backward(g)  # type: ignore[no-untyped-call]
        return out

    return step


@dataclass
class Config:
    """One timed configuration; ``mesh`` is None for the peer."""

    name: str
    step: Callable[[], Tensor]
    mesh: tuple[int, int] | None = None
    chunks: int = 1
    ordered: bool = False
    replay: Replay | None = None
    step_s: list[float] = field(default_factory=list)
    """Per round: the slowest rank's seconds per step."""
    blocked_s: list[float] = field(default_factory=list)
    """Per round: seconds per step blocked in collectives, mean over ranks."""
    replay_s: list[float] = field(default_factory=list)
    """Per round: the slowest rank's seconds per replay of the step's collectives."""
    replay_parts_s: list[dict[str, float]] = field(default_factory=list)
    """Per round: that rank's seconds per replay by category."""


def build(args: argparse.Namespace, world: Any) -> tuple[list[Config], list[Any]]:
    torch.manual_seed(0)
    ref = TransformerLayer(args.hidden, args.heads)
    x = torch.randn(args.batch, args.seq, args.hidden)
    g = torch.randn(args.batch, args.seq, args.hidden)
    expected = ref(x).detach()
    configs: list[Config] = []
    keep: list[Any] = []
    # peer: torch's 1-D tensor parallelism
    peer = PeerLayer(ref)
    tp_mesh = init_device_mesh("cpu", (world.size,))
    parallelize_module(
        peer,
        tp_mesh,
        {
            "qkv": ColwiseParallel(),
            "proj": RowwiseParallel(),
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(),
        },
    )
    torch.testing.assert_close(peer(x), expected, rtol=1e-4, atol=1e-4)
    configs.append(Config(PEER, _step_fn(peer, x, g)))
    for shape in ((4, 1), (2, 2), (1, 4)):
        mesh = create_mesh(shape)
        keep.append(mesh)
        xl, gl = (
            distribute(x, ACTIVATION_SPEC, mesh).contiguous(),
            distribute(g, ACTIVATION_SPEC, mesh).contiguous(),
        )
        want = distribute(expected, ACTIVATION_SPEC, mesh)
        for chunks in (1, 2, 4):
            layer = ATPTransformerLayer.from_reference(ref, mesh=mesh, chunks=chunks)
            torch.testing.assert_close(layer(xl), want, rtol=1e-4, atol=1e-4)
            configs.append(Config(f"ATP {shape} chunks={chunks}", _step_fn(layer, xl, gl), shape, chunks))
        if shape == (4, 1):
            det = ATPTransformerLayer.from_reference(ref, mesh=mesh, deterministic=True)
            torch.testing.assert_close(det(xl), want, rtol=1e-4, atol=1e-4)
            configs.append(
                Config(f"ATP {shape} ordered all-reduce", _step_fn(det, xl, gl), shape, 1, ordered=True)
            )
    return configs, keep


def _gather(values: list[float]) -> Tensor:
    """``[ranks, len(values)]``: every rank's values (collective)."""
    mine = torch.tensor(values, dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def time_all(configs: list[Config], probe: CommProbe, reps: int, per: int) -> None:
    for c in configs:  # warm-up, and the recording of each ATP step's collectives
        if c.mesh is not None:
            c.replay = Replay(probe.record(c.step))
            c.replay.run()
        c.step()
    for _ in range(reps):
        for c in configs:
            dist.barrier()
            probe.blocked = 0.0
            with probe.active():
                start = time.perf_counter()
                for _ in range(per):
                    c.step()
                elapsed = time.perf_counter() - start
            ranks = _gather([elapsed / per, probe.blocked / per])
            c.step_s.append(float(ranks[:, 0].max()))
            if c.replay is None:
                continue
            c.blocked_s.append(float(ranks[:, 1].mean()))
            dist.barrier()
            parts = dict.fromkeys(CATEGORIES, 0.0)
            start = time.perf_counter()
            for _ in range(per):
                for k, v in c.replay.run().items():
                    parts[k] += v / per
            elapsed = time.perf_counter() - start
            ranks = _gather([elapsed / per, *(parts[k] for k in CATEGORIES)])
            slowest = int(ranks[:, 0].argmax())
            c.replay_s.append(float(ranks[slowest, 0]))
            c.replay_parts_s.append({k: float(ranks[slowest, 1 + i]) for i, k in enumerate(CATEGORIES)})


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--recalibrations", type=int, default=4, help="calibrated searches after the timing")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world = init_world()
    if world.size != RANKS:
        raise SystemExit(f"run under mpiexec -n {RANKS} (got {world.size} ranks)")
    model = ModelShape(layers=1, batch=args.batch, seq=args.seq, hidden=args.hidden, bytes_per_element=4)
    nbytes = args.batch * args.seq * args.hidden * 4  # the layer's [b, s, h] activation

    def calibrated_search() -> SearchResult:
        """Calibrate this machine and search, as smp.init does with ``atp_mesh: "auto"``."""
        return choose_mesh(RANKS, calibrate(nbytes=nbytes, iters=5, repeats=5), model)

    search = calibrated_search()  # this one selects the mesh
    configs, meshes = build(args, world)
    load = [os.getloadavg()[0]]  # the host is shared: record how busy it was
    start = time.perf_counter()
    time_all(configs, CommProbe(), args.reps, args.steps)
    seconds = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    again = [calibrated_search() for _ in range(args.recalibrations)]  # how repeatable is the choice here?
    for mesh in meshes:
        mesh.destroy()
    if world.rank == 0:
        report(args, configs=configs, search=search, again=again, seconds=seconds, load=load)
    world.shutdown()


# -------------------------------------------------------------------------------------------- report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _sign_test(slower: int, rounds: int) -> float:
    """One-sided p-value of ``slower`` or more slower rounds out of ``rounds`` if neither were faster."""
    return sum(math.comb(rounds, k) for k in range(slower, rounds + 1)) / (1 << rounds)


def _paired(a: Config, b: Config) -> dict[str, Any]:
    """``a``'s step time against ``b``'s, round by round (same round: same host conditions).

    Verdict: "not slower" if the median per-round ratio is at most 1; otherwise "slower" if ``a`` was
    slower in so many rounds that a sign test rejects "neither is faster" (one-sided, p < 0.05), else
    "within noise".
    """
    ratios = [x / y for x, y in zip(a.step_s, b.step_s, strict=True)]
    median = statistics.median(ratios)
    q1, q3 = _quartiles(ratios)
    slower = sum(r > 1.0 for r in ratios)
    p_value = _sign_test(slower, len(ratios))
    if median <= 1.0:
        verdict = "not slower"
    elif p_value < 0.05:
        verdict = "slower"
    else:
        verdict = "within noise"
    return {
        "a": a.name,
        "b": b.name,
        "median_ratio": median,
        "q1": q1,
        "q3": q3,
        "min": min(ratios),
        "max": max(ratios),
        "rounds_a_slower": slower,
        "rounds": len(ratios),
        "sign_test_p": p_value,
        "verdict": verdict,
    }


def report(
    args: argparse.Namespace,
    *,
    configs: list[Config],
    search: SearchResult,
    again: list[SearchResult],
    seconds: float,
    load: list[float],
) -> None:
    by_name = {c.name: c for c in configs}
    peer = by_name[PEER]
    tokens = args.batch * args.seq
    chosen = search.mesh
    predicted = {(e.d1, e.d2): e.t_comm for e in search.table}
    rows: list[dict[str, Any]] = []
    for c in configs:
        step = _median(c.step_s)
        replay = _median(c.replay_s)
        blocked = _median(c.blocked_s)
        rows.append(
            {
                "config": c.name,
                "mesh": list(c.mesh) if c.mesh else None,
                "chunks": c.chunks,
                "ordered": c.ordered,
                "selected": c.mesh == chosen,
                "ms_per_step": 1e3 * step,
                "min_ms": 1e3 * min(c.step_s),
                "max_ms": 1e3 * max(c.step_s),
                "tokens_per_s": tokens / step,
                "peer_over_ours": 1 / _paired(c, peer)["median_ratio"],
                "comm_replay_ms": 1e3 * replay if c.replay_s else None,
                "comm_replay_share": replay / step if c.replay_s else None,
                "comm_blocked_ms": 1e3 * blocked if c.blocked_s else None,
                "comm_blocked_share": blocked / step if c.blocked_s else None,
                "comm_replay_parts_ms": {
                    k: 1e3 * _median([p[k] for p in c.replay_parts_s]) for k in CATEGORIES
                }
                if c.replay_parts_s
                else None,
                "predicted_comm_ms": 1e3 * predicted[c.mesh] if c.mesh else None,
                "collectives": c.replay.summary() if c.replay else None,
                "step_ms_rounds": [1e3 * t for t in c.step_s],
                "comm_replay_ms_rounds": [1e3 * t for t in c.replay_s],
            }
        )
    accuracy: list[dict[str, Any]] = []
    for shape in ((4, 1), (2, 2), (1, 4)):
        c = by_name[f"ATP {shape} chunks=1"]
        total = _median(c.replay_s)
        linear = _median([p[LINEAR] for p in c.replay_parts_s])
        pred = predicted[shape]
        every = [  # the same prediction from each calibration of this run
            next(e.t_comm for e in result.table if (e.d1, e.d2) == shape) for result in (search, *again)
        ]
        accuracy.append(
            {
                "mesh": list(shape),
                "selected": shape == chosen,
                "predicted_ms": 1e3 * pred,
                "measured_all_ms": 1e3 * total,
                "error_all": (pred - total) / total,
                "measured_linear_ms": 1e3 * linear,
                "error_linear": (pred - linear) / linear,
                "measured_all_q1_q3_ms": [1e3 * v for v in _quartiles(c.replay_s)],
                "predicted_ms_every_calibration": [1e3 * t for t in every],
                "error_all_every_calibration": [(t - total) / total for t in every],
            }
        )
    order_pred = sorted(accuracy, key=lambda a: a["predicted_ms"])
    order_meas = sorted(accuracy, key=lambda a: a["measured_all_ms"])
    order_step = sorted(((4, 1), (2, 2), (1, 4)), key=lambda s: _median(by_name[f"ATP {s} chunks=1"].step_s))
    order: dict[str, list[list[int]]] = {
        "predicted": [a["mesh"] for a in order_pred],
        "measured_comm": [a["mesh"] for a in order_meas],
        "measured_step": [list(s) for s in order_step],
    }
    best = by_name[f"ATP {chosen} chunks=1"]
    one_d = by_name["ATP (4, 1) chunks=1"]
    comparisons = [_paired(best, one_d), _paired(best, peer)]
    meshes_vs_1d = [_paired(by_name[f"ATP {shape} chunks=1"], one_d) for shape in ((2, 2), (1, 4))]
    data = {
        "benchmark": "atp_meshes",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ranks": RANKS,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "layer": vars(args),
        "timing_seconds": seconds,
        "load_average_1min_before_after": load,
        "selected_mesh": list(chosen),
        "rows": rows,
        "prediction": accuracy,
        "order": order,
        "selected_vs_1d": comparisons,
        "meshes_vs_4x1": meshes_vs_1d,
        "search_on_calibrated_bandwidths": search.to_dict(),
        "searches_recalibrated_after_timing": [a.to_dict() for a in again],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "atp_meshes.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# ATP meshes vs 1-D tensor parallelism (4 ranks, this machine)",
        "",
        f"One GPT block, h={args.hidden}, heads={args.heads}, b={args.batch}, s={args.seq}, float32, "
        f"forward + backward, {RANKS} ranks on {os.cpu_count()} cores; median of {args.reps} interleaved "
        f"rounds of {args.steps} steps, slowest rank. tokens/s = b*s / step time. "
        "*peer / ours (paired)*: median over the rounds of the "
        "peer's step time over ours in the same round. *comm replay*: the "
        "step's recorded collectives issued alone (same sizes, groups, order; no GEMMs). *blocked*: time "
        "the ranks spend waiting in collectives during the real steps (mean over ranks). "
        f"**selected**: the mesh the calibrated search chose, {chosen}. The peer's collectives are "
        "DTensor's functional ones, which the probe does not see (they are the four all-reduces of "
        f"ATP (4, 1) chunks=1). Host load average (1 min) {load[0]:.1f} before and {load[1]:.1f} after "
        "the timing.",
        "",
        "| configuration | ms / step | min-max ms | tokens/s | peer / ours (paired) | comm replay ms (share) "
        "| blocked ms (share) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = " **selected**" if r["selected"] else ""
        replay_cell = (
            f"{r['comm_replay_ms']:.1f} ({100 * r['comm_replay_share']:.0f} %)"
            if r["comm_replay_ms"] is not None
            else "-"
        )
        blocked_cell = (
            f"{r['comm_blocked_ms']:.1f} ({100 * r['comm_blocked_share']:.0f} %)"
            if r["comm_blocked_ms"] is not None
            else "-"
        )
        lines.append(
            f"| {r['config']}{mark} | {r['ms_per_step']:.1f} | {r['min_ms']:.1f}-{r['max_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['peer_over_ours']:.2f} | {replay_cell} | {blocked_cell} |"
        )
    lines += [
        "",
        "Predicted (equation 2 on the calibrated bandwidths) against measured communication per step "
        "(chunks=1; error = (predicted - measured) / measured). *all*: every collective of the step; "
        "*linear*: only the f1-f4 all-reduces, the ones equation 2 counts. *every calibration*: the error "
        "range of the predictions from all the calibrations of this run (see Repeatability below).",
        "",
        "| mesh | predicted ms | measured all ms (q1-q3) | error | error, every calibration "
        "| measured linear ms | error | layernorm ms | attention ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in accuracy:
        mesh_shape = tuple(a["mesh"])
        parts = next(r for r in rows if r["config"] == f"ATP {mesh_shape} chunks=1")["comm_replay_parts_ms"]
        mark = " **selected**" if a["selected"] else ""
        q1, q3 = a["measured_all_q1_q3_ms"]
        lines.append(
            f"| {mesh_shape}{mark} | {a['predicted_ms']:.1f} | "
            f"{a['measured_all_ms']:.1f} ({q1:.1f}-{q3:.1f}) | "
            f"{100 * a['error_all']:+.0f} % | {100 * min(a['error_all_every_calibration']):+.0f} to "
            f"{100 * max(a['error_all_every_calibration']):+.0f} % | {a['measured_linear_ms']:.1f} | "
            f"{100 * a['error_linear']:+.0f} % | {parts['layernorm all-reduce']:.1f} | "
            f"{parts['attention scatter/gather']:.1f} |"
        )
    lines += [
        "",
        "Order, cheapest first: predicted "
        + " < ".join(str(tuple(m)) for m in order["predicted"])
        + "; measured communication "
        + " < ".join(str(tuple(m)) for m in order["measured_comm"])
        + "; measured step "
        + " < ".join(str(tuple(m)) for m in order["measured_step"])
        + ".",
        "",
        f"Selected mesh {chosen} (chunks=1) against 1-D tensor parallelism: per-round ratio of step times "
        "(> 1: selected slower); *slower* only if a one-sided sign test over the rounds says so (p < 0.05), "
        "else *within noise*:",
        "",
        "| selected vs | median ratio | q1-q3 | min-max | rounds selected slower | sign test p | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for cmp in comparisons:
        lines.append(
            f"| {cmp['b']} | {cmp['median_ratio']:.2f} | {cmp['q1']:.2f}-{cmp['q3']:.2f} | "
            f"{cmp['min']:.2f}-{cmp['max']:.2f} | {cmp['rounds_a_slower']} / {cmp['rounds']} | "
            f"{cmp['sign_test_p']:.3f} | {cmp['verdict']} |"
        )
    lines += [
        "",
        "Every other mesh (chunks=1) against ATP (4, 1) chunks=1, the same way:",
        "",
        "| mesh vs (4, 1) | median ratio | q1-q3 | min-max | rounds slower | sign test p | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for cmp in meshes_vs_1d:
        lines.append(
            f"| {cmp['a']} | {cmp['median_ratio']:.2f} | {cmp['q1']:.2f}-{cmp['q3']:.2f} | "
            f"{cmp['min']:.2f}-{cmp['max']:.2f} | {cmp['rounds_a_slower']} / {cmp['rounds']} | "
            f"{cmp['sign_test_p']:.3f} | {cmp['verdict']} |"
        )
    lines += [
        "",
        "Search on the bandwidths calibrated here before the timing (equation 2, this layer; it selects "
        "the mesh):",
        "",
        "```",
        search.format_table(),
        "```",
        "",
        f"Repeatability: the selecting calibration and {len(again)} more after the timing (calibrated "
        "algorithm bandwidths in GB/s; T_comm relative to (4, 1)):",
        "",
        "| calibration | B1 (4, 1) | B1, B2 (2, 2) | B2 (1, 4) | T (2, 2) / T (4, 1) | T (1, 4) / T (4, 1) "
        "| selects |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, result in enumerate([search, *again]):
        rows_by_mesh = {(e.d1, e.d2): e for e in result.table}
        one, two, four = rows_by_mesh[(4, 1)], rows_by_mesh[(2, 2)], rows_by_mesh[(1, 4)]
        lines.append(
            f"| {'selecting' if i == 0 else f'after {i}'} | {one.algo_bw1:.3f} | "
            f"{two.algo_bw1:.3f}, {two.algo_bw2:.3f} | {four.algo_bw2:.3f} | "
            f"{two.t_comm / one.t_comm:.2f} | {four.t_comm / one.t_comm:.2f} | {result.mesh} |"
        )
    lines.append("")
    (RESULTS / "atp_meshes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
