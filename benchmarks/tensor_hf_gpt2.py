"""Hugging Face GPT-2 at tp=2: mp as a user wraps it, against DTensor tensor parallelism and one process,
on a quiet host and with a competing busy process on every core.

An unmodified ``GPT2LMHeadModel`` built from a ``GPT2Config`` (no download; dropout 0, float32) trains
(forward, backward, AdamW step) on a global batch of ``--batch`` sequences of ``--seq`` tokens, 2 ranks on
gloo, one thread per rank, bound to cores as ``mp-launch`` binds them. Variants:

* **mp speed** (``mp-speed``): ``smp.init({"tensor_parallel_degree": 2, "optimize": "speed"})``, the
  model built under ``smp.tensor_parallelism()`` (it becomes smp's ``DistributedTransformerLMHead``),
  ``smp.DistributedModel``, ``smp.DistributedOptimizer(AdamW)``, an ``@smp.step`` function calling
  ``model.backward``; each rank feeds its own half of the batch (smp's default: TP across DP);
* **mp speed, prescaled** (``mp-speed-prescaled``): the same with ``"prescaled_batch": True``, both
  ranks fed the whole batch;
* **mp memory** (``mp-memory``): ``"optimize": "memory"``, halves of the batch;
* **mp speed, spin** (``mp-speed-spin``): mp speed in processes started with ``MP_COMM_WAIT=spin``
  (MPI's busy wait in mp's collectives instead of the default yield-then-sleep wait), to show what the
  wait policy is worth with and without competing processes;
* **DTensor** (``dtensor-blocks``, ``dtensor-vocab``): the same model class with the same weights under
  ``torch.distributed.tensor.parallel.parallelize_module``, both ranks fed the whole batch. HF GPT-2's
  ``Conv1D`` projections (weight ``[in, out]``) are not accepted by ``ColwiseParallel`` /
  ``RowwiseParallel``, so for the peer only each ``Conv1D`` becomes an ``nn.Linear`` holding the
  transposed weight (same arithmetic), c_attn's rows reordered so that the column split gives each rank
  whole heads with their q, k, v (``_tensor_hf_gpt2_worker.py``). *blocks*: c_attn and mlp.c_fc
  Colwise, attn.c_proj and mlp.c_proj Rowwise (embeddings and LM head replicated: both ranks compute all
  logits); *vocab*: also the tied word embedding Rowwise (split by vocabulary) and the LM head Colwise
  with its logits gathered, as torch's TP tutorial does for a language model. *best DTensor*: per round,
  the faster of the two;
* **single process**, 1 thread and 2 threads (the cores the ranks share).

mp needs one ``smp.init`` config per process, so the variants live in four 2-rank jobs started at once
and driven in turn through named pipes (an idle job sleeps in a blocking read). Before timing, each
variant trains ``--check-steps`` steps on its own batches; its global losses, first-step gradients and
final weights (HF names and layout, shards gathered) are checked against plain HF training in one
process, and the benchmark stops if any differs.

Timing: ``--rounds`` rounds; each round runs the *quiet* and the *loaded* condition (their order
alternating), and in each every variant ``--steps`` steps in an order rotated per round. *Loaded*: one
``python -c "while True: pass"`` per core, pinned nowhere, started before the condition's variants and
killed after. Step time: the slowest rank's. Ratios: per round, the other variant's step time over
ours, then the median over rounds (> 1: ours faster), with a two-sided sign test.

    python -m benchmarks.tensor_hf_gpt2 [--layers 4 --hidden 256 --heads 4 --vocab 8192 --seq 128
                                         --batch 8 --rounds 10 --steps 1]

Writes ``benchmarks/results/tensor_hf_gpt2.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from benchmarks._launch import mpiexec, python_command, root_env, rotated

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORKER = HERE / "_tensor_hf_gpt2_worker.py"
RANKS = 2
JOBS = ("speed", "speed-prescaled", "memory", "speed-spin")
JOB_ENV = {"speed-spin": {"MP_COMM_WAIT": "spin"}}
OURS = ("mp-speed", "mp-speed-prescaled", "mp-memory", "mp-speed-spin")
PEERS = ("dtensor-blocks", "dtensor-vocab")
CONDITIONS = ("quiet", "loaded")
LABELS = {
    "single-1t": "single process, 1 thread",
    "single-2t": "single process, 2 threads",
    "dtensor-blocks": "DTensor, blocks (embeddings, LM head replicated)",
    "dtensor-vocab": "DTensor, blocks + vocab-split embedding / LM head",
    "mp-speed": "mp speed (TP across DP, batch/2 per rank)",
    "mp-speed-prescaled": "mp speed, prescaled_batch",
    "mp-memory": "mp memory (TP across DP)",
    "mp-speed-spin": "mp speed, MP_COMM_WAIT=spin",
}


class Job:
    """One 2-rank worker job: started at once, then driven through its ranks' command pipes."""

    def __init__(self, name: str, ctl: Path, model: dict[str, int], bind: list[str], exe: str) -> None:
        self.name = name
        self.pipes = [ctl / f"{name}.{r}" for r in range(RANKS)]
        for p in self.pipes:
            os.mkfifo(p)
        env = dict(root_env(), OMP_NUM_THREADS="1", **JOB_ENV.get(name, {}))
        cmd = [exe, "-n", str(RANKS), *bind, *python_command(WORKER)]
        cmd += ["--job", name, "--ctl", str(ctl), "--model", json.dumps(model)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        self.writers: list[IO[str]] = []

    def read(self, kind: str) -> dict[str, Any]:
        """The next ``@@ kind`` line from rank 0 (other output passes through to stderr)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(f"@@ {kind} "):
                return dict(json.loads(line[len(kind) + 4 :]))
            sys.stderr.write(f"[{self.name}] {line}")
        raise RuntimeError(f"job {self.name} ended (exit {self.proc.wait()}) before its '{kind}' line")

    def _writer(self, path: Path) -> IO[str]:
        """The write end of a rank's pipe, once the rank opened it (a plain open would block forever on
        a job that died before opening it)."""
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:  # ENXIO: no reader yet
                if exc.errno != errno.ENXIO:
                    raise
                if self.proc.poll() is not None:
                    raise RuntimeError(f"job {self.name} ended (exit {self.proc.returncode})") from exc
                time.sleep(0.05)
                continue
            os.set_blocking(fd, True)
            return os.fdopen(fd, "w")

    def command(self, text: str) -> None:
        if not self.writers:
            self.writers = [self._writer(p) for p in self.pipes]  # kept open for the run
        for w in self.writers:
            w.write(text + "\n")
            w.flush()

    def close(self) -> None:
        """Tell a job that is being driven to quit; kill one that never got that far."""
        if self.writers and self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.command("quit")
        for w in self.writers:
            with contextlib.suppress(BrokenPipeError):
                w.close()
        if not self.writers and self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=120)


@contextlib.contextmanager
def competing(n: int) -> Iterator[None]:
    """``n`` busy Python processes, pinned nowhere, for the block; killed after by their ids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.2)  # running before the first timed step
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "q1": q[0],
        "q3": q[2],
        "min": min(values),
        "max": max(values),
    }


def _sign_test(k: int, n: int) -> float:
    """Two-sided sign-test p-value of ``k`` wins in ``n`` rounds if neither side were faster."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / (1 << n)
    return min(1.0, 2 * tail)


def paired(ours: list[float], other: list[float]) -> dict[str, Any]:
    """Per round ``other``'s step time over ``ours``; median over rounds and a sign test."""
    ratios = [o / s for s, o in zip(ours, other, strict=True)]
    wins, n = sum(r > 1 for r in ratios), len(ratios)
    p = _sign_test(wins, n)
    verdict = "within noise" if p >= 0.05 else ("faster" if 2 * wins > n else "slower")
    return {**_summary(ratios), "rounds_faster": wins, "rounds": n, "sign_test_p": p, "verdict": verdict}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    exe = mpiexec()
    if exe is None:
        raise SystemExit("mpiexec not found; install it with `pip install mpich`")
    from mp.launch import Mpiexec, bind_arguments, placement

    cpu_sets = placement("auto", RANKS, Mpiexec(exe))
    bind = bind_arguments(cpu_sets) if cpu_sets else []
    model = {
        k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "batch", "check_steps")
    }
    load: dict[str, list[float]] = {"start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory(prefix="tensor_hf_gpt2.") as ctl:
        jobs = [Job(name, Path(ctl), model, bind, exe) for name in JOBS]
        try:
            owner, checks = {}, {}
            for job in jobs:
                ready = job.read("ready")
                checks |= ready["checks"]
                owner |= dict.fromkeys(ready["variants"], job)
            bad = {k: c for k, c in checks.items() if not c["ok"]}
            if bad:
                raise SystemExit(f"variants differ from single-process training: {json.dumps(bad, indent=1)}")
            variants = [v for v in LABELS if v in owner]

            def run(v: str, steps: int) -> float:
                job = owner[v]
                job.command(f"run {v} {steps}")
                return float(job.read("time")["s"])

            for v in variants:
                run(v, args.warmup)
            times: dict[str, dict[str, list[float]]] = {c: {v: [] for v in variants} for c in CONDITIONS}
            load["before_rounds"] = list(os.getloadavg())
            start = time.perf_counter()
            for r in range(args.rounds):
                for cond in rotated(CONDITIONS, r):
                    with competing(os.cpu_count() or 1) if cond == "loaded" else contextlib.nullcontext():
                        for v in rotated(variants, r):
                            times[cond][v].append(run(v, args.steps))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            seconds = time.perf_counter() - start
            load["after_rounds"] = list(os.getloadavg())
        finally:
            for job in jobs:
                with contextlib.suppress(Exception):
                    job.close()
                if job.proc.poll() is None:
                    job.proc.kill()
    return {"checks": checks, "variants": variants, "times": times, "seconds": seconds, "load": load}


def analyse(args: argparse.Namespace, m: dict[str, Any]) -> dict[str, Any]:
    tokens = args.batch * args.seq
    out: dict[str, Any] = {}
    for cond, times in m["times"].items():
        best_peer = [min(ts) for ts in zip(*(times[p] for p in PEERS), strict=True)]
        rows = []
        for v in m["variants"]:
            s = times[v]
            row: dict[str, Any] = {
                "variant": v,
                "label": LABELS[v],
                "ms_per_step": {k: 1e3 * x for k, x in _summary(s).items()},
                "tokens_per_s": _summary([tokens / x for x in s]),
                "over_single_1t": paired(s, times["single-1t"]),
                "over_single_2t": paired(s, times["single-2t"]),
            }
            if v in OURS:
                row["over_dtensor_blocks"] = paired(s, times["dtensor-blocks"])
                row["over_dtensor_vocab"] = paired(s, times["dtensor-vocab"])
                row["over_best_dtensor"] = paired(s, best_peer)
            if v == "mp-speed" and "mp-speed-spin" in times:
                row["over_spin"] = paired(s, times["mp-speed-spin"])
            rows.append(row)
        out[cond] = rows
    return out


def _cell(p: dict[str, Any]) -> str:
    return f"**{p['median']:.2f}** ({p['q1']:.2f}-{p['q3']:.2f}), {p['rounds_faster']}/{p['rounds']}"


def summary_table(rows: dict[str, Any]) -> list[str]:
    """mp's variants against the best DTensor plan and one process, both conditions (docs/tensor.md)."""
    lines = [
        "| mp variant | quiet: vs best DTensor | loaded: vs best DTensor | quiet: vs 1 proc (1 thr, 2 thr) "
        "| loaded: vs 1 proc (1 thr, 2 thr) |",
        "|---|---:|---:|---:|---:|",
    ]
    by_key = {cond: {r["variant"]: r for r in rows[cond]} for cond in CONDITIONS}
    for v in OURS:
        if v not in by_key["quiet"]:
            continue
        q, ld = by_key["quiet"][v], by_key["loaded"][v]
        cells = [_cell(q["over_best_dtensor"]), _cell(ld["over_best_dtensor"])]
        cells += [
            f"{r['over_single_1t']['median']:.2f}, {r['over_single_2t']['median']:.2f}" for r in (q, ld)
        ]
        lines.append(f"| {LABELS[v]} | {' | '.join(cells)} |")
    return [*lines, ""]


def markdown(args: argparse.Namespace, m: dict[str, Any], rows: dict[str, Any]) -> str:
    ld = m["load"]
    lines = [
        "# Hugging Face GPT-2, tp=2: mp against DTensor tensor parallelism and one process",
        "",
        f"`GPT2LMHeadModel` ({args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
        f"{args.vocab}, seq {args.seq}), float32, forward + backward + AdamW; global batch {args.batch} x "
        f"{args.seq} tokens; 2 ranks on gloo, 1 thread each, {os.cpu_count()} cores. {args.rounds} rounds, "
        f"each running the quiet and the loaded condition (order alternating), every variant {args.steps} "
        "step(s) per condition in a rotated order. *Quiet*: no process of this benchmark's beside the "
        "ranks (the host's other jobs ran on: see the load average below). *Loaded*: one busy `python` "
        "spin loop per core, pinned nowhere. Ratios: per round, the other's step time over this "
        "variant's (> 1: this one faster), "
        "median (q1-q3) over rounds, then the rounds this one was faster. *best DTensor*: per round the "
        "faster DTensor plan.",
        "",
        f"Host load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in ld['start'])} at start, "
        f"{', '.join(f'{x:.1f}' for x in ld['after_rounds'])} after the rounds (the loaded condition "
        "adds its own spinners). Other jobs shared this machine, so only the interleaved ratios carry "
        "meaning, not the absolute numbers.",
        "",
    ]
    lines += summary_table(rows)
    for cond in CONDITIONS:
        lines += [
            f"## {cond}",
            "",
            "| variant | tokens/s median (q1-q3) | vs best DTensor | vs DTensor blocks | vs DTensor vocab "
            "| vs 1 proc 1 thr | vs 1 proc 2 thr |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows[cond]:
            t = r["tokens_per_s"]
            peers = [
                _cell(r[k]) if k in r else "-"
                for k in ("over_best_dtensor", "over_dtensor_blocks", "over_dtensor_vocab")
            ]
            lines.append(
                f"| {r['label']} | {t['median']:,.0f} ({t['q1']:,.0f}-{t['q3']:,.0f}) | "
                f"{' | '.join(peers)} | {r['over_single_1t']['median']:.2f} | "
                f"{r['over_single_2t']['median']:.2f} |"
            )
        spin = next((r["over_spin"] for r in rows[cond] if "over_spin" in r), None)
        if spin is not None:
            lines += [
                "",
                "mp speed with the default wait (`MP_COMM_WAIT=yield`) over the same with `spin`: "
                f"{_cell(spin)} rounds faster ({spin['verdict']}, sign test p = {spin['sign_test_p']:.3f}).",
            ]
        lines.append("")
    lines += [
        f"Checked before timing, against plain Hugging Face training in one process on the same batches: "
        f"each variant's global loss at each of its first {args.check_steps} AdamW steps (|difference| / "
        "max(|loss|, 1)), every gradient of the first step (largest |difference| / largest |gradient|, per "
        "tensor) and every weight after the steps (/ max(largest |weight|, 1)), in Hugging Face's names and "
        "layout with the shards gathered; the worst tensor is named.",
        "",
        "| variant | losses | first-step gradients | weights after the steps |",
        "|---|---:|---:|---:|",
    ]
    for v in m["variants"]:
        c = m["checks"][v]
        g, w = c["grads"], c["weights"]
        lines.append(
            f"| {LABELS[v]} | {c['loss_max_rel_diff']:.1e} | {g['max']:.1e} ({g['compared']} tensors; "
            f"{g['worst']}) | {w['max']:.1e} ({w['worst']}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per variant per condition")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="tensor_hf_gpt2", help="results file stem")
    parser.add_argument("--render", action="store_true", help="rewrite the markdown from the JSON only")
    args = parser.parse_args()
    if args.render:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        args = argparse.Namespace(**{**saved["args"], "render": True})
        m = {
            "checks": saved["checks"],
            "variants": list(saved["step_seconds"]["quiet"]),
            "times": saved["step_seconds"],
            "seconds": saved["seconds_timed"],
            "load": saved["load_average"],
        }
        (RESULTS / f"{args.out}.md").write_text(markdown(args, m, analyse(args, m)))
        return
    m = measure(args)
    rows = analyse(args, m)
    data = {
        "benchmark": "tensor_hf_gpt2",
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "args": vars(args),
        "backend": "gloo",
        "threads_per_rank": 1,
        "seconds_timed": m["seconds"],
        "load_average": m["load"],
        "checks": m["checks"],
        "step_seconds": m["times"],
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=2) + "\n")
    text = markdown(args, m, rows)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
