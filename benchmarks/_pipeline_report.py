"""Ratios, bounds and targets of benchmarks/pipeline_vs_torch.py, saved as JSON with the markdown that
_pipeline_markdown.py renders from it (rank 0); :func:`rerender` rebuilds both from a saved JSON."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _pipeline_gpt import GAP_KINDS
from _pipeline_markdown import markdown
from _pipeline_runners import ACTIVE_PLUS3, BOTH_RANKS, Spec
from _pipeline_runners import STAGES as P

__all__ = ["report"]

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
    """Rebuild the markdown (and the JSON's derived fields) beside a saved JSON (``python
    benchmarks/pipeline_vs_torch.py --rerender benchmarks/results/pipeline_vs_torch.json``)."""
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
