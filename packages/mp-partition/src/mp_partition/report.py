"""Human reports of a plan: the partition tree as text and as a picture (docs/partition.md).

Like the seed's figures, the compact view expands only the nodes whose subtree the algorithm split
across several partitions (or, in a manual plan, whose subtree spans several partitions); every other
node is one box, its whole subtree on one partition. Runs of
numbered siblings (layers of a ModuleList) of the same class on the same partition are drawn as one
box named ``layers[i:j]`` (i inclusive, j exclusive) with their summed cost. ``full=True`` expands
every node (down to ``max_depth``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import PartitionError

if TYPE_CHECKING:
    from .plan import PartitionPlan, PlanNode

__all__ = ["DisplayNode", "display_tree", "format_devices", "format_report", "render_plan"]


@dataclass
class DisplayNode:
    """A box of the report: one plan node, or a run of grouped numbered siblings."""

    label: str
    kind: str
    cost: float
    partition: int
    devices: tuple[int, ...]
    children: list[DisplayNode] = field(default_factory=list)


def format_devices(devices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``."""
    parts: list[str] = []
    items = sorted(devices)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


def _last(path: str) -> str:
    return path.rsplit(".", 1)[-1] if path else ""


def _numbered(child: PlanNode, parent: PlanNode) -> tuple[str, int] | None:
    """(prefix, number) when ``child`` is a single module named by an integer (a ModuleList item)."""
    if len(child.paths) != 1 or "+" in child.label:
        return None
    rel = child.label
    head, _, tail = rel.rpartition(".")
    if not tail.isdigit():
        return None
    prefix = head if head else _last(parent.path)
    return prefix, int(tail)


def _kind(node: PlanNode) -> str:
    return " + ".join(dict.fromkeys(node.class_names))


def _expand(node: PlanNode, full: bool, depth: int, max_depth: int | None) -> bool:
    if not node.children or (max_depth is not None and depth >= max_depth):
        return False
    if full or len(node.devices) > 1:
        return True
    return any(d.partition != node.partition for d in node.walk())  # a manual plan split it


def display_tree(root: PlanNode, *, full: bool = False, max_depth: int | None = None) -> DisplayNode:
    """The boxes of the report, grouped as described in the module docstring."""

    def build(node: PlanNode, label: str, depth: int) -> DisplayNode:
        box = DisplayNode(label, _kind(node), node.cost, node.partition, node.devices)
        if not _expand(node, full, depth, max_depth):
            return box
        run: list[tuple[PlanNode, str, int]] = []

        def flush() -> None:
            if not run:
                return
            first, prefix, a = run[0]
            b = run[-1][2]
            name = f"{prefix}[{a}:{b + 1}]" if len(run) > 1 else f"{prefix}[{a}]"
            kind = _kind(first) + (f" x{len(run)}" if len(run) > 1 else "")
            box.children.append(
                DisplayNode(name, kind, sum(n.cost for n, _, _ in run), first.partition, (first.partition,))
            )
            run.clear()

        for child in node.children:
            numbered = _numbered(child, node)
            grouped = numbered is not None and not _expand(child, full, depth + 1, max_depth)
            if grouped and numbered is not None:
                prefix, number = numbered
                if run and not (
                    run[-1][1] == prefix
                    and run[-1][2] + 1 == number
                    and run[-1][0].partition == child.partition
                    and run[-1][0].class_names == child.class_names
                ):
                    flush()
                run.append((child, prefix, number))
                continue
            flush()
            box.children.append(build(child, child.label, depth + 1))
        flush()
        return box

    return build(root, root.label, 0)


def _rows(box: DisplayNode) -> list[tuple[str, DisplayNode]]:
    rows: list[tuple[str, DisplayNode]] = [("", box)]

    def walk(node: DisplayNode, indent: str) -> None:
        for i, child in enumerate(node.children):
            last = i == len(node.children) - 1
            rows.append((indent + ("└─ " if last else "├─ "), child))
            walk(child, indent + ("   " if last else "│  "))

    walk(box, "")
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_report(plan: PartitionPlan, *, full: bool = False, max_depth: int | None = None) -> str:
    """The text report: a header, the partition tree (name, class, cost, partition, devices), a table."""
    inp = plan.inputs
    if inp.method == "manual":
        how = f"manual (default_partition {inp.default_partition})"
    else:
        how = f"auto, memory_weight {inp.memory_weight:g}"
        if inp.memory_weight_auto:
            how += " (not set: time balanced unless memory binds)"
        if inp.effective_memory_weight != inp.memory_weight:
            how += f" (used {inp.effective_memory_weight:g})"
    if inp.traced:
        compute = "module calls"
        if inp.compute_unit == "seconds":
            compute = "forward + backward time" if plan.predicted_times_s is not None else "forward time"
        source = f"traced on {inp.trace_device}, compute = {compute}"
    else:
        source = "not traced: memory = parameters and buffers, compute = module count"
    lines = [
        f"Partition plan: {inp.model_class} ({_count(inp.num_parameters)} parameters, "
        f"{inp.num_modules} modules) into {plan.num_partitions} partitions",
        f"  {how}; {source}",
    ]
    if inp.example_inputs:
        lines.append(f"  inputs: {', '.join(inp.example_inputs)}")
    lines.append("")
    rows = _rows(display_tree(plan.tree, full=full, max_depth=max_depth))
    names = [
        prefix + node.label + (f" ({node.kind})" if node.kind and node.kind != node.label else "")
        for prefix, node in rows
    ]
    width = min(max(len(n) for n in names), 100)
    lines.append(f"{'module':<{width}}   cost  part  devices")
    for name, (_, node) in zip(names, rows, strict=True):
        devs = f"{{{format_devices(node.devices)}}}" if len(node.devices) > 1 else ""
        lines.append(f"{name:<{width}}  {node.cost:5.3f}  p{node.partition:<3} {devs}".rstrip())
    lines.append("")
    timed = plan.predicted_times_s is not None
    measured = any(p.measured_time_s is not None for p in plan.partitions)
    lines.append(
        f"{'partition':>9}  {'cost':>6}  {'params':>8}  {'param MiB':>10}  {'buffer MiB':>10}  "
        f"{'act MiB':>9}  {'modules':>7}"
        + (f"  {'pred. ms':>8}" if timed else "")
        + (f"  {'meas. ms':>8}" if measured else "")
    )
    for p in plan.partitions:
        lines.append(
            f"{'p' + str(p.index):>9}  {p.cost:6.3f}  {_count(p.num_parameters):>8}  "
            f"{_mib(p.parameter_bytes):>10}  {_mib(p.buffer_bytes):>10}  "
            f"{_mib(p.activation_bytes):>9}  {p.num_modules:>7}"
            + (f"  {_ms(p.predicted_time_s):>8}" if timed else "")
            + (f"  {_ms(p.measured_time_s):>8}" if measured else "")
        )
    costs = plan.costs
    lines.append(
        f"cost range {min(costs):.3f}-{max(costs):.3f} "
        f"(perfect balance: {1 / plan.num_partitions:.3f} each); max/mean {plan.imbalance:.3f}"
    )
    if timed:
        lines.append(
            "ms: forward + backward of one microbatch (the traced one) per stage; predicted from the timed "
            f"step plus {_ms(inp.call_overhead_s)} ms per remote call on the caller's stage"
            + ("; measured from the pipeline timeline (busy time, waits excluded)" if measured else "")
        )
    if plan.empty_partitions:
        lines.append(f"partitions without modules: {list(plan.empty_partitions)}")
    return "\n".join(lines) + "\n"


def _colors(n: int) -> list[tuple[float, float, float, float]]:
    from matplotlib import colormaps

    name = "tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"
    cmap = colormaps[name]
    if name == "turbo":
        return [cmap(0.05 + 0.9 * i / max(n - 1, 1)) for i in range(n)]
    return [cmap(i) for i in range(n)]


def _short(label: str, limit: int = 24) -> str:
    parts = label.split(" + ")
    if len(parts) > 1:
        label = f"{parts[0]} +{len(parts) - 1} tied"
    return label if len(label) <= limit else label[: limit - 2] + ".."


def render_plan(
    plan: PartitionPlan,
    path: str | os.PathLike[str],
    *,
    full: bool = False,
    max_depth: int | None = None,
    title: str | None = None,
) -> None:
    """Draws the partition tree (boxes: name, ``cost / partition``; colour = partition) and a bar chart of
    per-partition costs, to ``path`` (``.png``, ``.svg`` or ``.pdf``). Needs matplotlib (extra ``plot``)."""
    target = os.fspath(path)
    ext = os.path.splitext(target)[1].lower()
    if ext not in (".png", ".svg", ".pdf"):
        raise PartitionError(
            f"cannot render a plan to {target!r}: expected a file name ending in .png, .svg or .pdf"
        )
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch
    except ImportError as exc:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "rendering a partition plan needs matplotlib: pip install 'mp-partition[plot]'"
        ) from exc

    root = display_tree(plan.tree, full=full, max_depth=max_depth)
    # Layout: leaves left to right, parents centred over their children, one row per depth.
    xs: dict[int, float] = {}
    ys: dict[int, int] = {}
    order: list[DisplayNode] = []
    next_leaf = [0.0]

    def place(node: DisplayNode, depth: int) -> float:
        order.append(node)
        ys[id(node)] = depth
        if node.children:
            child_x = [place(c, depth + 1) for c in node.children]
            x = (child_x[0] + child_x[-1]) / 2
        else:
            x = next_leaf[0]
            next_leaf[0] += 1.0
        xs[id(node)] = x
        return x

    place(root, 0)
    n_leaves = max(int(next_leaf[0]), 1)
    depth = max(ys.values()) + 1
    colors = _colors(plan.num_partitions)
    fig_w = min(max(7.0, 1.45 * n_leaves), 80.0)
    fig_h = 1.15 * depth + 2.6
    fig = Figure(figsize=(fig_w, fig_h))
    tree_ax = fig.add_axes((0.01, 2.4 / fig_h, 0.98, 1 - 2.4 / fig_h - 0.5 / fig_h))
    bar_ax = fig.add_axes((0.08, 0.35 / fig_h, 0.84, 1.6 / fig_h))
    tree_ax.set_xlim(-0.6, n_leaves - 0.4)
    tree_ax.set_ylim(depth - 0.4, -0.6)
    tree_ax.axis("off")
    box_w, box_h = 0.9, 0.62
    font = 7 if n_leaves > 12 else 8
    for node in order:
        x, y = xs[id(node)], ys[id(node)]
        for child in node.children:
            tree_ax.plot([x, xs[id(child)]], [y + box_h / 2, ys[id(child)] - box_h / 2], color="0.55", lw=0.8)
    for node in order:
        x, y = xs[id(node)], ys[id(node)]
        split = len(node.devices) > 1
        face = (0.93, 0.93, 0.93, 1.0) if split else colors[node.partition]
        tree_ax.add_patch(
            FancyBboxPatch(
                (x - box_w / 2, y - box_h / 2),
                box_w,
                box_h,
                boxstyle="round,pad=0.02",
                facecolor=face,
                edgecolor="0.25",
                lw=0.8,
                alpha=1.0 if split else 0.85,
            )
        )
        label = _short(node.label)
        second = f"{node.cost:.3f} / {node.partition}"
        if split:
            second += f"  {{{format_devices(node.devices)}}}"
        tree_ax.text(x, y - 0.1, label, ha="center", va="center", fontsize=font, fontweight="bold")
        tree_ax.text(x, y + 0.14, second, ha="center", va="center", fontsize=font)
    inp = plan.inputs
    tree_ax.set_title(
        title
        or f"{inp.model_class}: {plan.num_partitions} partitions, "
        + (f"memory_weight {inp.memory_weight:g}" if inp.method == "auto" else "manual")
        + f"  (box: name, normalized cost / partition; max/mean {plan.imbalance:.3f})",
        fontsize=9,
    )
    indices = list(range(plan.num_partitions))
    predicted = plan.predicted_times_s
    if predicted is None:
        bar_ax.bar(indices, list(plan.costs), color=[colors[i] for i in indices], edgecolor="0.25", lw=0.6)
        bar_ax.axhline(1 / plan.num_partitions, color="0.3", ls="--", lw=0.8)
        bar_ax.set_ylabel("cost", fontsize=8)
    else:  # stage times: predicted (solid) beside measured (hatched), ms per microbatch
        measured = [p.measured_time_s for p in plan.partitions]
        width = 0.4 if any(m is not None for m in measured) else 0.8
        shift = width / 2 if width < 0.8 else 0.0
        bar_ax.bar(
            [i - shift for i in indices],
            [t * 1e3 for t in predicted],
            width,
            color=[colors[i] for i in indices],
            edgecolor="0.25",
            lw=0.6,
            label="predicted",
        )
        if width < 0.8:
            bar_ax.bar(
                [i + shift for i in indices],
                [0.0 if m is None else m * 1e3 for m in measured],
                width,
                color="white",
                edgecolor=[colors[i] for i in indices],
                hatch="///",
                lw=0.8,
                label="measured",
            )
        bar_ax.legend(fontsize=7, loc="lower right")
        bar_ax.set_ylabel("ms / microbatch", fontsize=8)
    bar_ax.set_xticks(indices)
    bar_ax.set_xlabel("partition", fontsize=8)
    bar_ax.tick_params(labelsize=7)
    fig.savefig(target, dpi=130)
