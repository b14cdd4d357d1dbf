"""The device suite (issue 41 item 5): one prepared run on a machine with a GPU and 16 CPU cores.

Parts, each a time-boxed subprocess (its process group is killed when its box or the suite's budget
runs out; a part that fails or is cut short leaves the others running), in this order:

1. ``gpu_pipeline``: benchmarks/pipeline_users.py on CUDA: the looped GPT and HF GPT-2 at pp=2, two
   ranks sharing the GPU (``MP_SHARE_GPUS=1``), mp's default config against torch.distributed.pipelining
   (1F1B and GPipe) on the best hand split, and one process; hidden 1024, seq 512, batch 16 (a block
   about a millisecond on an H200); first-step losses checked equal to the single process's.
2. ``overhead``: the per-call overhead of benchmarks/_pipeline_overhead.py (a chain of 32 Identity /
   Linear(16, 16) blocks on the remote rank and alternating, default config and full path, against
   torch's pipelining on the same chain) on CUDA tensors and on CPU tensors in the same run.
3. ``cpu_pp4_m8``, ``cpu_pp8_m8``: benchmarks/pipeline_users.py on the CPUs (the GPU hidden) at pp=4
   and pp=8, looped GPT and HF GPT-2 at their default sizes, m=8.
4. ``gpu_tests``: ``pytest -m gpu tests/integration/test_gpu.py`` as a regression check (its summary).
5. ``cpu_pp4_m16``, ``cpu_pp8_m16``: the same as 3 at m=16, if time is left.

After each part the suite rewrites ``device_suite.json`` (every part's raw results) and
``device_suite.md`` (the tables) in ``--out``, so whatever finished is kept. The GPU parts are skipped
with a message where torch sees no CUDA device.

    python -m benchmarks.device_suite --out DIR [--budget 400]   # on the device (device_suite.sh)
    python -m benchmarks.device_suite --smoke --out DIR           # every part at tiny sizes (pp=2)

``--out benchmarks/results`` writes the tables beside the other benchmarks' results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GPU_SIZE = "hidden=1024,seq=512,batch=16,heads=16"
PIPELINE_MODELS = ("gpt", "gpt2")
MIN_PART_S = 25.0
"""A part is not started with less of the budget left than this."""


@dataclass
class Part:
    """One time-boxed step of the suite: a command, its environment and where its results land."""

    name: str
    title: str
    cmd: list[str]
    cap_s: float
    result: Path
    env: dict[str, str] = field(default_factory=dict)
    needs_cuda: bool = False
    text: bool = False
    """Whether ``result`` is the command's output (a text file) rather than a JSON it writes."""


def _pipeline_cmd(work: Path, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.pipeline_users", "--out", str(work / name), *args]


def make_parts(args: argparse.Namespace, work: Path) -> list[Part]:
    """The suite's parts, in the order they run."""
    smoke = args.smoke
    models = ["--models", *PIPELINE_MODELS]
    few = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    gpu_env = {"MP_SHARE_GPUS": "1"}
    cpu_env = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU parts: a CPU-only world, as on a host without a GPU
    gpu_systems = ["--systems", "mp", "torch 1F1B", "torch GPipe", "single 1 thread", "single acc"]
    if smoke:
        gpu_args = [*models, "--smoke", "--device", "cuda", *gpu_systems]
    else:
        gpu_args = [
            *models,
            "--device",
            "cuda",
            "--size",
            GPU_SIZE,
            "--microbatches",
            "8",
            *few,
            *gpu_systems,
        ]
    parts = [
        Part(
            "gpu_pipeline",
            "GPU: looped GPT and HF GPT-2 at pp=2, 2 ranks sharing the GPU",
            _pipeline_cmd(work, "gpu_pipeline", *gpu_args),
            150,
            work / "gpu_pipeline" / "pipeline_users.json",
            gpu_env,
            needs_cuda=True,
        ),
        Part(
            "overhead",
            "per-call overhead, CUDA and CPU tensors",
            [
                sys.executable,
                "-m",
                "benchmarks.device_suite",
                "--overhead-json",
                str(work / "overhead.json"),
                *("--calls", "4" if smoke else "32"),
                *("--overhead-reps", "1" if smoke else "2"),
                *("--overhead-steps", "1" if smoke else "4"),
            ],
            100,
            work / "overhead.json",
            gpu_env,
        ),
    ]
    cpu_pps = [2] if smoke else list(args.pp)
    for m16 in (False, True):
        if m16 and (smoke or not args.m16):
            continue
        for pp in cpu_pps:
            m = 16 if m16 else 8
            name = f"cpu_pp{pp}_m{m}" if not smoke else "cpu_pp2_smoke"
            extra = ["--smoke"] if smoke else ["--microbatches", str(m), *few]
            parts.append(
                Part(
                    name,
                    f"CPU: looped GPT and HF GPT-2 at pp={pp}, m={m if not smoke else 4}",
                    _pipeline_cmd(work, name, *models, "--pp", str(pp), *extra),
                    120 if pp <= 4 else 140,
                    work / name / "pipeline_users.json",
                    cpu_env,
                )
            )
        if not m16:
            parts.append(
                Part(
                    "gpu_tests",
                    "GPU regression: pytest -m gpu tests/integration/test_gpu.py",
                    [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/integration/test_gpu.py"],
                    150,
                    work / "gpu_tests.txt",
                    gpu_env,
                    needs_cuda=True,
                    text=True,
                )
            )
    return parts


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End the part's whole process group (mpiexec and its ranks): TERM, then KILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(part: Part, box_s: float) -> dict[str, Any]:
    """Run ``part`` for at most ``box_s`` seconds; its status, exit code, seconds and results."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **part.env}
    part.result.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n=== {part.name}: {part.title} (box {box_s:.0f} s)\n$ {' '.join(part.cmd)}", flush=True)
    t0 = time.monotonic()
    out_file = part.result.open("wb") if part.text else None
    proc = subprocess.Popen(
        part.cmd,
        cwd=HERE.parent,
        env=env,
        start_new_session=True,
        stdout=out_file if out_file is not None else None,
        stderr=subprocess.STDOUT if out_file is not None else None,
    )
    status = "ok"
    try:
        rc: int | None = proc.wait(timeout=box_s)
        if rc != 0:
            status = f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        _kill(proc)
        rc, status = None, f"cut at its {box_s:.0f} s box"
    except BaseException:  # the suite itself is stopped (SIGTERM, ^C): take the part down with it
        _kill(proc)
        raise
    finally:
        if out_file is not None:
            out_file.close()
    elapsed = time.monotonic() - t0
    record: dict[str, Any] = {"status": status, "exit": rc, "seconds": round(elapsed, 1), "title": part.title}
    if part.text and part.result.exists():
        text = part.result.read_text(errors="replace")
        print(text[-4000:], flush=True)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        record["summary"] = lines[-1] if lines else ""
        record["output_tail"] = text[-6000:]
    elif part.result.exists():
        try:
            record["result"] = json.loads(part.result.read_text())
        except json.JSONDecodeError as exc:
            record["result_error"] = f"{part.result}: {exc}"
    print(f"=== {part.name}: {status} in {elapsed:.0f} s", flush=True)
    return record


def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _pipeline_table(result: dict[str, Any]) -> list[str]:
    rows = result.get("rows", [])
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["model"], r["m"]), {})[r["system"]] = r
    lines = [
        "| model | m | mp samples/s | torch 1F1B | torch GPipe | single 1 thread | mp vs torch 1F1B "
        "| mp vs single 1t | mp eff. bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, m), systems in by.items():
        mp, t1, tg, s1 = (systems.get(k, {}) for k in ("mp", "torch 1F1B", "torch GPipe", "single 1 thread"))
        cells = [model, str(m)] + [_f(d.get("samples_per_s"), ".1f") for d in (mp, t1, tg, s1)]
        cells += [
            _f(mp.get("vs_torch_1f1b")),
            _f(mp.get("vs_single_1_thread")),
            _f(mp.get("efficiency_bubble")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for model, info in result.get("models", {}).items():
        lines.append("")
        lines.append(f"- {model}: {info.get('describe', '')}")
        for m, split in info.get("torch_split", {}).items():
            lines.append(
                f"  - m = {m}: torch's hand split {split}; mp's partition: {info['mp_partition'].get(m)}"
            )
    return lines


def _overhead_table(result: dict[str, Any]) -> list[str]:
    devices = [d for d in ("cpu", "cuda") if d in result]
    lines = [
        "| block | variant | " + " | ".join(f"{d.upper()} µs/call" for d in devices) + " | CUDA / CPU |",
        "|---|---|" + "---|" * (len(devices) + 1),
    ]
    first = result[devices[0]] if devices else {}
    for kind, variants in first.get("per_call_us", {}).items():
        for name in variants:
            values = [result[d]["per_call_us"].get(kind, {}).get(name) for d in devices]
            cpu, cuda = result.get("cpu", {}), result.get("cuda", {})
            a = cpu.get("per_call_us", {}).get(kind, {}).get(name)
            b = cuda.get("per_call_us", {}).get(kind, {}).get(name)
            ratio = _f(b / a) + "x" if a and b and a > 0 else "-"
            lines.append(f"| {kind} | {name} | " + " | ".join(_f(v, ".0f") for v in values) + f" | {ratio} |")
    for d in devices:
        wire = result[d].get("wire_round_trip_us", {})
        lines.append("")
        lines.append(
            f"- raw round trip of the (1, 16) tensor, {d}: "
            + ", ".join(f"{k} {v:.0f} µs" for k, v in wire.items())
        )
    return lines


def markdown(suite: dict[str, Any]) -> str:
    host = suite["host"]
    lines = [
        "# Device suite (benchmarks/device_suite.py)",
        "",
        f"{host.get('gpu') or 'no GPU'}, {host['cpus']} CPUs, torch {host['torch']}, Python "
        f"{host['python']}; commit {host['commit'][:10] or '?'}; {suite['elapsed_s']:.0f} s of a "
        f"{suite['budget_s']:.0f} s budget{' (smoke: tiny sizes)' if suite['smoke'] else ''}.",
        "",
        "| part | status | seconds |",
        "|---|---|---|",
    ]
    for name, rec in suite["parts"].items():
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', '-')} |")
    for name, rec in suite["parts"].items():
        lines += ["", f"## {name}: {rec['title']}", ""]
        if "result" in rec and name == "overhead":
            lines += [
                "Per call in a training step (forward + backward), 32 blocks, medians over interleaved "
                "repetitions; mp's variants against its all-local step, torch's against plain PyTorch. "
                "Target (issue 41): CUDA within 1.5x of CPU.",
                "",
                *_overhead_table(rec["result"]),
            ]
        elif "result" in rec:
            args = rec["result"].get("args", {})
            lines += [
                f"pp = {args.get('pp')}, device {args.get('device')}, {args.get('rounds')} rounds x "
                f"{args.get('steps')} steps per system; *vs*: paired per round (> 1: mp faster).",
                "",
                *_pipeline_table(rec["result"]),
            ]
        elif "summary" in rec:
            lines.append(f"`{rec['summary']}`")
        else:
            lines.append(rec.get("result_error", "no results"))
    return "\n".join(lines) + "\n"


def _host(cuda: bool) -> dict[str, Any]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return {
        "commit": commit.stdout.strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if cuda else None,
    }


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def suite_main(args: argparse.Namespace) -> int:
    import torch

    signal.signal(signal.SIGTERM, _terminate)  # a part runs in a session of its own: end it too
    started = time.monotonic()
    deadline = started + args.budget
    cuda = torch.cuda.is_available()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="device_suite_"))
    suite: dict[str, Any] = {
        "smoke": args.smoke,
        "budget_s": args.budget,
        "host": _host(cuda),
        "parts": {},
        "elapsed_s": 0.0,
    }
    for part in [p for p in make_parts(args, work) if args.only is None or p.name in args.only]:
        left = deadline - time.monotonic()
        if part.needs_cuda and not cuda:
            print(f"\n=== {part.name}: skipped: torch sees no CUDA device here", flush=True)
            record: dict[str, Any] = {"status": "skipped (no CUDA)", "title": part.title}
        elif left < MIN_PART_S:
            print(f"\n=== {part.name}: skipped: {left:.0f} s of the budget left", flush=True)
            record = {"status": f"skipped ({left:.0f} s left)", "title": part.title}
        else:
            record = run_part(part, min(part.cap_s, left))
        suite["parts"][part.name] = record
        suite["elapsed_s"] = time.monotonic() - started
        (out / "device_suite.json").write_text(json.dumps(suite, indent=1))
        (out / "device_suite.md").write_text(markdown(suite))
    print("\n" + markdown(suite), flush=True)
    print(f"wrote {out / 'device_suite.json'} and .md", flush=True)
    return 0


def overhead_main(args: argparse.Namespace) -> None:
    """Under mpiexec (2 ranks): the per-call overhead on CUDA tensors (when there is a GPU), then on CPU
    tensors; rank 0 rewrites ``--overhead-json`` after each."""
    import torch

    from benchmarks._pipeline_overhead import measure_overhead
    from mp_comm.world import init_world

    world = init_world()
    assert world.mpi_comm is not None, "started by mpiexec: the world has an MPI communicator"
    comm = world.mpi_comm.Dup()
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
        t0 = time.monotonic()
        result[device] = measure_overhead(
            comm,
            world,
            calls=args.calls,
            steps=args.overhead_steps,
            reps=args.overhead_reps,
            device=device,
            # torch 2.11's stage on CUDA found no input gradient for the Identity chain on the H200
            # ("[1] for chunk 0 has gradients None"): its rows come from the CPU run only
            torch_variants=device == "cpu",
        )
        if comm.Get_rank() == 0:
            per_call = result[device]["per_call_us"]
            print(f"overhead on {device} ({time.monotonic() - t0:.0f} s): {json.dumps(per_call)}", flush=True)
            args.overhead_json.write_text(json.dumps(result, indent=1))
    comm.Free()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: a temporary one)")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for the whole suite")
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes, CPU parts at pp=2")
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8], help="pipeline degrees of the CPU parts")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the pipeline parts")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per system and round")
    parser.add_argument("--no-m16", dest="m16", action="store_false", help="skip the m=16 CPU parts")
    parser.add_argument("--only", nargs="+", default=None, help="run only these parts (by name)")
    parser.add_argument("--overhead-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--overhead-reps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--overhead-steps", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead_json is not None:  # the overhead part, run by the suite
        from benchmarks._launch import relaunch, under_mpi

        if not under_mpi():
            sys.exit(relaunch(__file__, 2))
        overhead_main(args)
        return
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="device_suite_out_"))
    sys.exit(suite_main(args))


if __name__ == "__main__":
    main()
