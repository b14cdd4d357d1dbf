"""Ratios, bounds and targets of benchmarks/pipeline_vs_torch.py, saved as JSON with the markdown
rendered from it (rank 0: :func:`report`, :func:`markdown`); :func:`rerender` rebuilds both from a saved
JSON, :func:`replace_overhead` swaps in a new per-call overhead section."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._pipeline_gpt import GAP_KINDS
from benchmarks._pipeline_variants import ACTIVE_PLUS3, BOTH_RANKS, Spec
from benchmarks._pipeline_variants import STAGES as P

__all__ = ["markdown", "replace_overhead", "report", "rerender"]

_COMPUTE = ("f0", "f1", "b1", "b0")  # the stage times that are compute (not the optimizer's "opt")


def bootstrap_interval(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the geometric mean of paired round ratios.

    Rounds are resampled with replacement (fixed seed: the report is reproducible from its JSON), so
    the interval says how far the pooled ratio could move on this host's noise alone.
    """
    rng = random.Random(seed)
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    means = sorted(sum(rng.choices(logs, k=n)) / n for _ in range(resamples))
    return math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])


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


def _bubble_ideal(single_step_s: float, m: int) -> float:
    """The bubble bound's step time, T1 / p * (m + p - 1) / m, from the single process's step T1."""
    return single_step_s / P * (m + P - 1) / m


def _stage_sums(pipe: dict[str, Any]) -> tuple[float, float]:
    c = pipe["stage_compute_s"]
    return c["f0"] + c["b0"], c["f1"] + c["b1"]


def _time_split(
    mine: list[dict[str, Any]],
    paired: Callable[[str, str, Callable[[dict[str, Any], dict[str, Any]], float]], float | None],
    key: str,
    accum: str,
) -> dict[str, Any] | None:
    """Medians over the steps of one pipelined variant: the window of stage compute, its zero-overhead
    replay, the time outside it, the compute on each rank, and that compute over the single process's
    compute of the same stages in the same round (> 1: the stages ran slower inside the pipeline)."""
    runs = [r for r in mine if r["pipe"]]
    if not runs:
        return None

    def slowdown(rank: int) -> Callable[[dict[str, Any], dict[str, Any]], float]:
        def f(a: dict[str, Any], b: dict[str, Any]) -> float:
            if not a["pipe"] or not b["pipe"]:
                return float("nan")
            return _stage_sums(a["pipe"])[rank] / _stage_sums(b["pipe"])[rank]

        return f

    return {
        "window_ms": _median([r["pipe"]["window_s"] * 1e3 for r in runs]),
        "makespan_ms": _median([r["pipe"]["makespan_s"] * 1e3 for r in runs]),
        "schedule_efficiency": _median([r["pipe"]["makespan_s"] / r["pipe"]["window_s"] for r in runs]),
        "idle_in_window_ms": _median([(r["pipe"]["window_s"] - r["pipe"]["makespan_s"]) * 1e3 for r in runs]),
        "outside_window_ms": _median([(r["step_s"] - r["pipe"]["window_s"]) * 1e3 for r in runs]),
        "compute_ms": [_median([r["pipe"]["compute_s"][i] * 1e3 for r in runs]) for i in range(P)],
        "compute_slowdown": [paired(key, accum, slowdown(i)) for i in range(P)],
        "gaps_ms": [
            {k: _median([r["pipe"]["gaps_s"][i][k] * 1e3 for r in runs]) for k in GAP_KINDS} for i in range(P)
        ],
    }


def _contended_cap(m: int, slowdown: float) -> float:
    """The efficiency (vs the bubble bound) of an ideal two-stage pipeline of balanced stages whose
    compute runs `slowdown` times slower while both ranks compute: of its m + 1 stage-times, m - 1 have
    both ranks busy, the first and the last one rank alone."""
    return (m + 1) / ((m - 1) * slowdown + 2)


def _stage_ratio(fwd: str, bwd: str) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    """One stage's forward + backward time in record `a` over that in record `b` (single-process runs)."""

    def f(a: dict[str, Any], b: dict[str, Any]) -> float:
        return float((a["stage_s"][fwd] + a["stage_s"][bwd]) / (b["stage_s"][fwd] + b["stage_s"][bwd]))

    return f


def _rank_compute_ratio(rank: int) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    """Rank `rank`'s forward + backward time of both stages in record `a` over rank 0's in record `b`."""

    def f(a: dict[str, Any], b: dict[str, Any]) -> float:
        by_rank = a.get("stage_s_by_rank")
        if not by_rank or not by_rank[rank]:
            return float("nan")
        mine = sum(by_rank[rank][k] for k in _COMPUTE)
        return float(mine / sum(b["stage_s"][k] for k in _COMPUTE))

    return f


def report(
    *,
    args: dict[str, Any],
    cfg: dict[str, Any],
    specs: list[Spec],
    records: list[dict[str, Any]],
    checks: dict[str, list[dict[str, Any]]],
    ref_loss: float,
    n_params: dict[str, int],
    overhead: dict[str, Any],
    host: dict[str, Any],
    elapsed_s: float,
    results: Path,
) -> None:
    batch = args["batch"]
    by_key: dict[str, list[dict[str, Any]]] = {}
    index: dict[tuple[int, int, str], dict[str, Any]] = {}
    for r in records:
        by_key.setdefault(r["key"], []).append(r)
        index[(r["group"], r["round"], r["key"])] = r
    single = "single/full batch/m1/t1"

    def paired_values(
        key: str, other: str, f: Callable[[dict[str, Any], dict[str, Any]], float]
    ) -> list[float]:
        """f(record of key, record of other in the same round), for the rounds that ran both."""
        values = []
        for r in by_key.get(key, []):
            o = index.get((r["group"], r["round"], other))
            if o is not None:
                values.append(f(r, o))
        return values

    def paired(key: str, other: str, f: Callable[[dict[str, Any], dict[str, Any]], float]) -> float | None:
        return _median(paired_values(key, other, f))

    def speedup(a: dict[str, Any], b: dict[str, Any]) -> float:
        return float(b["step_s"] / a["step_s"])

    rows: list[dict[str, Any]] = []
    for spec in specs:
        key, m = spec.key, spec.m
        mine = by_key[key]
        gpipe = f"torch/GPipe/m{m}/t1"
        accum = f"single/accumulate/m{m}/t1"
        row: dict[str, Any] = {
            "system": spec.system,
            "schedule": spec.schedule,
            "microbatches": m,
            "threads": spec.threads,
            "steps_timed": len(mine),
            "step_ms": _median([r["step_s"] * 1e3 for r in mine]),
            "samples_per_s": _median([batch / r["step_s"] for r in mine]),
            "vs_torch_gpipe": paired(key, gpipe, speedup) if m > 1 else None,
            "vs_single": paired(key, single, speedup),
            "efficiency_bubble": None,
            "efficiency_split": None,
        }
        if spec.system in ("mp", "torch"):

            def bubble(a: dict[str, Any], b: dict[str, Any], m: int = m) -> float:
                return float(_bubble_ideal(b["step_s"], m) / a["step_s"])

            def split(a: dict[str, Any], b: dict[str, Any], m: int = m) -> float:
                return float(_split_bound(b["stage_s"], m, n_params) / a["step_s"])

            row["efficiency_bubble"] = paired(key, accum, bubble)
            row["efficiency_split"] = paired(key, accum, split)
        row["cpu_per_step_s"] = [
            {part: _median([r["cpu"][rank][part] for r in mine]) for part in ("total", "main", "progress")}
            for rank in range(P)
        ]
        row["cpu_busy"] = [
            _median([r["cpu"][rank]["total"] / r["step_s"] for r in mine]) for rank in range(P)
        ]
        c = checks[key]
        row["first_step"] = {
            "runs": len(c),
            "loss": c[0]["loss"],
            "loss_abs_diff_max": max(x["loss_abs_diff"] for x in c),
            "grad_max_abs_diff_max": max(x["grad_max_abs_diff"] for x in c),
            "grad_max_abs": c[0]["grad_max_abs"],
            "grads_compared": c[0]["grads_compared"],
        }
        row["time_split"] = _time_split(mine, paired, key, accum) if spec.system != "single" else None
        stages = [r["stage_s"] for r in mine if r["stage_s"]]
        row["stage_ms"] = {k: _median([s[k] * 1e3 for s in stages]) for k in stages[0]} if stages else None
        row["raw_step_s"] = [r["step_s"] for r in mine]
        rows.append(row)

    by = {(r["system"], r["schedule"], r["microbatches"], r["threads"]): r for r in rows}
    targets: dict[str, Any] = {"mp_vs_torch": [], "mp_efficiency": []}
    for m in args["micro"]:
        for ours, theirs in (
            ("simple", "GPipe"),
            ("interleaved", "1F1B"),
            ("simple", "1F1B"),
            ("interleaved", "GPipe"),
            ("simple static", "GPipe"),
            ("interleaved static", "1F1B"),
            (ACTIVE_PLUS3, "1F1B"),
        ):
            if ("mp", ours, m, 1) not in by:
                continue
            values = paired_values(f"mp/{ours}/m{m}/t1", f"torch/{theirs}/m{m}/t1", speedup)
            ratio = _median(values)
            targets["mp_vs_torch"].append(
                {
                    "m": m,
                    "mp": ours,
                    "torch": theirs,
                    "throughput_ratio": ratio,
                    "rounds": values,
                    "met": ratio is not None and ratio >= 1.0,
                }
            )
        for s in ("simple", "interleaved", "simple static", "interleaved static", ACTIVE_PLUS3):
            if ("mp", s, m, 1) not in by:
                continue
            eff = by[("mp", s, m, 1)]["efficiency_bubble"]
            targets["mp_efficiency"].append(
                {"m": m, "mp": s, "efficiency_bubble": eff, "met": eff is not None and eff >= 0.9}
            )
    # The host's own cost of two ranks computing at once (no pipeline): the control over the lone process.
    targets["host_contention"] = []
    for m in args["micro"]:
        alone, both = f"single/accumulate/m{m}/t1", f"single/{BOTH_RANKS}/m{m}/t1"
        steps = paired_values(both, alone, lambda a, b: float(a["step_s"] / b["step_s"]))
        if not steps:
            continue
        per_stage = [paired(both, alone, _stage_ratio(f, b)) for f, b in (("f0", "b0"), ("f1", "b1"))]
        # Each rank's whole compute in the control over rank 0's alone (older results lack rank 1's).
        per_rank = [
            _median([v for v in paired_values(both, alone, _rank_compute_ratio(i)) if not math.isnan(v)])
            for i in range(P)
        ]
        slowdown = statistics.median(steps)
        effs = {
            f"{system} {schedule}": by[(system, schedule, m, 1)]["efficiency_bubble"]
            for system, schedule in (
                ("mp", "simple"),
                ("mp", "interleaved"),
                ("torch", "GPipe"),
                ("torch", "1F1B"),
            )
            if (system, schedule, m, 1) in by
        }
        # The measured split's own bound over the bubble bound (< 1: the stages are not quite balanced).
        balance = _median(
            [
                _bubble_ideal(r["step_s"], m) / _split_bound(r["stage_s"], m, n_params)
                for r in by_key.get(alone, [])
                if r["stage_s"]
            ]
        )
        targets["host_contention"].append(
            {
                "m": m,
                "slowdown": slowdown,
                "rounds": steps,
                "stage_slowdown": per_stage,
                "rank_compute_slowdown": per_rank,
                "efficiency_cap": _contended_cap(m, slowdown),
                "split_over_bubble": balance,
                "efficiency_bubble": effs,
            }
        )
    # All rounds of the like-for-like pairs (simple vs GPipe, interleaved vs 1F1B) at every m, pooled.
    pool = [
        x
        for t in targets["mp_vs_torch"]
        if (t["mp"], t["torch"]) in (("simple", "GPipe"), ("interleaved", "1F1B"))
        for x in t["rounds"]
    ]
    if pool:
        geo = statistics.geometric_mean(pool)
        targets["mp_vs_torch_pooled"] = {
            "rounds": len(pool),
            "median": statistics.median(pool),
            "geometric_mean": geo,
            "mp_faster": sum(x > 1 for x in pool),
            "met": geo >= 1.0,
            "interval_95": bootstrap_interval(pool),
        }

    payload = {
        "benchmark": "pipeline_vs_torch",
        "method": "same GPT, weights and global batch; 2 ranks x 1 torch thread on a 2-core host; mp "
        "(manual partition front/back) vs torch.distributed.pipelining (PipelineStage, ScheduleGPipe, "
        "Schedule1F1B) vs single-process PyTorch; step = forward + backward + AdamW; each mp session runs "
        "beside live torch and single-process runners of the same m, one step of each per round in a "
        "rotating order; ratios paired within a round; medians",
        "host": host,
        "args": args,
        "model": cfg,
        "parameters": n_params,
        "reference_first_loss": ref_loss,
        "elapsed_s": elapsed_s,
        "rows": rows,
        "targets": targets,
        "overhead": overhead,
        "records": records,
    }
    results.mkdir(parents=True, exist_ok=True)
    (results / "pipeline_vs_torch.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = markdown(payload)
    (results / "pipeline_vs_torch.md").write_text(md)
    print(md)


def rerender(path: Path) -> None:
    """Rebuild the markdown (and the JSON's derived fields) beside a saved JSON (``python -m
    benchmarks.pipeline_vs_torch --rerender benchmarks/results/pipeline_vs_torch.json``)."""
    d = json.loads(path.read_text())
    specs = [Spec(r["system"], r["schedule"], r["microbatches"], r["threads"]) for r in d["rows"]]
    checks = {
        spec.key: [
            {
                "loss": r["first_step"]["loss"],
                "loss_abs_diff": r["first_step"]["loss_abs_diff_max"],
                "grad_max_abs_diff": r["first_step"]["grad_max_abs_diff_max"],
                "grad_max_abs": r["first_step"]["grad_max_abs"],
                "grads_compared": r["first_step"]["grads_compared"],
            }
        ]
        for spec, r in zip(specs, d["rows"], strict=True)
    }
    report(
        args=d["args"],
        cfg=d["model"],
        specs=specs,
        records=d["records"],
        checks=checks,
        ref_loss=d["reference_first_loss"],
        n_params=d["parameters"],
        overhead=d["overhead"],
        host=d["host"],
        elapsed_s=d["elapsed_s"],
        results=path.parent,
    )


# -- the markdown -----------------------------------------------------------------------------------
def _with_split(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The rows that have a time split (pipelined variants whose probe formed a pipeline), with it."""
    return [(r, r["time_split"]) for r in rows if r["time_split"] is not None]


def _fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def _placement(host: dict[str, Any]) -> str:
    """How the launcher placed the ranks (`WorldInfo.bound`) and the CPUs each was allowed."""
    cpus = host.get("rank_cpus")
    if not cpus:
        return ""
    if host["bound"]:
        where = "; ".join(f"rank {r} on CPU {', '.join(map(str, c))}" for r, c in enumerate(cpus))
        return f" and is bound to a core of its own as mp-launch binds ranks by default ({where})"
    return " (the ranks are not bound to cores: the OS places their threads)"


def markdown(p: dict[str, Any]) -> str:
    """The results file's text for the payload of :func:`_pipeline_report.report`."""
    a, cfg, host = p["args"], p["model"], p["host"]
    load = host["load_average_1min"]
    front, back = p["parameters"]["front"] / 1e6, p["parameters"]["back"] / 1e6
    split, layers = cfg["split"], cfg["layers"]

    def blocks(first: int, last: int) -> list[str]:
        return [] if first > last else [f"block {first}" if first == last else f"blocks {first}-{last}"]

    if cfg.get("mid_block"):  # block `split` is cut between its attention and its MLP
        front_has = ["embeddings", *blocks(0, split - 1), f"block {split}'s attention"]
        back_has = [f"block {split}'s MLP", *blocks(split + 1, layers - 1)]
    else:
        front_has, back_has = ["embeddings", *blocks(0, split - 1)], blocks(split, layers - 1)
    timed = [r for r in p["rows"] if r["system"] == "single" and r["stage_ms"]]
    balance = ""
    if timed:  # the lone single process's stages (the first such row), forward + backward per microbatch
        st, m_st = timed[0]["stage_ms"], timed[0]["microbatches"]
        s0, s1 = st["f0"] + st["b0"], st["f1"] + st["b1"]
        balance = (
            f" Stage compute per microbatch (single process, m = {m_st}, forward + backward): front "
            f"{s0:.1f} ms, back {s1:.1f} ms (back/front {s1 / s0:.2f})."
        )
    lines = [
        "# pipeline_vs_torch: mp vs torch.distributed.pipelining vs single process (GPT, CPU, 2 ranks)",
        "",
        f"GPT: {cfg['layers']} blocks, hidden {cfg['hidden']}, {cfg['heads']} heads, "
        f"vocab {cfg['vocab']}, seq {cfg['seq']}, untied head ({front:.2f} M parameters in front = "
        f"{' + '.join(front_has)} on rank 0, {back:.2f} M in back = "
        f"{' + '.join([*back_has, 'ln_f', 'head', 'loss'])} on rank 1).{balance} "
        f"Global batch {a['batch']} sequences; step = forward + "
        "backward + AdamW. Both pipelines hold the same split (mp: manual partition with "
        "`smp.set_partition`; torch: `PipelineStage` on the same two modules). Each rank uses 1 torch "
        f"thread{_placement(host)}; the host has {host['cpus']} cores (1-minute load average "
        f"{', '.join(f'{v:.1f}' for v in load)} at the start, after each repetition and at the end: "
        "other jobs shared the host).",
        "",
        f"{a['reps']} repetitions; in each, per m, one group per mp session (the rows *mp* below) of "
        f"{a['steps']} rounds; *{ACTIVE_PLUS3}* sets `active_microbatches` to pp + 3 instead of smp's "
        "default pp + 2 (not part of the pooled like-for-like pairs); *accumulate, both ranks* runs the "
        "single-process accumulation on both ranks at once, each its own copy with no communication (the "
        "host control: what two ranks computing at once cost each other here); a round runs one step of "
        "every variant in the group (mp, torch GPipe and 1F1B, single process) in a rotating order. Medians "
        "over all timed steps (*n*); ratios are paired within a "
        "round, then the median is taken. *vs torch GPipe*: throughput over torch's GPipe at the same m; "
        "*vs single*: over the single process (1 thread, full batch); *eff. bubble*: (T1/p·(m+p−1)/m) / "
        "measured, T1 = single process on the same m microbatches, p = 2; *eff. split*: the bound for the "
        "measured (imperfectly balanced) stages, (m−1)·max(s0,s1)+s0+s1+max(o0,o1), over measured; "
        "*CPU busy*: CPU seconds of all of a rank's threads per second of step (1.00: a core of its own). "
        f"`python -m benchmarks.pipeline_vs_torch --reps {a['reps']} --steps {a['steps']}` regenerated "
        f"this file (commit {host['code']['commit'][:8]}"
        + (", with local changes under packages/" if host["code"]["modified_under_packages"] else "")
        + ").",
        "",
        "| system | schedule | m | samples/s | ms/step | n | vs torch GPipe | vs single | eff. bubble | "
        "eff. split | CPU busy r0/r1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        plural = "s" if r["threads"] > 1 else ""
        sched = r["schedule"] + (f", {r['threads']} thread{plural}" if r["system"] == "single" else "")
        busy = "/".join(_fmt(v, ".2f") for v in r["cpu_busy"])
        cells = [
            r["system"],
            sched,
            str(r["microbatches"]),
            f"{r['samples_per_s']:.2f}",
            f"{r['step_ms']:.0f}",
            str(r["steps_timed"]),
            _fmt(r["vs_torch_gpipe"], ".2f", "x"),
            _fmt(r["vs_single"], ".2f", "x"),
            _fmt(_pct(r["efficiency_bubble"]), ".0f", "%"),
            _fmt(_pct(r["efficiency_split"]), ".0f", "%"),
            busy,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""]
    for tgt in p["targets"]["mp_vs_torch"]:
        v = tgt["rounds"]
        spread = f" (rounds: {min(v):.2f}–{max(v):.2f}x, mp faster in {sum(x > 1 for x in v)} of {len(v)})"
        lines.append(
            f"* m={tgt['m']}: mp {tgt['mp']} / torch {tgt['torch']} throughput "
            f"{_fmt(tgt['throughput_ratio'], '.2f', 'x')}{spread if v else ''}: "
            f"{'met' if tgt['met'] else '**not met**'} (≥ 1)"
        )
    pooled = p["targets"].get("mp_vs_torch_pooled")
    if pooled:
        lines.append(
            f"* pooled, mp simple vs torch GPipe and mp interleaved vs torch 1F1B, every m: geometric mean "
            f"{pooled['geometric_mean']:.2f}x, median {pooled['median']:.2f}x, mp faster in "
            f"{pooled['mp_faster']} of {pooled['rounds']} rounds"
            + (
                f", 95% interval of the geometric mean {pooled['interval_95'][0]:.2f}-"
                f"{pooled['interval_95'][1]:.2f}x (bootstrap over rounds)"
                if pooled.get("interval_95")
                else ""
            )
            + ": "
            f"{'met' if pooled['met'] else '**not met**'} (≥ 1)"
        )
    for tgt in p["targets"]["mp_efficiency"]:
        lines.append(
            f"* m={tgt['m']}: mp {tgt['mp']} efficiency vs the bubble bound "
            f"{_fmt(_pct(tgt['efficiency_bubble']), '.0f', '%')}: {'met' if tgt['met'] else '**not met**'} "
            "(≥ 90%)"
        )
    for hc in p["targets"].get("host_contention", []):
        effs = ", ".join(f"{k} {_fmt(_pct(v), '.0f', '%')}" for k, v in hc["efficiency_bubble"].items())
        front, back = hc["stage_slowdown"]
        cap = hc["efficiency_cap"]
        balance = hc.get("split_over_bubble")
        per_rank = [v for v in hc.get("rank_compute_slowdown", []) if v is not None]
        ranks = f"; compute per rank {', '.join(f'{v:.2f}x' for v in per_rank)}" if len(per_rank) == P else ""
        with_split = f", {100 * cap * balance:.0f}% with the measured stages' imbalance" if balance else ""
        lines.append(
            f"* m={hc['m']}: host control: both ranks training their own copy at once (no communication) "
            f"take {hc['slowdown']:.2f}x the lone process's step (rounds {min(hc['rounds']):.2f}–"
            f"{max(hc['rounds']):.2f}x; rank 0's front {_fmt(front, '.2f', 'x')}, back "
            f"{_fmt(back, '.2f', 'x')}{ranks}). Estimate for a pipeline with no overhead whose stages slow "
            "down as much while both ranks compute (m − 1 of its m + 1 stage-times): "
            f"{100 * cap:.0f}% of the bubble bound{with_split}. Measured: {effs}."
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
        cells = [f"{c['total']:.2f} / {c['main']:.2f} / {c['progress']:.3f}" for c in r["cpu_per_step_s"]]
        lines.append(f"| {r['system']} | {r['schedule']} | {r['microbatches']} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "Where a pipelined step's time goes (medians, ms; StageProbe in benchmarks/_pipeline_gpt.py): "
        "*window* = first stage operation's start to last one's end; *no-overhead replay* = the same "
        "operations, same order and measured durations, with no gap between dependent ones; *sched. eff.* = "
        "replay / window (what the runtime lost inside the pipeline: messages, thread hand-offs, waiting); "
        "*outside* = step − window (step start and end, optimizer); *compute* = stage compute on each "
        "rank and, in brackets, over the single process's compute of the same stages in the same round "
        "(above 1: the stage ran slower inside the pipeline, i.e. the ranks did not get a core each).",
        "",
        "| system | schedule | m | step | window | no-overhead replay | sched. eff. | idle in window | "
        "outside | compute r0 | compute r1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, ts in _with_split(p["rows"]):
        comp = [
            f"{c:.0f} ({_fmt(sd, '.2f', 'x')})"
            for c, sd in zip(ts["compute_ms"], ts["compute_slowdown"], strict=True)
        ]
        cells = [
            r["system"],
            r["schedule"],
            str(r["microbatches"]),
            f"{r['step_ms']:.0f}",
            f"{ts['window_ms']:.0f}",
            f"{ts['makespan_ms']:.0f}",
            f"{100 * ts['schedule_efficiency']:.0f}%",
            f"{ts['idle_in_window_ms']:.0f}",
            f"{ts['outside_window_ms']:.0f}",
            *comp,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the idle time sits (medians per step, ms): each rank's gaps between consecutive stage "
        "operations of its own, summed by transition (F→F: a forward to the next forward, F→B: a forward "
        "to a backward, ...). Both systems run the same stages, so a gap one system leaves and the other "
        "does not is its runtime's: messages, thread hand-offs, waiting for a trigger. A rank that waits "
        "for the other stage's compute leaves gaps in both.",
        "",
        "| system | schedule | m | rank 0 F→F / F→B / B→F / B→B | rank 1 F→F / F→B / B→F / B→B |",
        "|---|---|---:|---:|---:|",
    ]
    for r, ts in _with_split(p["rows"]):
        cells = [" / ".join(f"{g[k]:.1f}" for k in GAP_KINDS) for g in ts["gaps_ms"]]
        lines.append(f"| {r['system']} | {r['schedule']} | {r['microbatches']} | {cells[0]} | {cells[1]} |")
    lines += overhead_lines(p["overhead"])
    return "\n".join(lines)


def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v


_OVERHEAD_ROWS = (
    ("remote default", "default config (fast mode), every block on pp_rank 1"),
    ("remote full", "full path (`fast_mode: false`), every block on pp_rank 1"),
    ("torch remote", "torch.distributed.pipelining, the chain as stage 1 (GPipe)"),
    ("alternating default", "default config, block i on pp_rank i % 2"),
    ("alternating full", "full path, block i on pp_rank i % 2"),
    ("torch alternating", "torch.distributed.pipelining, block i as stage i on rank i % 2 (LoopedBFS)"),
    ("local", "mp, every block on pp_rank 0 (the step machinery alone; over plain PyTorch)"),
)


def overhead_lines(o: dict[str, Any]) -> list[str]:
    """The per-call overhead section (benchmarks/_pipeline_overhead.py's result)."""
    if o.get("version") != 2:  # a result of the earlier overhead benchmark (Identity calls only)
        return ["", f"Module-server overhead (earlier format): `{json.dumps(o)}`", ""]
    wire = o["wire_round_trip_us"]
    per = o["per_call_us"]
    steps = o["step_ms"]
    loads = ", ".join(f"{v:.1f}" for v in o["load_average_1min"])
    lines = [
        "",
        f"Per-call overhead: a root on pp_rank 0 scales a {o['tensor']} input, calls {o['calls_per_step']} "
        "blocks one after the other and takes the sum of squares as the loss (one microbatch, a training "
        "step: forward + backward); "
        f"median of {o['repetitions']} interleaved repetitions of {o['steps_per_sample']} steps after the "
        "warm-up (1-minute load average "
        f"{loads} at the start of each repetition and at the end). Per call: (step − the same model with "
        "every block on pp_rank 0 under mp) / calls for mp, (step − plain PyTorch) / calls for torch. "
        "`python -m benchmarks.pipeline_vs_torch --overhead-only` regenerated this section.",
        "",
        "| variant | `nn.Identity` µs/call | `nn.Linear(16, 16)` µs/call |",
        "|---|---:|---:|",
    ]
    for key, what in _OVERHEAD_ROWS:
        lines.append(f"| {what} | {per['identity'][key]:.0f} | {per['linear'][key]:.0f} |")
    lines += [
        "",
        "| raw message between the two ranks (interleaved with the rows above) "
        "| round trip µs | one way µs |",
        "|---|---:|---:|",
    ]
    for key, what in (
        ("mpi4py", "the same tensor, mpi4py (MPICH; the floor)"),
        ("mp_mpi_transport", "the same tensor, mp's MPI transport"),
        ("mp_mpi_transport_header", "a header-only message (a small tuple, no tensor), mp's MPI transport"),
        ("gloo", "the same tensor, gloo send/recv"),
    ):
        if key in wire:  # results before the header-only row lack it
            lines.append(f"| {what} | {wire[key]:.1f} | {wire[key] / 2:.1f} |")
    lines += _recorded_lines(o)
    lines += [
        "",
        "Step times (ms), identity / linear: "
        + "; ".join(f"{n} {steps['identity'][n]:.2f} / {steps['linear'][n]:.2f}" for n in steps["identity"])
        + ". Largest |Δ| of the scale parameter's gradient against plain PyTorch over the variants: "
        + ", ".join(
            f"{kind} {max(d.values()) if d else float('nan'):.1e}"
            for kind, d in o["scale_grad_max_abs_diff"].items()
        )
        + ".",
        "",
    ]
    return lines


BLOCKS_SHOWN = ("identity", "linear")
_RECORDED_ROWS = (
    ("pp_rank0_forward_per_call", "pp_rank 0's forward path per call (Remote.call: the guard, the post)"),
    ("owner_forward_spacing", "owner: spacing between consecutive forwards"),
    ("owner_forward_execution", "owner: one forward's execution"),
    ("pp_rank0_backward_per_call", "pp_rank 0's backward path per call (Link.backward)"),
    ("owner_backward_per_call", "owner: its backward executions, per call"),
)


def _recorded_lines(o: dict[str, Any]) -> list[str]:
    """Where a call of ``remote default`` spends its time, from one recorded step (results before this
    measurement lack it)."""
    rec = o.get("recorded_remote_default_us")
    if not rec or not all(rec.get(k) for k in BLOCKS_SHOWN):
        return []

    def cell(kind: str, key: str) -> str:
        v = rec[kind].get(key)
        return "-" if v is None else f"{v:.0f}"

    lines = [
        "",
        f"Where a call of *remote default* goes: one step recorded after the warm-up (`smp.timeline`; "
        f"{o['calls_per_step']} calls, µs; the owner ran "
        + " / ".join(f"{rec[k]['owner_backward_executions']:.0f}" for k in BLOCKS_SHOWN)
        + " backward executions for identity / linear: a run of calls joined into one backward counts once).",
        "",
        "| one recorded step of remote default | `nn.Identity` µs | `nn.Linear(16, 16)` µs |",
        "|---|---:|---:|",
    ]
    for key, what in _RECORDED_ROWS:
        lines.append(f"| {what} | {cell('identity', key)} | {cell('linear', key)} |")
    return lines


def replace_overhead(md: str, overhead: dict[str, Any]) -> str:
    """A results file's markdown with its overhead section (from its first line to the line of step times
    that ends it) replaced by ``overhead``'s; what follows it stays."""
    lines = md.split("\n")
    starts = ("Per-call overhead:", "Module-server overhead")
    first = next(i for i, line in enumerate(lines) if line.startswith(starts))
    last = next(i for i in range(first, len(lines)) if lines[i].startswith("Step times"))
    new = overhead_lines(overhead)
    return "\n".join(lines[: first - 1] + new[:-1] + lines[last + 1 :])
