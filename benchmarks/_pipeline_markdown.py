"""The markdown of benchmarks/pipeline_vs_torch.py's results (rank 0): :func:`markdown` renders the
payload that _pipeline_report.py computes and saves as JSON."""

from __future__ import annotations

import json
from typing import Any

from _pipeline_gpt import GAP_KINDS
from _pipeline_runners import ACTIVE_PLUS3
from _pipeline_runners import STAGES as P

__all__ = ["markdown"]


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
        f"`python benchmarks/pipeline_vs_torch.py --reps {a['reps']} --steps {a['steps']}` regenerated "
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
        "`python benchmarks/pipeline_vs_torch.py --overhead-only` regenerated this section.",
        "",
        "| variant | `nn.Identity` µs/call | `nn.Linear(16, 16)` µs/call |",
        "|---|---:|---:|",
    ]
    for key, what in _OVERHEAD_ROWS:
        lines.append(f"| {what} | {per['identity'][key]:.0f} | {per['linear'][key]:.0f} |")
    lines += [
        "",
        "| raw message of the same tensor between the two ranks | round trip µs | one way µs |",
        "|---|---:|---:|",
    ]
    for key, what in (
        ("mpi4py", "mpi4py (MPICH)"),
        ("mp_mpi_transport", "mp's MPI transport"),
        ("gloo", "gloo"),
    ):
        lines.append(f"| {what} | {wire[key]:.0f} | {wire[key] / 2:.0f} |")
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


def replace_overhead(md: str, overhead: dict[str, Any]) -> str:
    """A results file's markdown with its overhead section (from its first line to the line of step times
    that ends it) replaced by ``overhead``'s; what follows it stays."""
    lines = md.split("\n")
    starts = ("Per-call overhead:", "Module-server overhead")
    first = next(i for i, line in enumerate(lines) if line.startswith(starts))
    last = next(i for i in range(first, len(lines)) if lines[i].startswith("Step times"))
    new = overhead_lines(overhead)
    return "\n".join(lines[: first - 1] + new[:-1] + lines[last + 1 :])
