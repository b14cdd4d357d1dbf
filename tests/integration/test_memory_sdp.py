"""sharded_data_parallel_degree on real worlds (FSDP2 underneath) against plain single-process PyTorch.

sdp=2 on 2 ranks and sdp=2 x dp=2 (HSDP) on 4 ranks: every step's loss, every gradient of the last
step, every parameter after 4 AdamW steps and the full optimizer state equal one process training on
all replicas' batches (the same microbatch averaging, the same clipping by the global norm) within
1e-5. sdp_gradient_clipping clips; per-rank parameter + gradient + optimizer bytes under sdp=2 are at
most 0.55x the unsharded ones; partial (sharded) and full checkpoints round-trip; memory stays flat
over 200 steps.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import mp as smp
from mp.errors import SMPValidationError
from mp_memory.sharded import state_bytes
from tests.mp_pipeline.models import Block, first_difference

STEPS = 4
MICROBATCHES = 2
BATCH = 8  # per data-parallel replica
LR = 1e-2


class Stack(nn.Module):
    """A model as FSDP2 users wrap it: blocks in a ModuleList, an input and an output layer at the root."""

    def __init__(self, d: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(10, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)  # type: ignore[no-any-return]


def _build(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def _batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 4, generator=g)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _reference(
    replicas: int, clip: float, steps: int = STEPS, initial: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """One process: each replica's microbatches, loss / (microbatches * replicas), clip, AdamW; from
    _build()'s values or ``initial``."""
    model = _build()
    if initial is not None:
        model.load_state_dict(initial)
    opt = _optimizer(model.parameters())
    losses: list[list[float]] = []
    grads: dict[str, torch.Tensor] = {}
    norms: list[float] = []
    for step in range(steps):
        per_replica = []
        for r in range(replicas):
            x, y = _batch(step, r)
            total = 0.0
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                loss = F.mse_loss(model(xm), ym)
                (loss / (MICROBATCHES * replicas)).backward()
                total += loss.item()
            per_replica.append(total / MICROBATCHES)
        losses.append(per_replica)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    names = dict(model.named_parameters())
    opt_state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in names.items()}
    return {"losses": losses, "grads": grads, "norms": norms, "params": model.state_dict(), "opt": opt_state}


def _config(sdp: int, **extra: Any) -> dict[str, Any]:
    # threshold 100: the biases (32 elements) stay whole on every rank, the weights are sharded
    return {
        "sharded_data_parallel_degree": sdp,
        "microbatches": MICROBATCHES,
        "sdp_param_persistence_threshold": 100,
        **extra,
    }


def _delayed_build(seed: int = 0) -> Stack:
    """_build on the meta device (smp.delay_param_initialization): materialized by DistributedModel."""
    torch.manual_seed(seed)
    with smp.delay_param_initialization():
        return Stack()


def _setup(config: dict[str, Any], seed: int = 0, delayed: bool = False) -> tuple[Any, Any, Any]:
    smp.init(config)
    model = smp.DistributedModel(_delayed_build(seed) if delayed else _build(seed))
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 + 1e-5 * abs(b)


def _train(world: Any, config: dict[str, Any], delayed: bool = False) -> dict[str, Any]:
    model, opt, train_step = _setup(config, delayed=delayed)
    clip = float(config.get("sdp_gradient_clipping", 1.0))
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(train_step(*_batch(step, smp.dp_rank())).reduce_mean().item())
        grads = {n: _full(p.grad).clone() for n, p in model.module.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    kinds = {n: type(p).__name__ for n, p in model.module.named_parameters()}
    params = model.state_dict()
    opt_full = opt.state_dict()
    ref = _reference(smp.dp_size(), clip)
    opt_diff = None
    for name, st in ref["opt"].items():
        got = opt_full["state"][name]
        opt_diff = opt_diff or first_difference(
            {k: torch.as_tensor(got[k]) for k in st}, {k: torch.as_tensor(v) for k, v in st.items()}
        )
    return {
        "loss_ok": all(_close(g, w[smp.dp_rank()]) for g, w in zip(losses, ref["losses"], strict=True)),
        "grads": first_difference(grads, ref["grads"]),
        "params": first_difference(params, ref["params"]),
        "opt": opt_diff,
        "kinds": kinds,
        "norms": ref["norms"],
    }


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_training_equals_one_process(worlds: Any, ranks: int) -> None:
    """sdp=2 (2 ranks: ZeRO-3) and sdp=2 x dp=2 (4 ranks: HSDP) train like one process."""
    for r in worlds.run(ranks, _train, _config(2), timeout=300):
        assert r["loss_ok"] and r["grads"] is None and r["params"] is None and r["opt"] is None, r
        assert r["kinds"]["blocks.0.inner.weight"] == "DTensor", r  # sharded
        assert r["kinds"]["blocks.0.inner.bias"] == "Parameter", r  # below the persistence threshold


def test_smp_default_threshold_keeps_a_small_model_whole(worlds: Any) -> None:
    """sdp_param_persistence_threshold's default (1e6) shards no parameter of this small model: every
    gradient is averaged over the data-parallel group instead, and training is still exact."""
    config = _config(2, sdp_param_persistence_threshold=1_000_000)
    for r in worlds.run(2, _train, config, timeout=300):
        assert r["loss_ok"] and r["grads"] is None and r["params"] is None and r["opt"] is None, r
        assert set(r["kinds"].values()) == {"Parameter"}, r


def _clipped(world: Any, clip: float) -> dict[str, Any]:
    model, opt, train_step = _setup(_config(2, sdp_gradient_clipping=clip))
    train_step(*_batch(0, smp.dp_rank()))
    params = list(model.parameters())
    before = torch.linalg.vector_norm(torch.stack([_full(p.grad).norm() for p in params]))
    norms: list[float] = []

    def spy(*_: Any) -> None:  # the gradient norm the optimizer is handed
        norms.append(float(torch.linalg.vector_norm(torch.stack([_full(p.grad).norm() for p in params]))))

    opt.register_step_pre_hook(spy)
    opt.step()
    ref = _reference(2, clip, steps=1)
    return {
        "before": float(before),
        "after": norms[0],
        "params": first_difference(model.state_dict(), ref["params"]),
    }


def test_sdp_gradient_clipping_clips_by_the_global_norm(worlds: Any) -> None:
    for r in worlds.run(2, _clipped, 0.01, timeout=300):
        assert r["before"] > 0.1, r  # the raw gradient is well above the threshold
        assert abs(r["after"] - 0.01) <= 1e-5, r  # clipped to it, over all shards together
        assert r["params"] is None, r  # the same step as clip_grad_norm_ in one process


def _bytes(world: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sdp in (1, 2):
        config = _config(sdp, sdp_param_persistence_threshold=0)
        model, opt, train_step = _setup(config if sdp > 1 else {"microbatches": MICROBATCHES})
        train_step(*_batch(0, smp.dp_rank()))
        opt.step()
        out[str(sdp)] = sum(state_bytes(model.module, opt).values())
        smp.reset()
    return out


def test_sharded_state_per_rank_is_at_most_055_of_unsharded(worlds: Any) -> None:
    for r in worlds.run(2, _bytes, timeout=300):
        assert r["2"] <= 0.55 * r["1"], r


def _prefetch(world: Any, budget: int) -> dict[str, Any]:
    try:
        model, opt, train_step = _setup(_config(2, sdp_max_live_parameters=budget))
    except SMPValidationError as exc:
        return {"error": str(exc)}
    train_step(*_batch(0, smp.dp_rank()))
    opt.step()
    ref = _reference(2, 1.0, steps=1)
    return {
        "depth": model._sharded.prefetch_depth,
        "params": first_difference(model.state_dict(), ref["params"]),
    }


def test_sdp_max_live_parameters_sets_the_prefetch_depth(worlds: Any) -> None:
    # root: inp (10*32+32) + out (32*4+4) = 484 parameters; a block: 2 * (32*32+32) = 2112
    root, block = 484, 2112
    for r in worlds.run(2, _prefetch, root + 3 * block, timeout=300):
        assert r == {"depth": 2, "params": None}, r
    for r in worlds.run(2, _prefetch, root + block, timeout=300):
        assert (
            "sdp_max_live_parameters=2596" in r["error"] and f"at least {root + 2 * block}" in r["error"]
        ), r


def _round_trip(world: Any, path: str, partial: bool, sharded_state: bool = True) -> dict[str, Any]:
    model, opt, train_step = _setup(_config(2))
    for step in range(2):
        train_step(*_batch(step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()
    smp.save_checkpoint(path, "s2", partial=partial, model=model, optimizer=opt, user_content={"step": 2})
    for step in range(2, STEPS):
        train_step(*_batch(step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()
    straight = model.state_dict()
    smp.reset()
    model, opt, train_step = _setup(_config(2), seed=7)  # other weights: the checkpoint must replace them
    user = smp.resume_from_checkpoint(path, "s2", partial=partial, load_sharded_optimizer_state=sharded_state)
    for step in range(2, STEPS):
        train_step(*_batch(step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()
    return {"user": user, "diff": first_difference(model.state_dict(), straight, rtol=0, atol=0)}


@pytest.mark.parametrize("partial", [True, False])
def test_checkpoint_round_trip(worlds: Any, tmp_path: Any, partial: bool) -> None:
    for r in worlds.run(2, _round_trip, str(tmp_path), partial, timeout=300):
        assert r["user"] == {"step": 2} and r["diff"] is None, r


def test_resume_without_the_sharded_optimizer_state(worlds: Any, tmp_path: Any) -> None:
    """load_sharded_optimizer_state=False: the weights load, AdamW's state starts afresh (so the run
    no longer follows the straight one)."""
    for r in worlds.run(2, _round_trip, str(tmp_path), True, False, timeout=300):
        assert r["user"] == {"step": 2} and r["diff"] is not None, r


def test_bucket_size_and_pipeline_parallelism_are_refused() -> None:
    for extra in ({"sdp_reduce_bucket_size": 1000}, {"pipeline_parallel_degree": 2}):
        with pytest.raises(ValueError) as info:
            smp.init({"sharded_data_parallel_degree": 2, **extra})
        assert next(iter(extra)) in str(info.value), info.value
        assert not smp.is_initialized()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _endurance(world: Any) -> dict[str, Any]:
    _, opt, train_step = _setup(_config(2))
    tensors: dict[int, int] = {}
    rss: dict[int, float] = {}
    x, y = _batch(0, smp.dp_rank())
    for i in range(1, 201):
        train_step(x, y)
        opt.step()
        opt.zero_grad()
        if 20 <= i < 30 or i > 190:
            tensors[i] = _live_tensors()
        if i in (100, 200):
            rss[i] = _rss_mb()
    return {"tensors": tensors, "rss": rss}


def test_memory_stays_flat_over_200_steps(worlds: Any) -> None:
    """As tests/integration/test_endurance.py: fewest live tensors over steps 20-29 vs 191-200, RSS at
    step 100 vs 200."""
    for r in worlds.run(2, _endurance, timeout=600):
        t0 = min(v for i, v in r["tensors"].items() if i < 30)
        t1 = min(v for i, v in r["tensors"].items() if i > 190)
        assert t1 - t0 <= 8, r["tensors"]
        assert r["rss"][200] - r["rss"][100] <= 16.0, r["rss"]


def test_blocks_are_hf_no_split_modules_else_module_list_children() -> None:
    from mp_memory.sharded import block_modules
    from tests.mp_pipeline.models import build

    gpt = build("gpt2", layers=3)
    assert block_modules(gpt) == list(gpt.transformer.h)  # type: ignore[union-attr]
    stack = _build()
    assert block_modules(stack) == list(stack.blocks)
    assert block_modules(nn.Sequential(nn.Linear(2, 2))) == []
    stack._no_split_modules = ["NotHere"]  # type: ignore[assignment]
    assert block_modules(stack) == list(stack.blocks)  # named classes absent: ModuleList children


def _gpt2(world: Any) -> dict[str, Any]:
    """A Hugging Face GPT-2 (blocks from _no_split_modules, tied embeddings) at sdp=2 without clipping,
    against tests.mp_pipeline.models.reference; join and comm hooks refused."""
    from tests.mp_pipeline.models import batch, build, loss_of, make_optimizer, reference

    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "microbatches": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_gradient_clipping": 0.0,
        }
    )
    model = smp.DistributedModel(build("gpt2"))
    opt = smp.DistributedOptimizer(make_optimizer("gpt2", model.parameters()))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of("gpt2", model, (ids,))
        model.backward(loss)
        return loss

    for step in range(3):
        train_step(*batch("gpt2", step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()
    _, want = reference("gpt2", microbatches=2, replicas=2)
    refused = []
    for call in (model.join, lambda: model.register_comm_hook(None, lambda s, b: b)):
        try:
            call()
        except smp.SMPUnsupportedError as exc:
            refused.append("sharded_data_parallel_degree" in str(exc))
    wte = model.module.transformer.wte.weight
    return {
        "params": first_difference(model.state_dict(), want),
        "tied": wte is model.module.lm_head.weight and isinstance(wte, DTensor),
        "refused": refused,
    }


def test_hf_gpt2_trains_like_one_process(worlds: Any) -> None:
    for r in worlds.run(2, _gpt2, timeout=300):
        assert r == {"params": None, "tied": True, "refused": [True, True]}, r


def _spanning(world: Any) -> str:
    """Two nodes of one rank each (a fake layout): every shard group of 2 spans both nodes."""
    import dataclasses

    from mp.state import state

    smp.init({"sharded_data_parallel_degree": 2})
    real = state.world
    assert real is not None
    original = real.info
    fake = dataclasses.replace(original, num_nodes=2, local_size=1, local_rank=0, node=smp.rank())
    object.__setattr__(real, "info", fake)
    try:
        smp.DistributedModel(_build())
    except SMPValidationError as exc:
        return str(exc)
    finally:
        object.__setattr__(real, "info", original)
    return "not refused"


def test_shard_groups_spanning_nodes_are_refused(worlds: Any) -> None:
    for text in worlds.run(2, _spanning, timeout=120):
        assert "'sdp_hierarchical_allgather'" in text and "a divisor of 1" in text, text


def _accumulated(world: Any) -> dict[str, Any]:
    """backward_passes_per_step=2 (smp's way to accumulate under sharding): two step calls, one
    optimizer step; sharded gradients accumulate in FSDP2, whole ones are averaged every second call."""
    smp.init(_config(2))
    model = smp.DistributedModel(_build(), backward_passes_per_step=2)
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for step in range(STEPS):
        train_step(*_batch(step, smp.dp_rank()))
        if step % 2 == 1:
            opt.step()
            opt.zero_grad()
    ref = _build()
    ref_opt = _optimizer(ref.parameters())
    for step in range(STEPS):
        for r in range(smp.dp_size()):
            x, y = _batch(step, r)
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                (F.mse_loss(ref(xm), ym) / (MICROBATCHES * smp.dp_size())).backward()
        if step % 2 == 1:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
    return {"params": first_difference(model.state_dict(), ref.state_dict())}


def test_backward_passes_per_step_accumulates(worlds: Any) -> None:
    for r in worlds.run(2, _accumulated, timeout=300):
        assert r["params"] is None, r
