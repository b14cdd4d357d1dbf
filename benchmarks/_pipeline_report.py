"""Ratios, bounds, JSON and the markdown table of benchmarks/pipeline_vs_torch.py (rank 0)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline_vs_torch import Spec

__all__ = ["report"]

P = 2  # pipeline stages


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _split_bound(stage: dict[str, float], m: int, n_params: dict[str, int]) -> float:
    """(m - 1) * max(s0, s1) + s0 + s1 + max(o0, o1): the pipelined step with the measured stages."""
    s0 = stage["f0"] + stage["b0"]
    s1 = stage["f1"] + stage["b1"]
    total = n_params["front"] + n_params["back"]
    o0 = stage["opt"] * n_params["front"] / total
    o1 = stage["opt"] * n_params["back"] / total
    return (m - 1) * max(s0, s1) + s0 + s1 + max(o0, o1)


def _fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def report(
    *,
    args: dict[str, Any],
    cfg: dict[str, Any],
    specs: list[Spec],
    samples: dict[str, list[dict[str, Any]]],
    checks: dict[str, list[dict[str, Any]]],
    ref_loss: float,
    n_params: dict[str, int],
    overhead: dict[str, Any],
    host: dict[str, Any],
    elapsed_s: float,
    results: Path,
) -> None:
    batch = args["batch"]
    reps = args["reps"]
    t = {k: [s["step_s"] for s in v] for k, v in samples.items()}
    single = "single/full batch/m1/t1"

    def paired(key: str, other: str, f: Callable[[float, float, int], float]) -> float | None:
        if other not in t:
            return None
        return _median([f(a, b, r) for r, (a, b) in enumerate(zip(t[key], t[other], strict=True))])

    rows: list[dict[str, Any]] = []
    for spec in specs:
        key = spec.key
        m = spec.m
        gpipe = f"torch/GPipe/m{m}/t1"
        accum = f"single/accumulate/m{m}/t1"
        row: dict[str, Any] = {
            "system": spec.system,
            "schedule": spec.schedule,
            "microbatches": m,
            "threads": spec.threads,
            "step_ms": _median([v * 1e3 for v in t[key]]),
            "samples_per_s": _median([batch / v for v in t[key]]),
            "vs_torch_gpipe": paired(key, gpipe, lambda a, b, r: b / a) if m > 1 else None,
            "vs_single": paired(key, single, lambda a, b, r: b / a),
            "efficiency_bubble": None,
            "efficiency_split": None,
        }
        if spec.system in ("mp", "torch"):
            row["efficiency_bubble"] = paired(key, accum, lambda a, b, r: (b / P * (m + P - 1) / m) / a)
            row["efficiency_split"] = _median(
                [
                    _split_bound(samples[accum][r]["stage_s"], m, n_params) / a
                    for r, a in enumerate(t[key])
                ]
            )
        cpu = samples[key]
        row["cpu_per_step_s"] = [
            {
                part: _median([s["cpu_per_step"][rank][part] for s in cpu])
                for part in ("total", "main", "progress")
            }
            for rank in range(P)
        ]
        row["cpu_busy"] = [
            _median([s["cpu_per_step"][rank]["total"] / s["step_s"] for s in cpu]) for rank in range(P)
        ]
        c = checks[key]
        row["first_step"] = {
            "loss": c[0]["loss"],
            "loss_abs_diff_max": max(x["loss_abs_diff"] for x in c),
            "grad_max_abs_diff_max": max(x["grad_max_abs_diff"] for x in c),
            "grad_max_abs": c[0]["grad_max_abs"],
            "grads_compared": c[0]["grads_compared"],
        }
        row["stage_ms"] = (
            {k: _median([s["stage_s"][k] * 1e3 for s in cpu]) for k in cpu[0]["stage_s"]}
            if cpu[0]["stage_s"]
            else None
        )
        row["raw_step_s"] = t[key]
        rows.append(row)

    by = {(r["system"], r["schedule"], r["microbatches"], r["threads"]): r for r in rows}
    targets: dict[str, Any] = {"mp_vs_torch": [], "mp_efficiency": []}
    for m in args["micro"]:
        for ours, theirs in (("simple", "GPipe"), ("interleaved", "1F1B")):
            key, other = f"mp/{ours}/m{m}/t1", f"torch/{theirs}/m{m}/t1"
            ratio = paired(key, other, lambda a, b, r: b / a)
            targets["mp_vs_torch"].append(
                {"m": m, "mp": ours, "torch": theirs, "throughput_ratio": ratio, "met": ratio is not None
                 and ratio >= 1.0}  # fmt: skip
            )
        best_mp = min(by[("mp", s, m, 1)]["step_ms"] for s in ("simple", "interleaved"))
        best_torch = min(by[("torch", s, m, 1)]["step_ms"] for s in ("GPipe", "1F1B"))
        targets["mp_vs_torch"].append(
            {"m": m, "mp": "best", "torch": "best", "throughput_ratio": best_torch / best_mp,
             "met": best_torch >= best_mp}  # fmt: skip
        )
        for s in ("simple", "interleaved"):
            eff = by[("mp", s, m, 1)]["efficiency_bubble"]
            targets["mp_efficiency"].append(
                {"m": m, "mp": s, "efficiency_bubble": eff, "met": eff is not None and eff >= 0.9}
            )

    payload = {
        "benchmark": "pipeline_vs_torch",
        "method": "same GPT, weights and global batch; 2 ranks x 1 torch thread on a 2-core host; mp "
        "(manual partition front/back) vs torch.distributed.pipelining (PipelineStage, ScheduleGPipe, "
        "Schedule1F1B) vs single-process PyTorch; step = forward + backward + AdamW; interleaved "
        "repetitions, paired ratios, medians",
        "host": host,
        "args": args,
        "model": cfg,
        "parameters": n_params,
        "reference_first_loss": ref_loss,
        "elapsed_s": elapsed_s,
        "rows": rows,
        "targets": targets,
        "overhead": overhead,
    }
    results.mkdir(exist_ok=True)
    (results / "pipeline_vs_torch.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = _markdown(payload, reps)
    (results / "pipeline_vs_torch.md").write_text(md)
    print(md)


def _markdown(p: dict[str, Any], reps: int) -> str:
    a, cfg, host = p["args"], p["model"], p["host"]
    load = host["load_average_1min"]
    lines = [
        "# pipeline_vs_torch: mp vs torch.distributed.pipelining vs single process (GPT, CPU, 2 ranks)",
        "",
        f"GPT: {cfg['layers']} blocks, hidden {cfg['hidden']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
        f"seq {cfg['seq']}, untied head ({p['parameters']['front'] / 1e6:.2f} M parameters in front = "
        f"embeddings + blocks 0-{cfg['split'] - 1} on rank 0, {p['parameters']['back'] / 1e6:.2f} M in back = "
        f"blocks {cfg['split']}-{cfg['layers'] - 1} + ln_f + head + loss on rank 1). Global batch {a['batch']} "
        "sequences; step = forward + backward + AdamW. Both pipelines hold the same split (mp: manual "
        "partition with `smp.set_partition`; torch: `PipelineStage` on the same two modules). Each rank "
        "uses 1 torch thread; the host has "
        f"{host['cpus']} cores (1-minute load average {', '.join(f'{v:.1f}' for v in load)} at the start, "
        "after each repetition and at the end: other jobs shared the host).",
        "",
        f"Median of {reps} interleaved repetitions of {a['steps']} steps each; ratios paired within a "
        "repetition. *vs torch GPipe*: throughput over torch's GPipe at the same m; *vs single*: over the "
        "single process (1 thread, full batch); *eff. bubble*: (T1/p·(m+p−1)/m) / measured, T1 = single "
        "process on the same m microbatches, p = 2; *eff. split*: the bound for the measured (imperfectly "
        "balanced) stages, (m−1)·max(s0,s1)+s0+s1+max(o0,o1), over measured. "
        "`python benchmarks/pipeline_vs_torch.py` regenerates this file.",
        "",
        "| system | schedule | m | samples/s | ms/step | vs torch GPipe | vs single | eff. bubble | "
        "eff. split | CPU busy r0/r1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        sched = r["schedule"] + (f", {r['threads']} threads" if r["system"] == "single" else "")
        busy = "/".join(_fmt(v, ".2f") for v in r["cpu_busy"])
        lines.append(
            f"| {r['system']} | {sched} | {r['microbatches']} | {r['samples_per_s']:.2f} | "
            f"{r['step_ms']:.0f} | {_fmt(r['vs_torch_gpipe'], '.2f', 'x')} | {_fmt(r['vs_single'], '.2f', 'x')} | "
            f"{_fmt(_pct(r['efficiency_bubble']), '.0f', '%')} | {_fmt(_pct(r['efficiency_split']), '.0f', '%')} | "
            f"{busy} |"
        )
    lines += ["", "Targets:", ""]
    for tgt in p["targets"]["mp_vs_torch"]:
        lines.append(
            f"* m={tgt['m']}: mp {tgt['mp']} / torch {tgt['torch']} throughput "
            f"{_fmt(tgt['throughput_ratio'], '.2f', 'x')}: {'met' if tgt['met'] else '**not met**'} (≥ 1)"
        )
    for tgt in p["targets"]["mp_efficiency"]:
        lines.append(
            f"* m={tgt['m']}: mp {tgt['mp']} efficiency vs the bubble bound "
            f"{_fmt(_pct(tgt['efficiency_bubble']), '.0f', '%')}: {'met' if tgt['met'] else '**not met**'} "
            "(≥ 90%)"
        )
    lines += [
        "",
        f"First step from the same weights on the same batch (reference: single process, full batch, loss "
        f"{p['reference_first_loss']:.6f}); max over repetitions of |Δloss| and of the largest gradient "
        "difference over this system's parameters (both ranks):",
        "",
        "| system | schedule | m | loss | abs Δloss | max abs Δgrad | (max abs grad) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        f = r["first_step"]
        lines.append(
            f"| {r['system']} | {r['schedule']}{', 2 threads' if r['threads'] == 2 else ''} | "
            f"{r['microbatches']} | {f['loss']:.6f} | {f['loss_abs_diff_max']:.1e} | "
            f"{f['grad_max_abs_diff_max']:.1e} | {f['grad_max_abs']:.1e} |"
        )
    lines += [
        "",
        "CPU seconds per step on each rank (median): all threads / the main thread / mp's MPI progress "
        "thread (the rest: mp's module-server workers, which run the model in mp, and gloo's threads).",
        "",
        "| system | schedule | m | rank 0 all/main/progress | rank 1 all/main/progress |",
        "|---|---|---:|---:|---:|",
    ]
    for r in p["rows"]:
        if r["system"] == "single":
            continue
        cells = [
            f"{c['total']:.2f} / {c['main']:.2f} / {c['progress']:.3f}" for c in r["cpu_per_step_s"]
        ]
        lines.append(f"| {r['system']} | {r['schedule']} | {r['microbatches']} | {cells[0]} | {cells[1]} |")
    o = p["overhead"]
    wire = o["wire_round_trip_us"]
    lines += [
        "",
        f"Module-server overhead: {o['calls_per_step']} calls of an `nn.Identity` on a {o['tensor']} tensor "
        f"per step (one microbatch), on pp_rank 1 (remote) vs on pp_rank 0 (local, same step machinery); "
        f"median of {o['repetitions']} interleaved repetitions of {o['steps_per_sample']} steps.",
        "",
        "| quantity | µs |",
        "|---|---:|",
        f"| FWD request round trip (remote − local, per call) | {o['fwd_request_us']:.0f} |",
        f"| BWD request round trip (remote − local, per call) | {o['bwd_request_us']:.0f} |",
        f"| local call through mp's forward wrapper (fwd / bwd) | {o['local_fwd_call_us']:.1f} / "
        f"{o['local_bwd_call_us']:.1f} |",
        f"| plain PyTorch call (fwd / bwd) | {o['plain_fwd_call_us']:.1f} / {o['plain_bwd_call_us']:.1f} |",
        f"| raw round trip of the same tensor: mp MPI transport / gloo | {wire['mp_mpi_transport']:.0f} / "
        f"{wire['gloo']:.0f} |",
        "",
        "Step times of the overhead model (ms; fwd-only / train): "
        + "; ".join(f"{n} {v['fwd']:.2f} / {v['train']:.2f}" for n, v in o["step_ms"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v
