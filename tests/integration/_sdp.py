"""The sharded-data-parallel tests' shared pieces (tests/integration/test_memory_sdp.py): the model, the
batches, the single-process references (fp32 and the fp16/bf16 recipe), one setup for every combination
of tensor parallelism, delayed initialization and precision, and the functions the ranks run.

Every rank-side function takes the world first (tests/_harness.py) and returns plain data that the test
asserts on; none asserts by itself except on internal invariants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import mp as smp
from mp.errors import SMPValidationError
from mp_memory.sharded import state_bytes
from tests.integration._half_recipe import DTYPES, HalfRecipe
from tests.mp_pipeline.models import Block, first_difference

STEPS = 4  # fp32 runs
HALF_STEPS = 5  # fp16 / bf16 runs
MICROBATCHES = 2
BATCH = 8  # per data-parallel replica
LR = 1e-2
THRESHOLD = (
    100  # sdp_param_persistence_threshold: the biases (32 elements) stay whole, the weights are sharded
)
SCALING = {"init_scale": 2.0**12, "scale_window": 2}
# fp16 / bf16 tolerances: the masters (rtol, atol), and the half parameters (one more rounding)
TOL = {"fp16": (1e-3, 1e-4), "bf16": (1e-2, 1e-3)}
HALF_TOL = {"fp16": (3e-3, 1e-4), "bf16": (2e-2, 1e-3)}
LOSS_TOL = {"fp16": 1e-3, "bf16": 1e-2}
OVERFLOW_PARAM = "blocks.1.inner.weight"  # sharded
CLIP = 1.0
HSDP_RANKS = 8
HSDP_CLIP = 0.5  # below the gradient norms (0.6-0.8): every step is clipped
# the clipped AdamW steps (eps 1e-8) move a few near-zero-gradient elements by up to 2.3e-6 with this
# world's reduction order (8 ranks); a norm summed over both replicas moved them by 2.8e-4
HSDP_ATOL = 1e-5
BLOCK = 2 * (32 * 32 + 32)  # one Block of the Stack model
ROOT = 10 * 32 + 32 + 32 * 4 + 4  # inp and out
# under tp=2, this TP rank's shards: the root's inp and out, every block's biases (kept whole), one
# block's weights
TP_ROOT = 32 * 5 + 32 + 16 * 4 + 4
TP_BIASES = 4 * 2 * 32
TP_BLOCK_WEIGHTS = 2 * 32 * 16


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


class Smooth(Stack):
    """Stack with tanh for the input layer's relu, for tensor parallelism in half precision: a
    pre-activation near 0 that the TP layer's half-precision sums round to the other side of the kink
    would change a gradient row by that sample's whole contribution (seen: 20% of inp.weight's gradient
    at one step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)  # type: ignore[no-any-return]


def build(seed: int = 0, net: type[Stack] = Stack) -> Stack:
    torch.manual_seed(seed)
    return net()


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 4, generator=g)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def half_adamw(params: Any) -> torch.optim.Optimizer:
    # eps 1e-4 bounds Adam's sensitivity to a near-zero gradient (its first step is lr * g / (|g| + eps)):
    # with torch's 1e-8 a gradient element one half-ulp apart can move its parameter by a whole lr
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.01)


def config(sdp: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "sharded_data_parallel_degree": sdp,
        "microbatches": MICROBATCHES,
        "sdp_param_persistence_threshold": THRESHOLD,
        **extra,
    }


def half_config(precision: str, clip: float, **extra: Any) -> dict[str, Any]:
    return config(2, sdp_gradient_clipping=clip, **{precision: True}, **extra)


def make(net: type[Stack] = Stack, *, seed: int = 0, tp: bool = False, delayed: bool = False) -> Stack:
    """The model under ``seed``: on meta when ``delayed``, inside smp.tensor_parallelism() when ``tp``
    (after smp.init)."""
    torch.manual_seed(seed)
    with contextlib.ExitStack() as contexts:
        if delayed:
            contexts.enter_context(smp.delay_param_initialization())
        if tp:
            contexts.enter_context(smp.tensor_parallelism())
        return net()


def wrap(
    module: nn.Module, optimizer: Callable[[Any], torch.optim.Optimizer] = adamw, fp16: bool = False
) -> tuple[Any, Any, Any]:
    """DistributedModel, its DistributedOptimizer (fp16: the dynamic scaler of SCALING) and an
    @smp.step training step."""
    model = smp.DistributedModel(module)
    kwargs: dict[str, Any] = {}
    if fp16:
        kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": SCALING}
    opt = smp.DistributedOptimizer(optimizer(model.parameters()), **kwargs)

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def setup(
    cfg: dict[str, Any],
    *,
    seed: int = 0,
    net: type[Stack] = Stack,
    tp: bool = False,
    delayed: bool = False,
    optimizer: Callable[[Any], torch.optim.Optimizer] = adamw,
) -> tuple[Any, Any, Any]:
    """smp.init(cfg), then make() and wrap()."""
    smp.init(cfg)
    return wrap(make(net, seed=seed, tp=tp, delayed=delayed), optimizer, fp16=bool(cfg.get("fp16")))


def run_steps(opt: Any, train_step: Any, steps: range) -> None:
    for step in steps:
        train_step(*batch(step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()


def reference(
    replicas: int, clip: float, steps: int = STEPS, initial: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """One process: each replica's microbatches, loss / (microbatches * replicas), clip, AdamW; from
    build()'s values or ``initial``."""
    model = build()
    if initial is not None:
        model.load_state_dict(initial)
    opt = adamw(model.parameters())
    losses: list[list[float]] = []
    grads: dict[str, torch.Tensor] = {}
    norms: list[float] = []
    for step in range(steps):
        per_replica = []
        for r in range(replicas):
            x, y = batch(step, r)
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


def half_reference(
    precision: str,
    replicas: int,
    clip: float,
    overflow_step: int | None,
    *,
    whole_names: frozenset[str] | None = None,
    start: Callable[[], nn.Module] = build,
) -> dict[str, Any]:
    """One process, the sharded run's mixed-precision recipe (_half_recipe.HalfRecipe: half parameters
    and fp32 masters, the same scaler); each microbatch's half gradient of a sharded parameter summed in
    fp32 (FSDP2's reduce dtype), a whole (small) parameter's summed in half over a replica's
    microbatches, then averaged over the replicas in fp32 and rounded to half
    (mp_memory.sharded.reduce_persistent_grads).
    ``whole_names``: the parameters kept whole (default: those below THRESHOLD elements); ``start``:
    the model (seeded)."""
    dtype = DTYPES[precision]
    model = start().to(dtype)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    if whole_names is not None:
        assert whole_names <= set(names), whole_names
    whole = [
        (n in whole_names) if whole_names is not None else p.numel() < THRESHOLD
        for n, p in zip(names, params, strict=True)
    ]
    recipe = HalfRecipe(params, precision, half_adamw, SCALING)
    losses = []
    for step in range(HALF_STEPS):
        scale = recipe.scale
        sums = [torch.zeros_like(m) for m in recipe.masters]
        per_replica = []
        for r in range(replicas):
            model.zero_grad()
            x, y = batch(step, r)
            total = 0.0
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                loss = F.mse_loss(model(xm.to(dtype)).float(), ym)
                (loss * (scale / MICROBATCHES)).backward()
                total += loss.item() / MICROBATCHES
                for i, p in enumerate(params):
                    if not whole[i]:
                        sums[i] += p.grad.float()  # type: ignore[union-attr]
                        p.grad = None
            for i, p in enumerate(params):
                if whole[i]:
                    sums[i] += p.grad.float()  # type: ignore[union-attr]
            per_replica.append(total)
        grads = [
            (s / replicas).to(dtype).float() if w else s / replicas for s, w in zip(sums, whole, strict=True)
        ]
        if step == overflow_step:
            grads[names.index(OVERFLOW_PARAM)].view(-1)[-1] = float("inf")
        recipe.step(grads, clip)
        losses.append(per_replica)
    return {
        "losses": losses,
        "scales": recipe.scales,
        "skipped": recipe.skipped,
        "norms": recipe.norms,
        "masters": dict(zip(names, [m.detach() for m in recipe.masters], strict=True)),
        "params": model.state_dict(),
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 + 1e-5 * abs(b)


def flat(states: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Optimizer states by parameter name, one entry per name/key, sorted (numbers as tensors)."""
    out = {
        f"{n}/{k}": torch.as_tensor(v)
        for n, st in states.items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor | int | float)
    }
    return dict(sorted(out.items()))


def keyed(ref: dict[str, Any]) -> dict[str, Any]:
    """The single-process optimizer's state keyed by parameter names (torch's own numbering replaced)."""
    group = adamw([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    return {
        "state": ref["opt"],
        "param_groups": [{**group, "params": list(ref["params"])}],
        "_smp_keyed_by_name": True,
    }


# ---- functions the ranks run -------------------------------------------------------------------


def train(world: Any, cfg: dict[str, Any], tp: bool = False, delayed: bool = False) -> dict[str, Any]:
    """fp32 training against reference(): every loss, the last step's gradients (without TP: with it
    the model holds TP shards under their own names), the parameters and the full optimizer state."""
    model, opt, train_step = setup(cfg, tp=tp, delayed=delayed)
    clip = float(cfg.get("sdp_gradient_clipping", 1.0))
    # prescaled_batch: the TP group's ranks share one batch, so the replicas are the RDP ranks
    prescaled = bool(cfg.get("prescaled_batch"))
    replica, replicas = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(train_step(*batch(step, replica)).reduce_mean().item())
        grads = {n: full(p.grad).clone() for n, p in model.module.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    ref = reference(replicas, clip)
    out = {
        "loss_ok": all(close(g, w[replica]) for g, w in zip(losses, ref["losses"], strict=True)),
        "params": first_difference(model.state_dict(), ref["params"]),
        "opt": first_difference(flat(opt.state_dict()["state"]), flat(ref["opt"])),
        "kinds": {n: type(p).__name__ for n, p in model.module.named_parameters()},
        "layer": type(model.module.blocks[0].inner).__name__,
    }
    if not tp:
        out["grads"] = first_difference(grads, ref["grads"])
    return out


def train_half(world: Any, precision: str, overflow_step: int | None, tp: bool = False) -> dict[str, Any]:
    """fp16 / bf16 training against half_reference(). overflow_step: that step's gradient gets an inf in
    one rank's shard only (rank 1, under TP rank 3); sdp_gradient_clipping is then off and the script
    clips by clip_master_grads instead (smp's two ways to clip). Under TP the model is Smooth and the
    whole (unsharded) parameters are read from the model."""
    clip = 0.0 if overflow_step is not None else CLIP
    net = Smooth if tp else Stack
    cfg = half_config(precision, clip, **({"tensor_parallel_degree": 2} if tp else {}))
    model, opt, train_step = setup(cfg, net=net, tp=tp, optimizer=half_adamw)
    layer = type(model.module.blocks[0].inner).__name__
    overflow_rank = 3 if tp else 1
    losses, scales, skipped, norms = [], [], [], []
    for step in range(HALF_STEPS):
        scales.append(opt.loss_scale)
        out = train_step(*batch(step, smp.dp_rank()))
        if step == overflow_step and smp.rank() == overflow_rank:
            grad = dict(model.module.named_parameters())[OVERFLOW_PARAM].grad
            assert isinstance(grad, DTensor)
            grad.to_local().view(-1)[-1] = float("inf")  # the last row: this rank's shard
        if overflow_step is not None:
            norm = float(opt.clip_master_grads(CLIP))
        opt.step()
        if overflow_step is not None and not opt.overflow:
            norms.append(norm)
        opt.zero_grad()
        losses.append(out.reduce_mean().item())
        skipped.append(opt.overflow)
    kinds = {n: (type(p).__name__, str(p.dtype)) for n, p in model.module.named_parameters()}
    if tp:
        whole: frozenset[str] | None = frozenset(n for n, (kind, _) in kinds.items() if kind != "DTensor")
        ref = half_reference(
            precision, smp.dp_size(), CLIP, overflow_step, whole_names=whole, start=lambda: build(0, Smooth)
        )
        sharding = model._sharded
        with sharding.gathered():  # the sharded parameters whole: fp32, their own masters
            gathered = sharding.gather_tp_state()
        masters = {n: v for n, v in gathered.items() if n not in (whole or ())}
    else:
        ref = half_reference(precision, smp.dp_size(), CLIP, overflow_step)
        names = {id(p): n for n, p in model.module.named_parameters()}
        masters = {names[id(p)]: full(m).detach() for p, m in opt.pairs()}
    rtol, atol = TOL[precision]
    hrtol, hatol = HALF_TOL[precision]
    params = model.state_dict()
    return {
        "layer": layer,
        "losses": [
            abs(g - w[smp.dp_rank()]) / abs(w[smp.dp_rank()])
            for g, w in zip(losses, ref["losses"], strict=True)
        ],
        "scales": (scales, ref["scales"]),
        "skipped": (skipped, ref["skipped"]),
        "norms": (norms, ref["norms"] if overflow_step is not None else []),
        "masters": first_difference(masters, {n: ref["masters"][n] for n in masters}, rtol=rtol, atol=atol),
        "master_dtypes": sorted({str(v.dtype) for v in masters.values()}),
        "worst": max(((m - ref["masters"][n]).abs().max().item(), n) for n, m in masters.items()),
        "params": first_difference(params, ref["params"], rtol=hrtol, atol=hatol),
        "dtypes": sorted({str(v.dtype) for v in params.values()}),
        "kinds": kinds,
    }


def round_trip(
    world: Any,
    path: str,
    partial: bool,
    *,
    tp: bool = False,
    precision: str | None = None,
    sharded_state: bool = True,
) -> dict[str, Any]:
    """Save after 2 steps, train 2 more; a fresh job with other weights resumes and trains the same 2.
    The model state is compared bitwise; in half precision also the fp32 masters and the scaler (under
    TP the optimizer's local state, its full state being refused)."""
    extra: dict[str, Any] = {"tensor_parallel_degree": 2} if tp else {}
    if precision is None:
        cfg, net, optimizer = config(2, **extra), Stack, adamw
    else:
        cfg, net, optimizer = half_config(precision, CLIP, **extra), (Smooth if tp else Stack), half_adamw

    def job(seed: int) -> tuple[Any, Any, Any]:
        return setup(cfg, seed=seed, net=net, tp=tp, optimizer=optimizer)

    def opt_state(opt: Any) -> dict[str, Any]:
        return opt.local_state_dict() if tp else opt.state_dict()  # type: ignore[no-any-return]

    model, opt, train_step = job(0)
    run_steps(opt, train_step, range(2))
    smp.save_checkpoint(path, "s2", partial=partial, model=model, optimizer=opt, user_content={"step": 2})
    run_steps(opt, train_step, range(2, STEPS))
    straight, straight_opt = model.state_dict(), opt_state(opt) if precision else {}
    refused = ""
    if tp and precision:
        try:
            opt.state_dict()
        except smp.SMPUnsupportedError as exc:
            refused = str(exc)
    smp.reset()
    model, opt, train_step = job(7)  # other weights: the checkpoint must replace them
    user = smp.resume_from_checkpoint(path, "s2", partial=partial, load_sharded_optimizer_state=sharded_state)
    run_steps(opt, train_step, range(2, STEPS))
    out: dict[str, Any] = {
        "user": user,
        "params": first_difference(model.state_dict(), straight, rtol=0, atol=0),
        "refused": refused,
    }
    if precision:
        resumed_opt = opt_state(opt)
        out["masters"] = first_difference(
            resumed_opt["fp32_master_params"], straight_opt["fp32_master_params"], rtol=0, atol=0
        )
        out["scaler"] = resumed_opt["loss_scaler"] == straight_opt["loss_scaler"]
    return out


def clipped(world: Any, clip: float) -> dict[str, Any]:
    model, opt, train_step = setup(config(2, sdp_gradient_clipping=clip))
    train_step(*batch(0, smp.dp_rank()))
    params = list(model.parameters())
    before = torch.linalg.vector_norm(torch.stack([full(p.grad).norm() for p in params]))
    norms: list[float] = []

    def spy(*_: Any) -> None:  # the gradient norm the optimizer is handed
        norms.append(float(torch.linalg.vector_norm(torch.stack([full(p.grad).norm() for p in params]))))

    opt.register_step_pre_hook(spy)
    opt.step()
    ref = reference(2, clip, steps=1)
    return {
        "before": float(before),
        "after": norms[0],
        "params": first_difference(model.state_dict(), ref["params"]),
    }


def state_bytes_by_sdp(world: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sdp in (1, 2):
        cfg = config(sdp, sdp_param_persistence_threshold=0) if sdp > 1 else {"microbatches": MICROBATCHES}
        model, opt, train_step = setup(cfg)
        train_step(*batch(0, smp.dp_rank()))
        opt.step()
        out[str(sdp)] = sum(state_bytes(model.module, opt).values())
        smp.reset()
    return out


def prefetch(world: Any, budget: int) -> dict[str, Any]:
    try:
        model, opt, train_step = setup(config(2, sdp_max_live_parameters=budget))
    except SMPValidationError as exc:
        return {"error": str(exc)}
    train_step(*batch(0, smp.dp_rank()))
    opt.step()
    ref = reference(2, 1.0, steps=1)
    return {
        "depth": model._sharded.prefetch_depth,
        "params": first_difference(model.state_dict(), ref["params"]),
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def endurance(world: Any) -> dict[str, Any]:
    _, opt, train_step = setup(config(2))
    tensors: dict[int, int] = {}
    rss: dict[int, float] = {}
    x, y = batch(0, smp.dp_rank())
    for i in range(1, 201):
        train_step(x, y)
        opt.step()
        opt.zero_grad()
        if 20 <= i < 30 or i > 190:
            tensors[i] = _live_tensors()
        if i in (100, 200):
            rss[i] = _rss_mb()
    return {"tensors": tensors, "rss": rss}


def spanning(world: Any) -> str:
    """Two nodes of one rank each (a fake layout): every shard group of 2 spans both nodes."""
    from mp.state import state

    smp.init({"sharded_data_parallel_degree": 2})
    real = state.world
    assert real is not None
    original = real.info
    fake = dataclasses.replace(original, num_nodes=2, local_size=1, local_rank=0, node=smp.rank())
    object.__setattr__(real, "info", fake)
    try:
        smp.DistributedModel(build())
    except SMPValidationError as exc:
        return str(exc)
    finally:
        object.__setattr__(real, "info", original)
    return "not refused"


def accumulated(world: Any) -> dict[str, Any]:
    """backward_passes_per_step=2 (smp's way to accumulate under sharding): two step calls, one
    optimizer step; sharded gradients accumulate in FSDP2, whole ones are averaged every second call."""
    smp.init(config(2))
    model = smp.DistributedModel(build(), backward_passes_per_step=2)
    opt = smp.DistributedOptimizer(adamw(model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for step in range(STEPS):
        train_step(*batch(step, smp.dp_rank()))
        if step % 2 == 1:
            opt.step()
            opt.zero_grad()
    ref = build()
    ref_opt = adamw(ref.parameters())
    for step in range(STEPS):
        for r in range(smp.dp_size()):
            x, y = batch(step, r)
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
                (F.mse_loss(ref(xm), ym) / (MICROBATCHES * smp.dp_size())).backward()
        if step % 2 == 1:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
    return {"params": first_difference(model.state_dict(), ref.state_dict())}


def materialized(world: Any, how: str, precision: str | None) -> dict[str, Any]:
    """Built on meta (smp.delay_param_initialization() or smp.model_creation under the config key) at
    sdp=2: the values DistributedModel materializes against eager initialization, and its peak of whole
    parameters."""
    extra: dict[str, Any] = {"delayed_parameter_initialization": how == "model_creation"}
    if precision is not None:
        extra[precision] = True
    smp.init(config(2, sdp_param_persistence_threshold=0, **extra))
    torch.manual_seed(0)  # as build() before building eagerly
    with smp.model_creation() if how == "model_creation" else smp.delay_param_initialization():
        net = Stack()
    on_meta = all(p.is_meta for p in net.parameters())
    model = smp.DistributedModel(net)
    eager: nn.Module = build()
    if precision is not None:
        eager = eager.to(DTYPES[precision])
    return {
        "on_meta": on_meta,
        "kinds": sorted({type(p).__name__ for p in model.module.parameters()}),
        "meta_left": any(local(p).is_meta for p in model.module.parameters()),
        "peak": model._sharded.peak_unsharded,
        "init": first_difference(model.state_dict(), eager.state_dict(), rtol=0, atol=0),
    }


def delayed_tp(world: Any, precision: str | None) -> dict[str, Any]:
    """tp=2 x sdp=2 built on meta inside smp.tensor_parallelism(): the values are those of delayed init
    under TP without sharding (tp=2 x dp=2, read after a step that changes nothing: SGD, lr 0),
    bitwise; training then equals one process started from them (fp32: reference(); fp16: the
    half_reference() recipe on Smooth, with the half tolerances)."""
    extra: dict[str, Any] = {} if precision is None else {precision: True}
    net = Stack if precision is None else Smooth

    def job(sdp: int, optimizer: Any, **more: Any) -> tuple[Any, Any, Any, bool]:
        cfg = config(sdp, tensor_parallel_degree=2, **extra, **more)
        smp.init(cfg)
        # every rank: a TP shard's draw is its full tensor's, sliced
        module = make(net, tp=True, delayed=True)
        on_meta = all(p.is_meta for p in module.parameters())
        return (*wrap(module, optimizer, fp16=precision == "fp16"), on_meta)

    model, opt, train_step, _ = job(1, lambda ps: torch.optim.SGD(ps, lr=0.0))
    train_step(*batch(0, smp.dp_rank()))
    opt.step()
    want = model.state_dict()
    smp.reset()

    if precision is None:
        model, opt, train_step, on_meta = job(2, adamw)
    else:
        model, opt, train_step, on_meta = job(2, half_adamw, sdp_gradient_clipping=CLIP)
    kinds = sorted({type(p).__name__ for p in model.module.parameters()})
    meta_left = any(p.is_meta for p in model.module.parameters())
    peak = model._sharded.peak_unsharded
    initial = model.state_dict()
    losses = []
    for step in range(STEPS if precision is None else HALF_STEPS):
        losses.append(train_step(*batch(step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    if precision is None:
        ref = reference(smp.dp_size(), 1.0, initial=initial)
        rtol, atol = 1e-5, 1e-6
    else:
        whole = frozenset(n for n, p in model.module.named_parameters() if type(p).__name__ != "DTensor")

        def start() -> Smooth:
            module = Smooth()
            module.load_state_dict({k: v.float() for k, v in initial.items()})
            return module

        ref = half_reference(precision, smp.dp_size(), CLIP, None, whole_names=whole, start=start)
        rtol, atol = HALF_TOL[precision]
    return {
        "on_meta": on_meta,
        "meta_left": meta_left,
        "kinds": kinds,
        "peak": peak,
        "dtypes": sorted({str(v.dtype) for v in initial.values()}),
        "init": first_difference(initial, want, rtol=0, atol=0),
        "moved": float(sum((initial[k] - v).abs().sum() for k, v in reference(1, 0.0, 0)["params"].items())),
        "loss_ok": all(close(g, w[smp.dp_rank()]) for g, w in zip(losses, ref["losses"], strict=True)),
        "losses": max(
            abs(g - w[smp.dp_rank()]) / abs(w[smp.dp_rank()])
            for g, w in zip(losses, ref["losses"], strict=True)
        ),
        "params": first_difference(model.state_dict(), ref["params"], rtol=rtol, atol=atol),
    }


def gpt2(world: Any, tp: bool = False, delayed: bool = False) -> dict[str, Any]:
    """A Hugging Face GPT-2 at sdp=2 without clipping (tp: made whole-stack tensor-parallel at tp=2, its
    GPT2DistributedLMHead; delayed: built on meta), against one process trained on every replica's
    batches from the values the run started with. Also: its blocks, the tied embedding, and join /
    comm hooks refused."""
    from tests.mp_pipeline.models import batch as gpt2_batch
    from tests.mp_pipeline.models import build as gpt2_build
    from tests.mp_pipeline.models import loss_of, make_optimizer

    smp.init(
        {
            "sharded_data_parallel_degree": 2,
            "microbatches": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_gradient_clipping": 0.0,
            **({"tensor_parallel_degree": 2} if tp else {}),
        }
    )
    torch.manual_seed(0)
    with contextlib.ExitStack() as contexts:
        if delayed:
            contexts.enter_context(smp.delay_param_initialization())
        if tp:
            contexts.enter_context(smp.tensor_parallelism())
        net = gpt2_build("gpt2")
    model = smp.DistributedModel(net)
    initial = model.state_dict() if delayed else None  # eager: the reference builds the same values
    opt = smp.DistributedOptimizer(make_optimizer("gpt2", model.parameters()))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of("gpt2", model, (ids,))
        model.backward(loss)
        return loss

    losses = []
    for step in range(3):
        losses.append(train_step(*gpt2_batch("gpt2", step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    replicas = smp.dp_size()
    ref = gpt2_build("gpt2")
    if initial is not None:
        ref.load_state_dict(initial)
    ref_opt = make_optimizer("gpt2", ref.parameters())
    want_losses = []
    for step in range(3):
        per_replica = []
        for r in range(replicas):
            total = 0.0
            for part in gpt2_batch("gpt2", step, r)[0].chunk(2):
                loss = loss_of("gpt2", ref, (part,))
                (loss / (2 * replicas)).backward()
                total += loss.item()
            per_replica.append(total / 2)
        want_losses.append(per_replica)
        ref_opt.step()
        ref_opt.zero_grad()
    out: dict[str, Any] = {
        "model": type(model.module).__name__,
        "blocks": len(model._sharded.blocks),
        "loss_ok": all(close(g, w[smp.dp_rank()]) for g, w in zip(losses, want_losses, strict=True)),
        # the distributed head gives its translated entries in its own order (as without sharding)
        "params": first_difference(
            dict(sorted(model.state_dict().items())), dict(sorted(ref.state_dict().items()))
        ),
    }
    if not tp:  # the Hugging Face modules themselves: the tied embedding, join and comm hooks refused
        refused = []
        for call in (model.join, lambda: model.register_comm_hook(None, lambda s, b: b)):
            try:
                call()
            except smp.SMPUnsupportedError as exc:
                refused.append("sharded_data_parallel_degree" in str(exc))
        wte = model.module.transformer.wte.weight
        out["tied"] = wte is model.module.lm_head.weight and isinstance(wte, DTensor)
        out["refused"] = refused
        out["wte_std"] = full(wte).std().item()
    return out


def tp_full_states(world: Any, path: str) -> dict[str, Any]:
    """tp=2 x sdp=2: optimizer.state_dict() gathers and translates to the original names; a full
    checkpoint resumes bitwise; the single-process run's own states (another layout) load and train on."""
    saved_at = 2
    replicas = 4  # the world: TP across DP, every rank trains on its own batch
    cfg = config(2, tensor_parallel_degree=2)
    early, late = reference(replicas, 1.0, saved_at), reference(replicas, 1.0, STEPS)
    out: dict[str, Any] = {}
    model, opt, train_step = setup(cfg, tp=True)
    run_steps(opt, train_step, range(saved_at))
    state = opt.state_dict()
    out["keys"] = sorted(state["state"]) == sorted(early["opt"])
    out["opt_early"] = first_difference(flat(state["state"]), flat(early["opt"]))
    smp.save_checkpoint(path, "full", partial=False, model=model, optimizer=opt)
    run_steps(opt, train_step, range(saved_at, STEPS))
    straight, straight_opt = model.state_dict(), flat(opt.state_dict()["state"])
    out["opt_late"] = first_difference(straight_opt, flat(late["opt"]))
    smp.reset()

    model, opt, train_step = setup(cfg, seed=7, tp=True)  # other weights: the checkpoint must replace them
    smp.resume_from_checkpoint(path, "full", partial=False)
    run_steps(opt, train_step, range(saved_at, STEPS))
    out["resumed"] = first_difference(model.state_dict(), straight, rtol=0, atol=0)
    out["resumed_opt"] = first_difference(flat(opt.state_dict()["state"]), straight_opt, rtol=0, atol=0)
    smp.reset()

    model, opt, train_step = setup(cfg, seed=7, tp=True)  # the one-process run's states: another layout
    model.load_state_dict(early["params"])
    opt.load_state_dict(keyed(early))
    run_steps(opt, train_step, range(saved_at, STEPS))
    out["from_one_process"] = first_difference(model.state_dict(), late["params"])
    out["from_one_process_opt"] = first_difference(flat(opt.state_dict()["state"]), flat(late["opt"]))
    return out


def hsdp(world: Any, path: str) -> dict[str, Any]:
    """tp=2 x 2 replicas x sdp=2 on 8 ranks (run by plain mpiexec: world is None):
    training clipped at HSDP_CLIP against reference(); a partial checkpoint saved at step 2 resumes
    bitwise."""
    cfg = config(2, tensor_parallel_degree=2, sdp_gradient_clipping=HSDP_CLIP)
    model, opt, train_step = setup(cfg, tp=True)
    losses = []
    for step in range(STEPS):
        if step == 2:
            smp.save_checkpoint(path, "s2", partial=True, model=model, optimizer=opt)
        losses.append(train_step(*batch(step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    ref = reference(HSDP_RANKS, HSDP_CLIP)
    out: dict[str, Any] = {
        "mesh": tuple(model._sharded.mesh.shape),
        "norms": ref["norms"],
        "loss_ok": all(close(g, w[smp.dp_rank()]) for g, w in zip(losses, ref["losses"], strict=True)),
        "params": first_difference(model.state_dict(), ref["params"], atol=HSDP_ATOL),
        "opt": first_difference(flat(opt.state_dict()["state"]), flat(ref["opt"])),
    }
    straight = model.state_dict()
    smp.reset()
    model, opt, train_step = setup(cfg, seed=7, tp=True)  # other weights: the checkpoint must replace them
    smp.resume_from_checkpoint(path, "s2", partial=True)
    run_steps(opt, train_step, range(2, STEPS))
    out["resumed"] = first_difference(model.state_dict(), straight, rtol=0, atol=0)
    return out


def write_result(name: str, args: tuple[Any, ...], folder: str) -> None:
    """Run by a plain mpiexec job: this module's function ``name`` called as fn(None, *args) on this
    rank, its result pickled to folder/result<rank>.pkl."""
    result = globals()[name](None, *args)
    with open(os.path.join(folder, f"result{smp.rank()}.pkl"), "wb") as f:
        pickle.dump(result, f)
