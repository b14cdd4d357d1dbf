"""The CUDA paths, run where a GPU exists (skipped cleanly elsewhere; CI has none).

On a machine with one GPU every rank shares it: the world then uses gloo (NCCL refuses two ranks on
one GPU), the router sends CUDA tensors over UCX (CUDA IPC on the one device), and a pipelined model
on the GPU still trains exactly like single-process PyTorch on the same GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _world_on_gpu(world: Any) -> dict[str, Any]:
    x = torch.full((4,), float(world.rank + 1), device="cuda")
    dist.all_reduce(x)
    return {
        "backend": world.backend,
        "device": str(world.device),
        "current": torch.cuda.current_device(),
        "sum": x.cpu().tolist(),
    }


def test_world_ranks_sharing_one_gpu_use_gloo_for_cuda_tensors(worlds: Any) -> None:
    got = worlds.run(2, _world_on_gpu, timeout=120)
    gpus = torch.cuda.device_count()
    for info in got:
        assert info["device"].startswith("cuda")
        assert info["sum"] == [3.0] * 4
        assert info["backend"] == ("gloo" if gpus < 2 else "cpu:gloo,cuda:nccl")


def _router_cuda(world: Any) -> dict[str, Any]:
    from mp_comm import Route, Router
    from mp_comm.transport import ucx_available

    if not ucx_available():
        return {"skip": "ucxx is not installed"}
    router = Router.create(world)
    peer = 1 - world.rank
    big = torch.arange(4 << 20, device="cuda", dtype=torch.float32) + world.rank  # 16 MB: D2D
    nested = {"h": big, "ids": torch.arange(7, device="cuda"), "cpu": torch.ones(3), "n": None}
    routes = (router.route({"cuda"}, peer, 3, 16 << 20).value, router.route({"cuda"}, peer, 1, 4000).value)
    router.send(nested, peer, tag="d2d")
    router.send(torch.arange(1000, device="cuda"), peer, tag="small")
    got = router.recv(peer, "d2d").obj
    small = router.recv(peer, "small").obj
    ok = (
        got["h"].device.type == "cuda"
        and torch.equal(got["h"].cpu(), (torch.arange(4 << 20, dtype=torch.float32) + peer))
        and torch.equal(got["ids"].cpu(), torch.arange(7))
        and got["cpu"].device.type == "cpu"
        and got["n"] is None
        and small.device.type == "cuda"
        and torch.equal(small.cpu(), torch.arange(1000))
    )
    stats = dict(router.stats)
    router.close()
    return {"routes": routes, "ok": bool(ok), "stats": stats, "has_ucx": Route.UCX in router.transports}


def test_router_sends_cuda_tensors_over_ucx(worlds: Any) -> None:
    got = worlds.run(2, _router_cuda, timeout=180)
    if "skip" in got[0]:
        pytest.skip(got[0]["skip"])
    for info in got:
        assert info["has_ucx"] and info["routes"] == ("ucx", "mpi") and info["ok"], info
        assert info["stats"] == {"ucx": 1, "mpi": 1}, info


def _gpt2() -> torch.nn.Module:
    from tests.mp_pipeline.models import build

    return build("gpt2").cuda()  # the equivalence tests' GPT-2, on the GPU


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (8, 12), generator=g).cuda() for _ in range(steps)]


def _pipelined_gpt2_on_gpu(world: Any, microbatches: int, fast: bool) -> dict[str, Any]:
    import os

    import mp as smp

    torch.backends.cuda.matmul.allow_tf32 = False
    steps = 4
    os.environ["MP_PIPELINE_STATIC_STEPS"] = "2"  # fast mode: steps 3 and 4 replay the recording
    cfg = {"pipeline_parallel_degree": 2, "microbatches": microbatches, "pipeline": "interleaved"}
    smp.init({**cfg, "static_mode": fast, "fast_mode": fast})
    try:
        model = smp.DistributedModel(_gpt2())
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

        @smp.step
        def train_step(ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            return loss

        losses = []
        for ids in _batches(steps):
            losses.append(train_step(ids).reduce_mean().item())
            opt.step()
            opt.zero_grad()
        devices = {p.device.type for p in model.local_parameters()}
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    finally:
        smp.reset()
        del os.environ["MP_PIPELINE_STATIC_STEPS"]

    ref = _gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_losses = []
    for ids in _batches(steps):
        total = 0.0
        for part in ids.chunk(microbatches):
            loss = ref(input_ids=part, labels=part).loss
            (loss / microbatches).backward()
            total += loss.item()
        ref_losses.append(total / microbatches)
        ref_opt.step()
        ref_opt.zero_grad()
    worst = max(
        (state[k].float() - v.detach().cpu().float()).abs().max().item() for k, v in ref.state_dict().items()
    )
    return {
        "devices": sorted(devices),
        "loss_error": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_error": worst,
    }


@pytest.mark.parametrize(("microbatches", "fast"), [(1, False), (4, False), (4, True)])
def test_pipelined_gpt2_on_gpu_matches_single_process(worlds: Any, microbatches: int, fast: bool) -> None:
    for info in worlds.run(2, _pipelined_gpt2_on_gpu, microbatches, fast, timeout=120):
        assert info["devices"] == ["cuda"]
        # Same GPU, same kernels; CUDA's embedding backward sums with atomics, so allow its rounding.
        assert info["loss_error"] < 1e-5, info
        assert info["param_error"] < 1e-5, info


def _fp16_pipelined_gpt2(world: Any) -> dict[str, Any]:
    import mp as smp

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=torch.float16)

    torch.backends.cuda.matmul.allow_tf32 = False
    steps, m = 4, 2
    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "interleaved"})
    try:
        model = smp.DistributedModel(_gpt2())
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        scaler = smp.amp.GradScaler(2.0**10, growth_interval=2)

        @smp.step
        def train_step(ids: torch.Tensor) -> torch.Tensor:
            with autocast():  # the layers on pp_rank 1 run under it too
                loss = model(input_ids=ids, labels=ids).loss
            model.backward(scaler.scale(loss))
            return loss

        losses, scales = [], []
        for ids in _batches(steps):
            losses.append(train_step(ids).reduce_mean().item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    finally:
        smp.reset()

    ref = _gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    ref_losses, ref_scales = [], []
    for ids in _batches(steps):
        total = 0.0
        for part in ids.chunk(m):
            with autocast():
                loss = ref(input_ids=part, labels=part).loss
            ref_scaler.scale(loss / m).backward()
            total += loss.item() / m
        ref_losses.append(total)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        ref_scales.append(ref_scaler.get_scale())
    return {
        "scales": scales,
        "ref_scales": ref_scales,
        "loss_error": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_error": max((state[k] - v.cpu()).abs().max().item() for k, v in ref.state_dict().items()),
    }


def test_fp16_autocast_and_grad_scaler_on_gpu_match_torch(worlds: Any) -> None:
    # The usual GPU recipe: fp16 autocast in the step, smp.amp.GradScaler, against torch's in one
    # process on the same GPU and microbatches.
    for info in worlds.run(2, _fp16_pipelined_gpt2, timeout=120):
        assert info["scales"] == info["ref_scales"], info
        assert info["loss_error"] < 1e-4 and info["param_error"] < 1e-4, info


def _wide_mlp() -> torch.nn.Module:
    torch.manual_seed(3)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).cuda()


def _pipelined_wide_mlp_on_gpu(world: Any) -> dict[str, Any]:
    import mp as smp
    from mp.state import state

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(11)
    # 256 x 4096 float32 per microbatch: 4 MB activations and gradients, the router's D2D size.
    batches = [(torch.randn(512, 4096, generator=g).cuda(), torch.randn(512, 4096, generator=g).cuda())]
    batches *= 2
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "interleaved"})
    try:
        model = smp.DistributedModel(_wide_mlp())
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        @smp.step
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        losses = []
        for x, y in batches:
            losses.append(train_step(x, y).reduce_mean().item())
            opt.step()
            opt.zero_grad()
        stats = dict(state.transport.stats)  # type: ignore[union-attr]
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    finally:
        smp.reset()

    ref = _wide_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches:
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = torch.nn.functional.mse_loss(ref(xs), ys)
            (loss / 2).backward()
            total += loss.item() / 2
        ref_losses.append(total)
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "ucx_messages": stats.get("ucx", 0),
        "loss_error": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_error": max((params[k] - v.cpu()).abs().max().item() for k, v in ref.state_dict().items()),
    }


def test_pipeline_activations_of_4mb_go_gpu_to_gpu_and_train_exactly(worlds: Any) -> None:
    from mp_comm.transport import ucx_available

    if not ucx_available():
        pytest.skip("ucxx is not installed")
    for info in worlds.run(2, _pipelined_wide_mlp_on_gpu, timeout=180):
        # Each step sends 2 activations forward and 2 gradients back over the D2D path.
        assert info["ucx_messages"] >= 4, info
        assert info["loss_error"] < 1e-6 and info["param_error"] < 1e-6, info


def _recv_while_the_gpu_is_busy(world: Any) -> dict[str, Any]:
    import time

    from mp_comm.transport import MPITransport, TransportConfig

    t = MPITransport.from_world(world, config=TransportConfig(timeout=60.0))
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)  # 4 MB
    result: dict[str, Any] = {}
    world.mpi_comm.Barrier()
    if world.rank == 0:
        t.send(x, 1, tag="x").wait()
    else:
        torch.cuda._sleep(3_000_000_000)  # ~1.5-2 s of one kernel on the default stream: a stage's compute
        start = time.perf_counter()
        got = t.recv(0, "x").obj
        result["seconds"] = time.perf_counter() - start
        result["busy"] = not torch.cuda.current_stream().query()  # the kernel still runs
        result["equal"] = bool(torch.equal(got, x))
    t.close()
    return result


def test_a_staged_cuda_message_arrives_without_waiting_for_the_receivers_kernels(worlds: Any) -> None:
    # The MPI path's copy to the device runs on the landing stream, not behind the default stream's
    # kernels. (UCX's own CUDA copies do wait for them: docs/gpu.md, Limits.)
    info = worlds.run(2, _recv_while_the_gpu_is_busy, timeout=120)[1]
    assert info["equal"] and info["busy"] and info["seconds"] < 0.5, info


def test_trace_times_modules_with_cuda_events() -> None:
    from mp_partition import trace_model

    model = _gpt2()
    ids = torch.randint(0, 64, (2, 12), device="cuda")
    trace = trace_model(model, (ids,), measure_time=True)
    assert trace.device == "cuda" and trace.measured_time
    blocks = [s for p, s in trace.modules.items() if p.startswith("transformer.h.") and p.count(".") == 2]
    assert len(blocks) == 2 and all((s.forward_time_s or 0.0) > 0.0 for s in blocks), blocks


def _collectives_on_cuda(world: Any) -> dict[str, bool]:
    from mp_comm import collectives as C

    group = dist.group.WORLD
    n, r = world.size, world.rank
    full = torch.arange(4 * n * 6, dtype=torch.float32).reshape(4 * n, 6)  # the same on every rank
    mine = (full + r).cuda().requires_grad_()
    results: dict[str, bool] = {}

    out = C.all_reduce(mine, group)
    out.sum().backward()
    want = sum(full + k for k in range(n))
    results["all_reduce"] = bool(torch.equal(out.detach().cpu(), want)) and out.device.type == "cuda"
    mine.grad = None

    out = C.all_gather(mine, 0, group)
    (out * 2).sum().backward()
    want = torch.cat([full + k for k in range(n)], 0)
    results["all_gather"] = bool(torch.equal(out.detach().cpu(), want)) and bool(
        torch.equal(mine.grad.cpu(), torch.full_like(full, 2.0))
    )
    mine.grad = None

    out = C.reduce_scatter(mine, 0, group)
    out.sum().backward()
    want = sum(full + k for k in range(n)).chunk(n, 0)[r]
    results["reduce_scatter"] = bool(torch.equal(out.detach().cpu(), want)) and bool(
        torch.equal(mine.grad.cpu(), torch.ones_like(full))
    )
    mine.grad = None

    out = C.all_to_all(mine, 0, 1, group)
    out.sum().backward()
    want = torch.cat([(full + k).chunk(n, 0)[r] for k in range(n)], 1)
    results["all_to_all"] = bool(torch.equal(out.detach().cpu(), want)) and bool(
        torch.equal(mine.grad.cpu(), torch.ones_like(full))
    )
    return results


def test_tensor_parallel_collectives_on_cuda_tensors(worlds: Any) -> None:
    for got in worlds.run(2, _collectives_on_cuda, timeout=120):
        assert all(got.values()), got


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_smp_half_precision_on_gpu_trains_like_one_process_with_the_same_recipe(
    worlds: Any, precision: str
) -> None:
    # smp's fp16/bf16 keys (half parameters, fp32 masters, dynamic loss scale, a forced overflow on one
    # rank in step 4 for fp16) with CUDA's half kernels, against the recipe by hand on the same GPU
    # (with SGD: see test_memory_precision._optimizer).
    from tests.integration._half_recipe import _check, _train

    overflow = 4 if precision == "fp16" else None
    for r in worlds.run(2, _train, precision, 2, overflow, "cuda", True, timeout=240):
        assert r["devices"] == ["cuda"], r
        _check(r, precision)
        assert r["losses"][-1] < r["losses"][0], r
        if precision == "fp16":
            assert r["skipped"][4] and r["scales"][5] == r["scales"][4] / 2, r


def test_tensor_parallel_gpt2_on_gpu_trains_like_single_process(worlds: Any) -> None:
    # tp=2 (each rank its own samples, 2 microbatches) with CUDA kernels, against HF's GPT-2 on the GPU.
    from tests.integration._tp_model import _reference, _train, assert_losses

    torch.backends.cuda.matmul.allow_tf32 = False
    results = worlds.run(2, _train, 1, 2, False, False, "cuda", timeout=240)
    ref_losses, ref_state, _ = _reference(results[0]["dp"], device="cuda")
    for r, res in enumerate(results):
        assert res["devices"] == ["cuda"], res["devices"]
        assert_losses(res["losses"], ref_losses, r)
        assert set(res["state"]) == set(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(
                res["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
