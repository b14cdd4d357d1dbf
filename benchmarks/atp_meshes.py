"""ATP meshes against Megatron-style 1-D tensor parallelism on this machine (4 ranks).

One transformer layer (forward + backward, float32) is timed for

* peer: PyTorch's own 1-D tensor parallelism, ``torch.distributed.tensor.parallel`` with
  ``ColwiseParallel`` on the QKV and first MLP linears and ``RowwiseParallel`` on the output and second
  MLP linears (Megatron-LM's layout), on a layer with the same weights;
* ours: ``ATPTransformerLayer`` on ``DeviceMesh(4, 1)`` (Megatron's layout in ATP), ``(2, 2)`` and
  ``(1, 4)``, each with chunks 1, 2 and 4, and ``(4, 1)`` with the ordered (deterministic) all-reduce.

Every configuration is built once and checked against the single-device layer; then the
configurations are timed in turn, ``--reps`` rounds of ``--steps`` steps each (interleaved, since the
host is noisy), the slowest rank's time per step kept, and the median round reported. Ratios are the
peer's time over ours (above 1: ours is faster). The script also calibrates the meshes' all-reduce
bandwidths here and prints the search's choice, to compare with the measured ranking.

    mpiexec -n 4 python benchmarks/atp_meshes.py [--hidden 256 --heads 8 --batch 8 --seq 256]

Writes ``benchmarks/results/atp_meshes.json`` and ``.md`` (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mp_comm.world import init_world
from mp_tensor.atp import (
    ATPTransformerLayer,
    ModelShape,
    TransformerLayer,
    calibrate,
    choose_mesh,
    create_mesh,
)
from mp_tensor.atp.layer import ACTIVATION_SPEC, attention_core
from mp_tensor.atp.spec import distribute

RESULTS = Path(__file__).parent / "results"


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
    def step() -> Tensor:
        module.zero_grad(set_to_none=True)
        out = module(x)
        out.backward(g)
        return out

    return step


def build(args: argparse.Namespace, world: Any) -> tuple[dict[str, Callable[[], Tensor]], list[Any]]:
    torch.manual_seed(0)
    ref = TransformerLayer(args.hidden, args.heads)
    x = torch.randn(args.batch, args.seq, args.hidden)
    g = torch.randn(args.batch, args.seq, args.hidden)
    expected = ref(x).detach()
    steps: dict[str, Callable[[], Tensor]] = {}
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
    steps["peer torch TP 1-D"] = _step_fn(peer, x, g)
    for shape in ((4, 1), (2, 2), (1, 4)):
        mesh = create_mesh(shape)
        keep.append(mesh)
        xl, gl = (
            distribute(x, ACTIVATION_SPEC, mesh).contiguous(),
            distribute(g, ACTIVATION_SPEC, mesh).contiguous(),
        )
        for chunks in (1, 2, 4):
            layer = ATPTransformerLayer.from_reference(ref, mesh=mesh, chunks=chunks)
            want = distribute(expected, ACTIVATION_SPEC, mesh)
            torch.testing.assert_close(layer(xl), want, rtol=1e-4, atol=1e-4)
            steps[f"ATP {shape} chunks={chunks}"] = _step_fn(layer, xl, gl)
        if shape == (4, 1):
            det = ATPTransformerLayer.from_reference(ref, mesh=mesh, deterministic=True)
            steps[f"ATP {shape} ordered all-reduce"] = _step_fn(det, xl, gl)
    return steps, keep


def time_all(steps: dict[str, Callable[[], Tensor]], reps: int, per: int) -> dict[str, list[float]]:
    for step in steps.values():  # warm-up
        step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(per):
                step()
            elapsed = torch.tensor([(time.perf_counter() - start) / per], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples[name].append(float(elapsed))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world = init_world()
    if world.size != 4:
        raise SystemExit(f"run under mpiexec -n 4 (got {world.size} ranks)")
    steps, meshes = build(args, world)
    samples = time_all(steps, args.reps, args.steps)
    calibrated = calibrate(nbytes=args.batch * args.seq * args.hidden * 4, iters=3, repeats=3)
    search = choose_mesh(
        4,
        calibrated,
        ModelShape(layers=1, batch=args.batch, seq=args.seq, hidden=args.hidden, bytes_per_element=4),
    )
    for mesh in meshes:
        mesh.destroy()
    if world.rank == 0:
        report(args, samples, search)
    world.shutdown()


def report(args: argparse.Namespace, samples: dict[str, list[float]], search: Any) -> None:
    medians = {name: statistics.median(s) for name, s in samples.items()}
    peer = medians["peer torch TP 1-D"]
    rows = [
        {
            "config": name,
            "ms_per_step": 1e3 * t,
            "min_ms": 1e3 * min(samples[name]),
            "max_ms": 1e3 * max(samples[name]),
            "peer_over_ours": peer / t,
        }
        for name, t in medians.items()
    ]
    data = {
        "benchmark": "atp_meshes",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "ranks": 4,
        "layer": vars(args),
        "rows": rows,
        "search_on_calibrated_bandwidths": search.to_dict(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "atp_meshes.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# ATP meshes vs 1-D tensor parallelism (4 ranks, this machine)",
        "",
        f"One transformer layer, h={args.hidden}, heads={args.heads}, b={args.batch}, s={args.seq}, float32, "
        f"forward + backward; median of {args.reps} interleaved rounds of {args.steps} steps, slowest rank.",
        "",
        "| configuration | ms / step | min-max ms | peer / ours |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['ms_per_step']:.1f} | {r['min_ms']:.1f}-{r['max_ms']:.1f} | "
            f"{r['peer_over_ours']:.2f} |"
        )
    lines += [
        "",
        "Search on the bandwidths calibrated here (equation 2, this layer):",
        "",
        "```",
        search.format_table(),
        "```",
    ]
    (RESULTS / "atp_meshes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
