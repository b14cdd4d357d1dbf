"""What the planner shows: the ranked table, the chosen layout's mp config, and its predicted timeline."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mp.plan.cluster import Cluster
from mp.plan.estimate import Estimate

__all__ = ["checked_config", "format_estimates", "render_timeline", "to_dict"]

_log = logging.getLogger(__name__)
_GB = 1e9


def checked_config(est: Estimate) -> dict[str, Any]:
    """The layout's mp config, validated by mp's own config checks for its world size."""
    from mp.config import load_config, validate_world

    cfg = est.layout.config()
    parsed = load_config(cfg)
    validate_world(parsed, est.layout.world, min(est.layout.world, est.layout.world))
    return cfg


def format_estimates(
    estimates: Sequence[Estimate],
    cluster: Cluster,
    *,
    top: int = 10,
    title: str = "",
    searched: int | None = None,
) -> str:
    """The ranked layouts as an aligned text table (fitting ones first)."""
    head = (
        "#",
        "layout",
        "step s",
        "samples/s",
        "mem GB",
        "param",
        "grad",
        "master",
        "optim",
        "act",
        "fits",
        "bottleneck",
        "bubble",
    )
    rows: list[tuple[str, ...]] = [head]
    for i, e in enumerate(estimates[:top]):
        mem = e.memory
        rows.append(
            (
                str(i + 1),
                e.layout.label(),
                f"{e.step_time:.4g}",
                f"{e.samples_per_s:.4g}",
                f"{mem.total / _GB:.2f}",
                f"{mem.parameters / _GB:.2f}",
                f"{mem.gradients / _GB:.2f}",
                f"{mem.master / _GB:.2f}",
                f"{mem.optimizer / _GB:.2f}",
                f"{mem.activations / _GB:.2f}",
                "yes" if e.fits else "NO",
                e.time.bottleneck(),
                f"{100 * e.bubble_fraction:.0f}%",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [title] if title else []
    lines.append(
        f"cluster {cluster.name}: {cluster.hosts} host(s) x {cluster.devices_per_host} devices, "
        f"{cluster.device_memory_bytes / _GB:.1f} GB usable per device"
    )
    if cluster.ranks_per_core > 1:
        lines.append(
            f"{cluster.devices_per_host} ranks per host on {cluster.cores_per_host} CPU cores: they take "
            f"turns ({cluster.ranks_per_core:.3g} ranks per core), each step at least the host's work over "
            "its cores ('shared cores')"
        )
    lines += [
        "  ".join(
            c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    fitting = sum(1 for e in estimates if e.fits)
    lines.append(
        f"{fitting} of {len(estimates)} layouts fit; memory is the device that needs most (GB = 1e9 B)"
    )
    return "\n".join(lines) + "\n"


def to_dict(est: Estimate) -> dict[str, Any]:
    """One estimate as JSON-ready data."""
    t, m = est.time, est.memory
    return {
        "layout": est.layout.label(),
        "pp": est.layout.pp,
        "tp": est.layout.tp,
        "rdp": est.layout.rdp,
        "sdp": est.layout.sdp,
        "microbatches": est.layout.microbatches,
        "microbatch_size": est.microbatch_size,
        "schedule": est.layout.schedule,
        "precision": est.layout.precision,
        "checkpointing": est.layout.checkpointing,
        "offload": est.layout.offload,
        "shard_optimizer_state": est.layout.shard_optimizer_state,
        "step_time_s": est.step_time,
        "samples_per_s": est.samples_per_s,
        "fits": est.fits,
        "bottleneck": t.bottleneck(),
        "time_s": {
            "compute": t.compute,
            "tp_comm": t.tp_comm,
            "p2p": t.p2p,
            "bubble": t.bubble,
            "dp_comm": t.dp_comm,
            "optimizer": t.optimizer,
            "calls": t.calls,
            "memory_bound": t.memory_bound,
            "shared_cores": t.shared_cores,
        },
        "memory_bytes": {
            "stage": m.stage,
            "parameters": m.parameters,
            "gradients": m.gradients,
            "master": m.master,
            "optimizer": m.optimizer,
            "activations": m.activations,
            "total": m.total,
            "device": est.device_memory,
        },
        "offload_bytes_per_step": est.offload_bytes_per_step,
        "config": est.layout.config(),
    }


def render_timeline(est: Estimate, path: str | os.PathLike[str]) -> Path | None:
    """Draws the predicted step of ``est`` as the runtime draws a measured one (one row per pipeline
    stage); returns None, after one log line, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _log.warning("matplotlib is not installed: no timeline picture (pip install matplotlib)")
        return None
    from mp_pipeline import Event, EventKind, Timeline

    ns = 1e9
    events: list[Event] = []
    end = max((s[4] for s in est.spans), default=0.0)
    for stage in range(est.layout.pp):
        events.append(
            Event(EventKind.STEP, stage, "main", 0, "<step>", -1, 0, int((end + est.time.dp_comm) * ns))
        )
        if est.time.dp_comm > 0:
            events.append(
                Event(
                    EventKind.REDUCE,
                    stage,
                    "main",
                    0,
                    "<dp>",
                    -1,
                    int(end * ns),
                    int((end + est.time.dp_comm) * ns),
                )
            )
    for stage, mb, phase, start, stop in est.spans:
        kind = EventKind.FWD if phase == "FWD" else EventKind.BWD
        events.append(Event(kind, stage, "main", 0, f"stage{stage}", mb, int(start * ns), int(stop * ns)))
    events.sort(key=lambda e: (e.start_ns, e.rank, e.end_ns))
    labels = {s: f"pp stage {s}" for s in range(est.layout.pp)}
    timeline = Timeline(tuple(events), labels, {0: 0})
    title = f"predicted step: {est.layout.label()} ({est.step_time:.3g} s)"
    return timeline.render(path, title=title)


def dumps(data: object) -> str:
    return json.dumps(data, indent=2, sort_keys=False)
