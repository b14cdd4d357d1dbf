"""Partition balance of the auto-partitioner against the lower bound and a naive split.

For GPT-2, T5 and BERT architectures (built on the meta device from their published sizes, nothing
downloaded) and pipeline degrees 2, 4 and 8, with memory weights 0.8 and 0.2, it reports the largest
partition cost over the mean (1.0 = perfect balance) for

* ours: ``mp_partition.auto_partition`` (seed 001, Appendix C);
* bound: no plan can beat ``max(total / pp, largest indivisible node)``: a ModuleNode's own modules
  cannot be split (its children can);
* naive: equal numbers of transformer layers per partition (the layers of every ModuleList of
  identically typed blocks, in execution order, cut into pp contiguous runs whose sizes differ by at most
  one); every other module goes to the partition of the last layer that started before it ran (the
  embeddings to the first, the final norm to the last), and submodules follow their layer.

All three use the same trace and the same costs (equation 1 with the same α). Writes
``benchmarks/results/partition_balance.json`` and ``.md``.

    python -m benchmarks.partition_balance [--models gpt2-xl,t5-11b] [--pp 2,4,8] [--alphas 0.8,0.2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from mp_partition import (
    ModuleNode,
    assign_costs,
    auto_partition,
    build_hf_model,
    build_module_tree,
    trace_model,
)

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODELS = ("gpt2-medium", "gpt2-xl", "bert-large-uncased", "t5-large", "t5-11b")


def layer_runs(root: ModuleNode) -> list[ModuleNode]:
    """Transformer layers: children of ModuleList nodes holding >= 2 blocks of one class, by execution."""
    layers: list[ModuleNode] = []
    for node in root.walk():
        if node.class_names == ("ModuleList",) and len(node.children) >= 2:
            kinds = {c.class_names for c in node.children}
            if len(kinds) == 1:
                layers.extend(node.children)
    layers.sort(key=lambda n: (n.first_call is None, n.first_call or 0))
    return layers


def naive_costs(root: ModuleNode, pp: int) -> list[float]:
    layers = layer_runs(root)
    if len(layers) < pp:
        raise ValueError(f"{len(layers)} layers cannot fill {pp} partitions")
    stage_of: dict[int, int] = {}
    base, extra = divmod(len(layers), pp)
    start = 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        for layer in layers[start : start + size]:
            stage_of[id(layer)] = stage
        start += size
    layer_starts = [
        (layer.first_call if layer.first_call is not None else 0, stage_of[id(layer)]) for layer in layers
    ]
    costs = [0.0] * pp

    def visit(node: ModuleNode, inherited: int | None) -> None:
        stage = stage_of.get(id(node), inherited)
        if stage is None:
            first = node.first_call if node.first_call is not None else 10**12
            before = [s for f, s in layer_starts if f <= first]
            stage = before[-1] if before else 0
            # a container's own cost goes with its first layer; its children are placed on their own
            costs[stage] += node.own_cost
            for child in node.children:
                visit(child, None)
            return
        costs[stage] += node.own_cost
        for child in node.children:
            visit(child, stage)

    visit(root, None)
    return costs


def measure(model_name: str, pp_values: list[int], alphas: list[float], seq_len: int) -> list[dict[str, Any]]:
    built = build_hf_model(model_name, seq_len=seq_len)
    start = time.perf_counter()
    trace = trace_model(built.model, (), built.example_kwargs)
    trace_s = time.perf_counter() - start
    rows = []
    for alpha in alphas:
        root = build_module_tree(built.model, trace)
        assign_costs(root, alpha)
        largest_node = max(n.own_cost for n in root.walk())
        for pp in pp_values:
            start = time.perf_counter()
            plan = auto_partition(built.model, pp, trace=trace, memory_weight=alpha)
            plan_s = time.perf_counter() - start
            mean = 1.0 / pp
            naive = naive_costs(root, pp)
            rows.append(
                {
                    "model": model_name,
                    "parameters": plan.inputs.num_parameters,
                    "pp": pp,
                    "memory_weight": alpha,
                    "ours": max(plan.costs) / mean,
                    "bound": max(mean, largest_node) / mean,
                    "naive": max(naive) / mean,
                    "ours_min": min(plan.costs) / mean,
                    "ours_costs": list(plan.costs),
                    "naive_costs": naive,
                    "empty_partitions": list(plan.empty_partitions),
                    "trace_s": trace_s,
                    "plan_s": plan_s,
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Partition balance: max partition cost / mean (1.00 = perfect)",
        "",
        f"Models built on the meta device, traced with batch 1 x {meta['seq_len']} tokens; "
        "costs from equation 1 (seed 001, Appendix C.3). bound = max(1/pp, largest ModuleNode) x pp; "
        "naive = equal numbers of layers per partition. Lower is better.",
        "",
        "| model | params | pp | α | ours | bound | naive | ours / bound | plan time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e9:.2f}B | {r['pp']} | {r['memory_weight']:g} | "
            f"{r['ours']:.3f} | {r['bound']:.3f} | {r['naive']:.3f} | {r['ours'] / r['bound']:.3f} | "
            f"{r['plan_s']:.2f} |"
        )
    wins = sum(1 for r in rows if r["ours"] < r["naive"] - 1e-9)
    ties = sum(1 for r in rows if abs(r["ours"] - r["naive"]) <= 1e-9)
    close = sum(1 for r in rows if r["naive"] + 1e-9 < r["ours"] <= r["naive"] * 1.03)
    lines += [
        "",
        f"ours better than naive in {wins} of {len(rows)} cases, equal in {ties}, worse by at most 3% in "
        f"{close}; "
        f"worst ours / bound {max(r['ours'] / r['bound'] for r in rows):.3f}.",
        "",
        "Where ours loses, the seed's algorithm is the reason, not a tuning knob: (1) partition 0 (the first",
        "device of every split) also holds the parent nodes and every segment D'Hondt gave no device, such",
        "as embeddings, final norms and dropouts, so with equal layers it carries slightly more than the",
        "others, while the naive split sends the final norm to the last stage; (2) D'Hondt's seat counts",
        "favour the costlier segment, so with few devices and two unequal halves (T5's encoder and decoder",
        "at pp=4) the cheaper half can get one device where an even split would give two. With more",
        "devices than top-level halves (T5 at pp=8) the seed's proportional split beats equal layer counts,",
        "because it gives the costlier decoder more devices.",
        "",
        f"torch {meta['torch']}, python {meta['python']}, {meta['machine']}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--pp", default="2,4,8")
    parser.add_argument("--alphas", default="0.8,0.2")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    pp_values = [int(x) for x in args.pp.split(",")]
    alphas = [float(x) for x in args.alphas.split(",")]
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        rows += measure(name, pp_values, alphas, args.seq_len)
        print(f"{name}: done", flush=True)
    meta = {
        "seq_len": args.seq_len,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "partition_balance.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    table = markdown(rows, meta)
    (out / "partition_balance.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
