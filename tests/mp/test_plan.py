"""mp-plan against closed-form counts: parameters, FLOPs, optimizer state per layout, the bubble of each
schedule; its configs pass mp's validation; the command's errors; the printed config runs under mp-launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mp
from mp.config import load_config, validate_world
from mp.plan import (
    Layout,
    ModelProfile,
    PlanError,
    StageProfile,
    calibrate_cpu,
    estimate,
    get_cluster,
    profile_model,
    split_stages,
)
from mp.plan.cli import main as plan_main
from mp.plan.report import checked_config, format_estimates, render_timeline
from tests.mp.plan_models import FACTORY, free_cluster

ROOT = Path(__file__).resolve().parents[2]


def _stage(index: int, params: int, flops: float = 1.0, acts: int = 0, layers: int = 1) -> StageProfile:
    return StageProfile(
        index=index,
        params=params,
        activation_bytes=acts,
        block_activation_bytes=acts,
        max_block_activation_bytes=acts // max(layers, 1),
        flops=flops,
        layers=layers,
    )


def test_profile_counts_parameters_and_flops_in_closed_form() -> None:
    layers, hidden, seq = 3, 16, 8
    prof = profile_model(
        FACTORY, seq_len=seq, factory_kwargs={"layers": layers, "hidden": hidden, "seq": seq}
    )
    assert prof.num_parameters == layers * (hidden * hidden + hidden) + hidden * 4 + 4
    assert prof.forward_flops == layers * 2 * seq * hidden * hidden + 2 * seq * hidden * 4
    assert prof.layers == layers and prof.hidden == hidden
    assert prof.flops["blocks.0.fc"] == 2 * seq * hidden * hidden
    # every stage's sums add up to the model's, whatever the partition
    stages = split_stages(prof, 2)
    assert sum(s.params for s in stages) == prof.num_parameters
    assert sum(s.flops for s in stages) == prof.forward_flops
    assert sum(s.layers for s in stages) == layers and all(s.params > 0 for s in stages)


@pytest.mark.parametrize(
    ("precision", "zero1", "sdp", "expected"),
    [
        # (parameters, gradients, fp32 masters, Adam states) per device, for P / tp parameters
        ("fp32", False, 1, (4, 4, 0, 8)),
        ("fp32", True, 1, (4, 4, 0, 8 / 4)),
        ("bf16", False, 1, (2, 2, 4, 8)),
        ("fp16", True, 1, (2, 2, 4 / 4, 8 / 4)),
        ("fp32", False, 4, (4 / 4, 4 / 4, 0, 8 / 4)),
        ("bf16", False, 4, (2 / 4, 2 / 4, 4 / 4, 8 / 4)),
    ],
)
def test_memory_per_device_follows_the_layout(
    precision: str, zero1: bool, sdp: int, expected: tuple[float, float, float, float]
) -> None:
    params, tp, rdp = 1_000_000, 2, 4
    layout = Layout(
        pp=1,
        tp=tp,
        rdp=rdp,
        microbatches=1,
        precision=precision,
        shard_optimizer_state=zero1,
        sdp=sdp,  # type: ignore[arg-type]
    )
    est = estimate(layout, (_stage(0, params),), free_cluster(), global_batch=rdp, seq_len=4, hidden=8)
    mem = est.memory
    per = params / tp
    got = (mem.parameters / per, mem.gradients / per, mem.master / per, mem.optimizer / per)
    assert got == pytest.approx(expected)
    assert mem.activations == 0


def test_activation_memory_counts_microbatches_in_flight_and_checkpointing() -> None:
    acts, layers, seq, hidden = 1_000_000, 4, 8, 16
    stage = _stage(0, 10, acts=acts, layers=layers)
    common = {"global_batch": 8, "seq_len": seq, "hidden": hidden}
    plain = estimate(
        Layout(pp=1, tp=1, rdp=1, microbatches=4, schedule="simple", active_microbatches=4),
        (stage,),
        free_cluster(),
        **common,
    )
    # 4 microbatches of 2 samples all in flight (GPipe), fp32 as traced
    assert plain.in_flight == 4 and plain.memory.activations == 4 * 2 * acts
    ckpt = estimate(
        Layout(
            pp=1, tp=1, rdp=1, microbatches=4, schedule="simple", checkpointing=True, active_microbatches=4
        ),
        (stage,),
        free_cluster(),
        **common,
    )
    # each layer keeps its input (2 x seq x hidden fp32) per microbatch, plus one layer recomputed
    assert ckpt.memory.activations == 4 * layers * 2 * seq * hidden * 4 + 2 * acts // layers
    half = estimate(
        Layout(pp=1, tp=2, rdp=1, microbatches=4, schedule="simple", precision="bf16", active_microbatches=4),
        (stage,),
        free_cluster(),
        **common,
    )
    assert half.memory.activations == 4 * 2 * acts / 2 / 2


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8)])
def test_bubble_of_the_simple_schedule_is_gpipes(pp: int, m: int) -> None:
    # GPipe: every microbatch in flight (mp's default active_microbatches, min(pp + 2, m), runs waves)
    stages = tuple(_stage(i, 10, flops=1.0) for i in range(pp))
    est = estimate(
        Layout(pp=pp, tp=1, rdp=1, microbatches=m, schedule="simple", active_microbatches=m),
        stages,
        free_cluster(),
        global_batch=m,
        seq_len=1,
        hidden=1,
    )
    # forward 1, backward 2 per microbatch and stage: (m + pp - 1) x 3, bubble (pp - 1) / (m + pp - 1)
    assert est.step_time == pytest.approx((m + pp - 1) * 3)
    assert est.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert est.time.compute == pytest.approx(3 * m)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_bubble_of_the_interleaved_schedule_is_1f1bs_with_mps_default_active_microbatches(
    pp: int, m: int
) -> None:
    stages = tuple(_stage(i, 10, flops=1.0) for i in range(pp))
    est = estimate(
        Layout(pp=pp, tp=1, rdp=1, microbatches=m),
        stages,
        free_cluster(),
        global_batch=m,
        seq_len=1,
        hidden=1,
    )
    assert est.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert est.in_flight == min(pp + 2, m)


def test_checkpointing_recomputes_the_forward_and_tp_divides_compute() -> None:
    stage = _stage(0, 10, flops=6.0)
    base = estimate(
        Layout(pp=1, tp=1, rdp=1, microbatches=1),
        (stage,),
        free_cluster(),
        global_batch=1,
        seq_len=1,
        hidden=1,
    )
    ckpt = estimate(
        Layout(pp=1, tp=1, rdp=1, microbatches=1, checkpointing=True),
        (stage,),
        free_cluster(),
        global_batch=1,
        seq_len=1,
        hidden=1,
    )
    tp2 = estimate(
        Layout(pp=1, tp=2, rdp=1, microbatches=1),
        (stage,),
        free_cluster(),
        global_batch=1,
        seq_len=1,
        hidden=2,
    )
    assert base.time.compute == pytest.approx(18.0)
    assert ckpt.time.compute == pytest.approx(24.0)
    assert tp2.time.compute == pytest.approx(9.0)


def test_data_parallel_all_reduce_is_a_ring() -> None:
    params, rdp, bw = 1_000_000, 4, 1e9
    clus = free_cluster(intra_bandwidth=bw)
    est = estimate(
        Layout(pp=1, tp=1, rdp=rdp, microbatches=1),
        (_stage(0, params, flops=0.0),),
        clus,
        global_batch=rdp,
        seq_len=1,
        hidden=1,
    )
    assert est.time.dp_comm == pytest.approx(2 * (rdp - 1) / rdp * params * 4 / bw, rel=1e-6)


def test_zero1_adds_torch_zeros_parameter_broadcasts_after_the_step() -> None:
    params, tensors, rdp, bw, lat = 1_000_000, 7, 4, 1e9, 1e-3
    clus = free_cluster(intra_bandwidth=bw, intra_latency=lat)
    stage = StageProfile(
        index=0,
        params=params,
        activation_bytes=0,
        block_activation_bytes=0,
        max_block_activation_bytes=0,
        flops=0.0,
        layers=1,
        param_tensors=tensors,
    )
    common = {"global_batch": rdp, "seq_len": 1, "hidden": 1, "overlap_dp": False}
    plain = estimate(Layout(pp=1, tp=1, rdp=rdp, microbatches=1), (stage,), clus, **common)
    zero1 = estimate(
        Layout(pp=1, tp=1, rdp=rdp, microbatches=1, shard_optimizer_state=True), (stage,), clus, **common
    )
    ring = 2 * (rdp - 1) / rdp * params * 4 / bw + 2 * (rdp - 1) * lat
    assert plain.time.dp_comm == pytest.approx(ring)
    # all-reduce, then every rank broadcasts its share: (n-1)/n of the parameters, one call per tensor
    assert zero1.time.dp_comm == pytest.approx(ring + (rdp - 1) / rdp * params * 4 / bw + tensors * lat)
    # the broadcasts are torch.distributed's: at its own latency and bandwidth where the cluster has them
    c10d = free_cluster(intra_bandwidth=bw, intra_latency=lat, c10d_latency=5e-3, c10d_bandwidth=bw / 2)
    zero1_c10d = estimate(
        Layout(pp=1, tp=1, rdp=rdp, microbatches=1, shard_optimizer_state=True), (stage,), c10d, **common
    )
    bcast = (rdp - 1) / rdp * params * 4 / (bw / 2) + tensors * 5e-3
    assert zero1_c10d.time.dp_comm == pytest.approx(ring + bcast)
    # smp's way (its paper's Appendix H.1): gradients reduced to their owner, then the broadcast
    smp_way = estimate(
        Layout(pp=1, tp=1, rdp=rdp, microbatches=1, shard_optimizer_state=True),
        (stage,),
        clus,
        zero1_reduce_scatter=True,
        **common,
    )
    scatter = (rdp - 1) / rdp * params * 4 / bw + (rdp - 1) * lat
    assert smp_way.time.dp_comm == pytest.approx(scatter + (rdp - 1) / rdp * params * 4 / bw + tensors * lat)


def test_sdp_costs_fsdp2s_gathers_and_reduce_scatters_per_unit() -> None:
    params, layers, rdp, bw, lat, rs_bw, rs_lat = 1_000_000, 3, 4, 1e9, 1e-3, 2.5e8, 4e-3
    stage = _stage(0, params, flops=0.0, layers=layers)
    common = {"global_batch": rdp, "seq_len": 1, "hidden": 1, "overlap_dp": False}
    sdp = Layout(pp=1, tp=1, rdp=rdp, microbatches=1, sdp=rdp)
    clus = free_cluster(c10d_bandwidth=bw, c10d_latency=lat)
    units = layers + 1  # a unit per layer and the root
    # per unit two all-gathers of parameters (forward, backward) and a reduce-scatter of gradients, each
    # moving (n - 1) / n of the unit's bytes at the bus bandwidth
    gathers = (rdp - 1) / rdp * 2 * params * 4 / bw + 2 * units * lat
    same = estimate(sdp, (stage,), clus, **common)
    assert same.time.dp_comm == pytest.approx(gathers + (rdp - 1) / rdp * params * 4 / bw + units * lat)
    own = clus.with_(c10d_reduce_scatter_bandwidth=rs_bw, c10d_reduce_scatter_latency=rs_lat)
    apart = estimate(sdp, (stage,), own, **common)
    assert apart.time.dp_comm == pytest.approx(
        gathers + (rdp - 1) / rdp * params * 4 / rs_bw + units * rs_lat
    )


def test_more_ranks_than_cores_take_turns_on_them() -> None:
    # 1 FLOP/s per rank: forward 1 s and backward 2 s per microbatch and stage, nothing else costs
    stage = _stage(0, 10, flops=1.0)
    common = {"seq_len": 1, "hidden": 1}
    dp4 = Layout(pp=1, tp=1, rdp=4, microbatches=1)
    own = estimate(dp4, (stage,), free_cluster(devices_per_host=4), global_batch=4, **common)
    shared = estimate(
        dp4, (stage,), free_cluster(devices_per_host=4, cores_per_host=2), global_batch=4, **common
    )
    assert own.step_time == pytest.approx(3.0) and own.time.shared_cores == 0.0
    # 4 ranks of 3 s of work on 2 cores: 6 s, the 3 s beyond the work waiting for a core
    assert shared.step_time == pytest.approx(4 * 3.0 / 2)
    assert shared.time.shared_cores == pytest.approx(3.0)
    assert shared.step_time == pytest.approx(shared.time.total)
    one = estimate(
        dp4, (stage,), free_cluster(devices_per_host=4, cores_per_host=1), global_batch=4, **common
    )
    assert one.step_time == pytest.approx(12.0) and one.time.bottleneck() == "shared cores"
    # as many cores as ranks: nothing shared
    enough = free_cluster(devices_per_host=4, cores_per_host=4)
    assert estimate(dp4, (stage,), enough, global_batch=4, **common).step_time == pytest.approx(3.0)
    # GPipe, pp=2, m=2: the simulated step is (m + pp - 1) x 3 = 9 s with a bubble, but both stages' 12 s
    # of work on one core need 12 s (one rank's bubble is the other's turn on the core)
    pp2 = Layout(pp=2, tp=1, rdp=1, microbatches=2, schedule="simple", active_microbatches=2)
    stages = (_stage(0, 10, flops=1.0), _stage(1, 10, flops=1.0))
    alone = estimate(pp2, stages, free_cluster(devices_per_host=2), global_batch=2, **common)
    one_core = estimate(
        pp2, stages, free_cluster(devices_per_host=2, cores_per_host=1), global_batch=2, **common
    )
    assert alone.step_time == pytest.approx(9.0)
    assert one_core.step_time == pytest.approx(12.0) and one_core.time.shared_cores == pytest.approx(3.0)
    with pytest.raises(PlanError, match="cores_per_host=-1"):
        free_cluster(cores_per_host=-1)
    # the cpu preset's calibration counts the cores this process may run on; the report says they are shared
    calibrated = calibrate_cpu(seconds=0.01, size=32)
    assert calibrated.cores_per_host == len(os.sched_getaffinity(0))
    over = calibrated.with_(devices_per_host=2 * calibrated.cores_per_host)
    assert "ranks per host on" in format_estimates([shared], over)


def test_remote_calls_are_counted_from_the_trace_and_cost_the_clusters_call_overhead() -> None:
    layers, hidden, seq = 4, 16, 8
    prof = profile_model(
        FACTORY, seq_len=seq, factory_kwargs={"layers": layers, "hidden": hidden, "seq": seq}
    )
    stages = split_stages(prof, 2)
    assert split_stages(prof, 1)[0].remote_calls == 0
    # the root (stage 0) calls each block and the head once: every one on stage 1 is a remote call
    on_stage1 = [b for b in ("blocks.0", "blocks.1", "blocks.2", "blocks.3", "head") if b in _stage1(prof)]
    assert stages[0].remote_calls == 0 and stages[1].remote_calls == len(on_stage1) > 0
    assert stages[0].param_tensors + stages[1].param_tensors == 2 * layers + 2
    m, overhead = 4, 1e6  # seconds: far above the FLOPs at 1 FLOP/s, so stage 1 is the critical stage
    free = estimate(
        Layout(pp=2, tp=1, rdp=1, microbatches=m),
        stages,
        free_cluster(),
        global_batch=m,
        seq_len=seq,
        hidden=hidden,
    )
    paid = estimate(
        Layout(pp=2, tp=1, rdp=1, microbatches=m),
        stages,
        free_cluster(call_overhead=overhead),
        global_batch=m,
        seq_len=seq,
        hidden=hidden,
    )
    assert free.time.calls == 0.0
    extra = m * stages[1].remote_calls * overhead
    assert paid.time.calls == pytest.approx(extra)
    assert paid.step_time == pytest.approx(paid.time.total)
    assert paid.step_time > free.step_time + extra * (m - 1) / m
    with pytest.raises(PlanError, match="call_overhead=-1"):
        free_cluster(call_overhead=-1.0)


def _stage1(prof: ModelProfile) -> set[str]:
    """The module paths mp's auto-partition puts on stage 1 of 2."""
    from mp_partition import auto_partition

    plan = auto_partition(prof.model, 2, example_args=prof.example_args, trace=prof.trace)
    return {p for p, d in plan.assignment.items() if d == 1}


def test_a_batch_that_does_not_split_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match="global batch 10 does not split into 4 replicas x 1"):
        estimate(
            Layout(pp=1, tp=1, rdp=4, microbatches=1),
            (_stage(0, 1),),
            free_cluster(),
            global_batch=10,
            seq_len=1,
            hidden=1,
        )
    with pytest.raises(PlanError, match="cluster 'tpu' is unknown"):
        get_cluster("tpu")


def test_plan_ranks_fitting_layouts_and_their_configs_pass_mps_validation() -> None:
    result = mp.plan(
        FACTORY, global_batch=8, seq_len=8, cluster="cpu", devices_per_host=4, factory_kwargs={"hidden": 16}
    )
    fitting = result.fitting
    assert fitting and all(e.fits for e in fitting)
    times = [e.step_time for e in fitting]
    assert times == sorted(times)
    seen = set()
    for est in result.estimates:
        cfg = checked_config(est)  # raises if mp's config validation refuses it
        seen.add((cfg["pipeline_parallel_degree"], cfg["tensor_parallel_degree"]))
        parsed = load_config(cfg)
        validate_world(parsed, est.layout.world, est.layout.world)
    assert {(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)} <= seen
    assert "mp-plan" in result.report() and result.config() == checked_config(result.best)


def test_a_layout_that_cannot_fit_says_so() -> None:
    small = get_cluster("cpu").with_(device_memory_bytes=1000, devices_per_host=2)
    result = mp.plan(FACTORY, global_batch=2, seq_len=8, cluster=small)
    assert not result.fitting
    with pytest.raises(PlanError, match=r"no layout of .* fits"):
        _ = result.best


def test_the_command_prints_the_table_and_a_config_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.json"
    code = plan_main(
        [
            FACTORY,
            "--global-batch",
            "8",
            "--seq-len",
            "8",
            "--cluster",
            "cpu",
            "--devices-per-host",
            "2",
            "--no-calibrate",
            "--config-out",
            str(cfg),
            "--json",
            str(tmp_path / "all.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "samples/s" in out and "mp config of the top layout" in out
    assert load_config(json.loads(cfg.read_text())) is not None
    assert json.loads((tmp_path / "all.json").read_text())[0]["fits"] is True
    code = plan_main(
        ["gpt2", "--global-batch", "8", "--seq-len", "8", "--cluster", "cpu", "--no-calibrate", "--pp", "3"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "pp=3 does not divide the cluster's 2 devices" in err


def test_timeline_picture_of_the_top_layout(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = mp.plan(FACTORY, global_batch=8, seq_len=8, cluster="cpu", devices_per_host=2, pp=2)
    path = render_timeline(result.best, tmp_path / "t.png")
    assert path is not None and path.stat().st_size > 1000


TRAIN = """
import json, sys, torch
import mp as smp
from tests.mp.plan_models import blocks
smp.init()
torch.manual_seed(0)
net, _ = blocks(layers=4, hidden=16, seq=8)
model = smp.DistributedModel(net)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

@smp.step
def train_step(model, x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss

batch = int(sys.argv[1]) // smp.rdp_size()
for step in range(2):
    optimizer.zero_grad()
    loss = train_step(model, torch.randn(batch, 8, 16)).reduce_mean()
    optimizer.step()
if smp.rank() == 0:
    print("trained", json.dumps(smp.state.cfg.microbatches), loss.item())
smp.shutdown()
"""


@pytest.mark.parametrize("pins", [[], ["--pp", "2"]], ids=["free", "pp2"])
def test_the_printed_config_runs_unchanged_under_mp_launch(tmp_path: Path, pins: list[str]) -> None:
    cfg = tmp_path / "plan.json"
    code = plan_main(
        [
            FACTORY,
            "--global-batch",
            "8",
            "--seq-len",
            "8",
            "--cluster",
            "cpu",
            "--devices-per-host",
            "2",
            "--no-calibrate",
            "--config-out",
            str(cfg),
            *pins,
        ]
    )
    assert code == 0
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "mp.launch", "-n", "2", "--config", str(cfg), str(script), "8"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trained" in proc.stdout, proc.stdout + proc.stderr
    if pins:
        assert json.loads(cfg.read_text())["pipeline_parallel_degree"] == 2


def test_memory_bound_ops_are_counted_and_costed_in_closed_form() -> None:
    layers, hidden, seq = 3, 16, 8
    prof = profile_model(
        FACTORY, seq_len=seq, factory_kwargs={"layers": layers, "hidden": hidden, "seq": seq}
    )
    # each block's ReLU reads and writes seq x hidden fp32 values; the Linears are matrix products
    assert {p: t for p, t in prof.traffic.items() if t} == {
        f"blocks.{i}": 2 * seq * hidden * 4 for i in range(layers)
    }
    (stage,) = split_stages(prof, 1)
    assert stage.traffic == layers * 2 * seq * hidden * 4
    bw = 1000.0
    for ckpt, precision in ((False, "fp32"), (True, "fp32"), (False, "bf16")):
        layout = Layout(pp=1, tp=2, rdp=1, microbatches=1, checkpointing=ckpt, precision=precision)
        common = {"global_batch": 4, "seq_len": seq, "hidden": hidden}
        base = estimate(layout, (stage,), free_cluster(), **common)
        with_mem = estimate(layout, (stage,), free_cluster(elementwise_bandwidth=bw), **common)
        passes = 4 if ckpt else 3  # forward, backward twice it, the recompute
        scale = 0.5 if precision == "bf16" else 1.0
        want = passes * 4 * stage.traffic * scale / 2 / bw  # 4 samples, over tp=2
        assert with_mem.time.memory_bound == pytest.approx(want)
        assert with_mem.time.compute == pytest.approx(base.time.compute)
        assert with_mem.step_time - base.step_time == pytest.approx(want)
