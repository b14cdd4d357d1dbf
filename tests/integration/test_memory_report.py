"""smp's trace_memory_usage: each rank's memory report (smp.memory_report()) equals the bytes of the actual
tensors. A chain of three bias-free linears with a sum loss keeps, for backward, exactly each linear's
input (the weights are parameters, not activations), so the peak activations are known in closed form:
B x (8 + 32 + 64) floats; checkpointing the last two linears keeps only their input (B x (8 + 32)), and
offloading that input to host memory leaves B x 8. Parameters, gradients and Adam's state (two moments per
parameter and a 4-byte step count) are checked alone and per pipeline stage at pp=2. MP_MEMORY_REPORT=1
(what mp-launch --memory-report sets) logs the report after the first step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from torch import nn

import mp as smp
from mp_partition import set_partition

B = 4
WIDTHS = (8, 32, 64, 16)
FLOAT = 4


class Chain(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.head = nn.Linear(WIDTHS[0], WIDTHS[1], bias=False)
        self.tail = nn.Sequential(
            nn.Linear(WIDTHS[1], WIDTHS[2], bias=False), nn.Linear(WIDTHS[2], WIDTHS[3], bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        return smp.checkpoint(self.tail, h) if self.how != "plain" else self.tail(h)


def _weights(*layers: tuple[int, int]) -> int:
    return sum(a * b * FLOAT for a, b in layers)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(world: Any, how: str, pp: int, traced: bool, by_env: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {"microbatches": 1, "offload_activations": how == "offload"}
    if pp > 1:
        config.update(pipeline_parallel_degree=pp, auto_partition=False, default_partition=0)
    collect = _Collect()
    logger = logging.getLogger("mp.memory")
    logger.addHandler(collect)
    level = logger.level
    logger.setLevel(logging.INFO)  # the report is logged at info level
    if by_env:
        os.environ["MP_MEMORY_REPORT"] = "1"
    smp.init(config)
    try:
        torch.manual_seed(0)
        net = Chain(how)
        if pp > 1:
            set_partition(net.tail, 1)
        model = smp.DistributedModel(net, trace_memory_usage=traced)
        opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

        @smp.step
        def train_step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).sum()
            model.backward(loss)
            return loss

        for s in range(2):
            opt.zero_grad()
            train_step(torch.randn(B, WIDTHS[0], generator=torch.Generator().manual_seed(s)))
            opt.step()
            if s == 0:
                logged = list(collect.lines)
        report = smp.memory_report()
        return {
            "pp_rank": smp.pp_rank(),
            "report": report.as_dict(),
            "line": report.format(),
            "logged": logged,
        }
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
        os.environ.pop("MP_MEMORY_REPORT", None)
        smp.reset()


PEAK = {
    "plain": B * sum(WIDTHS[:3]) * FLOAT,  # the inputs of the three linears
    "checkpoint": B * sum(WIDTHS[:2]) * FLOAT,  # the tail's checkpoint keeps its input only
    "offload": B * WIDTHS[0] * FLOAT,  # and that input waits in host memory
}


@pytest.mark.parametrize("how", ["plain", "checkpoint", "offload"])
def test_report_matches_the_tensors_alone(worlds: Any, how: str) -> None:
    (r,) = worlds.run(1, _run, how, 1, True, timeout=60)
    params = _weights(WIDTHS[0:2], WIDTHS[1:3], WIDTHS[2:4])
    rep = r["report"]
    assert rep["parameters"] == params and rep["gradients"] == params, r
    assert rep["optimizer_state"] == 2 * params + 3 * FLOAT, r  # exp_avg, exp_avg_sq, step per parameter
    assert rep["peak_activations"] == PEAK[how], r
    assert rep["device_peak"] is None, r  # CPU
    assert r["logged"] == [r["line"]], r  # logged once, after the first step's optimizer step


def test_report_per_stage_at_pp2(worlds: Any) -> None:
    results = worlds.run(2, _run, "plain", 2, True, timeout=120)
    stage = {0: _weights(WIDTHS[0:2]), 1: _weights(WIDTHS[1:3], WIDTHS[2:4])}
    for r in results:
        rep = r["report"]
        own = stage[r["pp_rank"]]
        assert rep["parameters"] == own and rep["gradients"] == own, r
        assert rep["optimizer_state"] == 2 * own + (1 if r["pp_rank"] == 0 else 2) * FLOAT, r
        assert rep["peak_activations"] > 0, r
    # pp_rank 1 keeps the inputs of its two linears (the first one received from pp_rank 0)
    assert results[1]["report"]["peak_activations"] == B * (WIDTHS[1] + WIDTHS[2]) * FLOAT, results[1]


def test_untraced_report_has_no_activations_and_env_turns_tracing_on(worlds: Any) -> None:
    (off,) = worlds.run(1, _run, "plain", 1, False, timeout=60)
    assert off["report"]["peak_activations"] is None and off["logged"] == [], off
    assert off["report"]["parameters"] > 0
    (env,) = worlds.run(1, _run, "plain", 1, False, True, timeout=60)
    assert env["report"]["peak_activations"] == PEAK["plain"], env
    assert env["logged"] == [env["line"]] and env["line"].startswith("rank 0 memory: parameters"), env


LAUNCHED = """
import torch
import mp as smp
smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

@smp.step
def train_step(x):
    loss = model(x).sum()
    model.backward(loss)
    return loss

train_step(torch.randn(4, 8))
opt.step()
smp.shutdown()
"""


def test_mp_launch_memory_report_prints_every_rank(tmp_path: Any) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(tmp_path) / "train.py"
    script.write_text(LAUNCHED)
    launcher = Path(sys.executable).with_name("mp-launch")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MP_NUM_THREADS")}
    proc = subprocess.run(
        [str(launcher), "-n", "2", "--memory-report", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if " memory: parameters " in ln]
    assert sorted(ln.split(" memory:")[0].split()[-1] for ln in lines) == ["0", "1"], proc.stderr[-3000:]
    assert all("peak activations" in ln and "n/a" not in ln for ln in lines), lines
