"""Which pipeline defaults give throughput: the schedule and ``active_microbatches``, measured.

Runs benchmarks/pipeline_users.py once per mp config below on the looped GPT and HF GPT-2 at pp=2 and
m = 8 (and ``--microbatches``), each run timing mp against torch's 1F1B on its best hand split in
interleaved rounds. mp configs cannot share a process (``smp.init`` is global), so variants are compared
through their ratio to torch 1F1B in their own run, which is paired per round and so cancels most of the
host's drift between runs:

* ``default``: nothing set: ``"pipeline": "interleaved"``, ``active_microbatches`` = pp + 2;
* ``active 2`` / ``active m``: ``active_microbatches`` pp (each rank one microbatch ahead) and m (all
  microbatches may be in flight: the interleaved schedule's order with GPipe's memory);
* ``simple``: GPipe's order (all forwards, then the backwards).

Ranks are bound to cores as mp-launch binds them (``--bind auto``, see benchmarks/_launch.py), in every
run alike. Results: benchmarks/results/pipeline_defaults.json and .md.

    python -m benchmarks.experiments.pipeline_defaults [--rounds 3] [--microbatches 8] [--models gpt gpt2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._launch import ROOT, root_env

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
RESULTS = HERE / "results"


def variants(m: int) -> dict[str, dict[str, Any]]:
    return {
        "default": {},
        "active 2": {"active_microbatches": 2},
        f"active {m}": {"active_microbatches": m},
        "simple": {"pipeline": "simple"},
    }


def _run(config: dict[str, Any], args: argparse.Namespace, m: int, folder: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "benchmarks.pipeline_users", "--models", *args.models]
    cmd += ["--microbatches", str(m), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    cmd += ["--out", str(folder)]
    cmd += ["--mp-config", json.dumps(config)]
    subprocess.run(
        cmd, check=True, cwd=ROOT, env=root_env(), stdout=subprocess.DEVNULL if not args.verbose else None
    )
    out = json.loads((folder / "pipeline_users.json").read_text())
    rows: list[dict[str, Any]] = out["rows"]
    return [r | {"load": out["host"]["load_before"]} for r in rows if r["system"] in ("mp", "torch 1F1B")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "gpt2"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    table: list[dict[str, Any]] = []
    for m in args.microbatches:
        for name, config in variants(m).items():
            with tempfile.TemporaryDirectory() as tmp:
                for row in _run(config, args, m, Path(tmp)):
                    if row["system"] == "mp":
                        table.append({"variant": name, "config": config, **row})
            print(f"m={m} {name}: done", file=sys.stderr, flush=True)
    lines = [
        "# Pipeline defaults (benchmarks/experiments/pipeline_defaults.py)",
        "",
        f"pp = 2 on 2 ranks bound to a core each, {args.rounds} interleaved rounds of {args.steps} step(s) "
        f"per run; host load (1 min) {min(r['load'] for r in table):.1f}-{max(r['load'] for r in table):.1f}"
        f" at the runs' starts, {os.cpu_count()} CPUs. *vs torch 1F1B*: torch's step time over mp's, paired "
        "per round in the variant's own run (> 1: mp faster).",
        "",
        "| model | m | variant | mp samples/s | vs torch 1F1B | busy r0/r1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(table, key=lambda r: (r["model"], r["m"])):
        busy = "/".join(f"{b:.2f}" for b in r["busy"]) if r["busy"] else "-"
        ratio = "-" if r["vs_torch_1f1b"] is None else f"{r['vs_torch_1f1b']:.2f}x"
        cells = [r["model"], str(r["m"]), r["variant"], f"{r['samples_per_s']:.1f}", ratio, busy]
        lines.append("| " + " | ".join(cells) + " |")
    best = {}
    for r in table:
        if r["vs_torch_1f1b"] is not None:
            key = (r["model"], r["m"])
            best.setdefault(key, []).append((r["vs_torch_1f1b"], r["variant"]))
    lines += ["", "Best variant per model and m: " + "; ".join(
        f"{model} m={m}: {max(v)[1]} ({max(v)[0]:.2f}x; default "
        f"{statistics.median([x for x, n in v if n == 'default']):.2f}x)"
        for (model, m), v in sorted(best.items())
    )]  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_defaults.json").write_text(json.dumps({"args": vars(args), "rows": table}, indent=1))
    (RESULTS / "pipeline_defaults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
