"""The pipeline timeline: the recorder, the merge of several ranks' clocks, the Chrome trace and the
picture; then real recordings (two loopback ranks in one process, and a 2-rank MPI world through
``smp.timeline``) holding a forward and a backward execution of every microbatch on both ranks."""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mp_pipeline import RECORDER, EventKind, Recorder, Timeline, pipelined_backward
from mp_pipeline.timeline import STEP_MODULE, busy_segments
from tests.mp_pipeline._loopback import run_two_ranks
from tests.mp_pipeline._traces import two_rank_trace
from tests.mp_pipeline.models import build

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

NO_MATPLOTLIB = """
import importlib.abc, sys

class NoMatplotlib(importlib.abc.MetaPathFinder):
    \"\"\"Any import of matplotlib fails, as where it is not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMatplotlib())
"""
"""A sitecustomize.py: a process started with its folder on PYTHONPATH cannot import matplotlib."""


class _NoMatplotlib(importlib.abc.MetaPathFinder):
    """NO_MATPLOTLIB's finder, for a process of the test pool (see `no_matplotlib`)."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> None:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@contextlib.contextmanager
def no_matplotlib() -> Iterator[None]:
    """In this process, importing matplotlib fails until the block ends (then it is as before)."""
    saved = {k: m for k, m in sys.modules.items() if k == "matplotlib" or k.startswith("matplotlib.")}
    for name in saved:
        del sys.modules[name]
    finder = _NoMatplotlib()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(saved)


def test_disabled_recorder_records_nothing_and_costs_a_shared_no_op() -> None:
    rec = Recorder()
    span = rec.span(EventKind.FWD, rank=0, step=1, module="m", microbatch=0)
    assert span is rec.span(EventKind.BWD, rank=1, step=2, module="n", microbatch=1)  # one shared object
    with span:
        pass
    rec.add(EventKind.FWD, rank=0, step=1, module="m", microbatch=0, start_ns=0, end_ns=1)
    rec.start()
    trace = rec.stop()
    assert trace.events == ()


def test_recorder_keeps_rank_thread_and_times() -> None:
    rec = Recorder()
    rec.start()
    with rec.span(EventKind.FWD, rank=3, step=7, module="a.b", microbatch=2):
        pass

    def other() -> None:
        rec.add(
            EventKind.WAIT,
            rank=3,
            step=7,
            module="c",
            microbatch=1,
            start_ns=5,
            end_ns=9,
            phase="BWD",
            peer=0,
        )

    t = threading.Thread(target=other, name="worker-x")
    t.start()
    t.join()
    trace = rec.stop()
    fwd, wait = trace.events
    assert (fwd.kind, fwd.rank, fwd.step, fwd.module, fwd.microbatch) == (EventKind.FWD, 3, 7, "a.b", 2)
    assert fwd.thread == threading.current_thread().name and 0 <= fwd.duration_ns < 10**9
    assert (wait.thread, wait.phase, wait.peer, wait.duration_ns) == ("worker-x", "BWD", 0, 4)
    with rec.span(EventKind.FWD, rank=0, step=1, module="m", microbatch=0):
        pass
    assert rec.stop().events == ()  # stopped: nothing more


def test_busy_segments_cut_out_the_waits() -> None:
    assert busy_segments(0, 10, []) == [(0, 10)]
    assert busy_segments(0, 10, [(2, 4), (3, 6), (8, 12)]) == [(0, 2), (6, 8)]
    assert busy_segments(0, 10, [(-5, 15)]) == []
    assert busy_segments(5, 10, [(0, 1), (11, 12)]) == [(5, 10)]


@pytest.mark.parametrize("offset1", [0, 123_456_789])
def test_merge_aligns_the_clocks_of_several_processes(offset1: int) -> None:
    tl = Timeline.merge(two_rank_trace(offset1))
    assert tl.ranks == (0, 1)
    assert tl.step_origins_ns == {1: 0}
    fwd1 = tl.select(EventKind.FWD, rank=1)[0]
    assert (fwd1.start_ns, fwd1.end_ns) == (8000, 22000)  # same place whatever the process's clock
    assert tl.labels == {0: "pp 0, dp 0", 1: "pp 1, dp 0"}
    # rank 0's forward of microbatch 0 computed 1-5 and 25-30 µs (it waited for rank 1 in between)
    segs = {(e.kind, e.microbatch, e.thread): s for e, s in tl.compute_segments(0)}
    assert segs[(EventKind.FWD, 0, "w0")] == [(1000, 5000), (25000, 30000)]
    assert segs[(EventKind.FWD, 1, "w1")] == [(6000, 20000)]
    assert segs[(EventKind.BWD, 0, "w0")] == [(40000, 45000), (80000, 90000)]
    assert tl.busy_fraction(1) == pytest.approx((14 + 25) / 100)


def test_chrome_trace_is_valid_json_with_complete_events_per_rank_and_thread(tmp_path: Path) -> None:
    tl = Timeline.merge(two_rank_trace(77))
    path = tl.write_chrome(tmp_path / "sub" / "t.json")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(1 for e in tl.events if e.kind is not EventKind.REQUEST)
    for e in complete:
        assert {"name", "cat", "pid", "tid", "ts", "dur", "args"} <= set(e)
        assert e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
    assert {e["pid"] for e in complete} == {0, 1}
    fwd = [e for e in complete if e["cat"] == "FWD" and e["pid"] == 1]
    assert fwd[0]["ts"] == 8.0 and fwd[0]["dur"] == 14.0 and fwd[0]["args"]["microbatch"] == 0
    [req] = [e for e in events if e["ph"] == "i"]
    assert req["args"]["peer"] == 1 and req["args"]["phase"] == "FWD"
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(0, "MainThread"), (0, "w0"), (0, "w1"), (1, "MainThread"), (1, "w0")}
    tids = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e.get("name") == "thread_name"}
    assert tids[(0, "MainThread")] == 0  # the main thread first
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert procs == {0: "rank 0 (pp 0, dp 0)", 1: "rank 1 (pp 1, dp 0)"}


def test_without_matplotlib_the_trace_is_written_with_one_warning(tmp_path: Path) -> None:
    # A fresh interpreter where matplotlib cannot be imported (a sitecustomize on PYTHONPATH).
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_MATPLOTLIB)
    code = f"""
        import logging
        from tests.mp_pipeline._traces import two_rank_trace
        from mp_pipeline import Timeline
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        try:
            import matplotlib
        except ImportError:
            pass
        else:
            raise SystemExit("matplotlib was importable")
        paths = Timeline.merge(two_rank_trace()).write({str(tmp_path / "out" / "tl")!r})
        print("PATHS", [str(p) for p in paths])
        """
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(tmp_path / "site"), str(root), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"PATHS {[str(tmp_path / 'out' / 'tl.json')]}" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "out" / "tl.json").read_text())["traceEvents"]
    assert not (tmp_path / "out" / "tl.png").exists()
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "pip install 'mp-pipeline[plot]'" in warnings[0], proc.stderr


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    json_path, png_path = Timeline.merge(two_rank_trace()).write(tmp_path / "out" / "tl", title="test")
    assert json_path == tmp_path / "out" / "tl.json" and json_path.exists()
    assert png_path == tmp_path / "out" / "tl.png"
    assert png_path.read_bytes()[:8] == PNG_MAGIC and png_path.stat().st_size > 5000


def check_every_microbatch(timeline: Timeline, ranks: tuple[int, ...], microbatches: int) -> None:
    for rank in ranks:
        for kind in (EventKind.FWD, EventKind.BWD):
            got = sorted({e.microbatch for e in timeline.select(kind, rank=rank)})
            assert got == list(range(microbatches)), f"rank {rank}: {kind} executions of microbatches {got}"


def test_loopback_pipeline_records_every_microbatch_on_both_ranks() -> None:
    assignment = {"": 0, "0": 0, "1": 1, "2": 1}

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    x, y = torch.randn(8, 6), torch.randn(8, 2)

    def body(model: nn.Module, mb: int) -> torch.Tensor:
        loss = F.mse_loss(model(x[2 * mb : 2 * mb + 2]), y[2 * mb : 2 * mb + 2])
        pipelined_backward(loss / 4)
        return loss.detach()

    RECORDER.start()
    try:
        _, results = run_two_ranks(make, assignment, body, 4, "interleaved")
    finally:
        trace = RECORDER.stop()
    assert not any(isinstance(r, BaseException) for r in results), results
    tl = Timeline.merge([trace])
    check_every_microbatch(tl, (0, 1), 4)
    assert {e.module for e in tl.select(EventKind.FWD, rank=0)} == {STEP_MODULE}
    assert {e.module for e in tl.select(EventKind.FWD, rank=1)} == {"1", "2"}
    assert len(tl.select(EventKind.STEP)) == 2
    waits = tl.select(EventKind.WAIT, rank=0)
    assert {(e.phase, e.peer) for e in waits} == {("FWD", 1), ("BWD", 1)}
    assert len(tl.select(EventKind.REQUEST, rank=0)) == len(waits) == 16  # 2 modules x 4 mb x FWD/BWD


# ------------------------------------------------------------------------------------- on 2 MPI ranks
def record_gpt2_step(world: Any, prefix: str, microbatches: int) -> dict[str, Any]:
    import mp as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": microbatches, "pipeline": "interleaved"})
    model = smp.DistributedModel(build("gpt2", layers=2))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss  # type: ignore[no-any-return]

    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    train_step(ids)  # the first step partitions the model; record the second
    optimizer.step()
    optimizer.zero_grad()
    with smp.timeline.record(prefix) as rec:
        assert smp.timeline.is_recording()
        train_step(ids)
    assert not smp.timeline.is_recording()
    # The docs' block again where matplotlib cannot be imported: rank 0 writes the trace, warns once
    # and goes on (it used to raise ImportError, and mp-launch ended the job).
    bare = prefix + "-without-matplotlib"
    warned: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("mp_pipeline.timeline").addHandler(catch)
    try:
        with no_matplotlib(), smp.timeline.record(bare) as bare_rec:
            train_step(ids)
    finally:
        logging.getLogger("mp_pipeline.timeline").removeHandler(catch)
    if smp.rank() != 0:
        assert rec.timeline is None and rec.paths is None and bare_rec.paths is None and not warned
        return {}
    assert rec.timeline is not None and rec.paths is not None
    assert bare_rec.paths == (Path(bare + ".json"),) and not Path(bare + ".png").exists()
    assert len(warned) == 1 and "pip install 'mp-pipeline[plot]'" in warned[0], warned
    return {"timeline": rec.timeline, "paths": [str(p) for p in rec.paths]}


def test_smp_timeline_on_two_ranks_holds_fwd_and_bwd_of_every_microbatch(worlds: Any, tmp_path: Path) -> None:
    pytest.importorskip("mp")
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    prefix = str(tmp_path / "timeline")
    results = worlds.run(2, record_gpt2_step, prefix, 4, timeout=300)
    assert results[1] == {}
    timeline: Timeline = results[0]["timeline"]
    assert results[0]["paths"] == [prefix + ".json", prefix + ".png"]
    check_every_microbatch(timeline, (0, 1), 4)
    assert {e.step for e in timeline.events} == {2}
    assert timeline.labels == {0: "pp 0, dp 0", 1: "pp 1, dp 0"}
    assert [e.rank for e in timeline.select(EventKind.STEP)] in ([0, 1], [1, 0])
    # the written trace says the same
    data = json.loads(Path(prefix + ".json").read_text())
    seen = {
        (e["pid"], e["cat"], e["args"]["microbatch"])
        for e in data["traceEvents"]
        if e["ph"] == "X" and e["cat"] in ("FWD", "BWD")
    }
    assert seen == {(r, k, m) for r in (0, 1) for k in ("FWD", "BWD") for m in range(4)}
    assert Path(prefix + ".png").read_bytes()[:8] == PNG_MAGIC
    # rank 0 waited for rank 1 in both phases; rank 1's executions fall inside its step
    assert {e.phase for e in timeline.select(EventKind.WAIT, rank=0)} == {"FWD", "BWD"}
    [step1] = timeline.select(EventKind.STEP, rank=1)
    for e in timeline.select(rank=1):
        if e.kind in (EventKind.FWD, EventKind.BWD):
            assert step1.start_ns <= e.start_ns <= e.end_ns <= step1.end_ns
