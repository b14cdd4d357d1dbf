"""The fp16/bf16 recipe on a GPT-2 at pp=2 (tests/integration/test_memory_precision.py, also run on the GPU
by test_gpu): config, optimizer, the one-process reference, the rank-side training and its checks; and
HalfRecipe, the hand-written mixed-precision recipe that every one-process reference runs (here, in
_sdp.half_reference and in test_memory_precision's tensor-parallel case).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import mp as smp
from mp_memory.loss_scaler import DynamicLossScaler
from tests.mp_pipeline.models import batch, build

STEPS, MICROBATCHES = 6, 2
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CLIP = 1.0
SCALING = {"init_scale": 2.0**20, "scale_window": 2}  # 2**20 overflows the first steps' fp16 gradients


class HalfRecipe:
    """smp's mixed precision by hand, in one process: half parameters, fp32 masters that the optimizer
    steps, and under fp16 a dynamic loss scaler (``scaling``: DynamicLossScaler's arguments) whose scale
    the caller multiplies its loss by. ``scales``, ``skipped`` and ``norms`` record each step."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        precision: str,
        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        scaling: dict[str, Any],
    ) -> None:
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = optimizer(self.masters)
        self.scaler = DynamicLossScaler(**scaling) if precision == "fp16" else None
        self.scales: list[float] = []
        self.skipped: list[bool] = []
        self.norms: list[float] = []

    @property
    def scale(self) -> float:
        """The loss scale of the step under way (1 without a scaler)."""
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    def step(self, grads: list[torch.Tensor], clip: float | None) -> None:
        """One step from ``grads`` (each parameter's gradient in fp32, still multiplied by ``scale``):
        skipped under fp16 if one is not finite; else the masters take them unscaled, clipped to the
        whole norm ``clip`` (None: no clipping), the optimizer steps them and the half parameters copy
        them. Then the scaler learns whether the step overflowed."""
        scale = self.scale
        overflow = self.scaler is not None and any(not torch.isfinite(g).all() for g in grads)
        if not overflow:
            for m, g in zip(self.masters, grads, strict=True):
                m.grad = g / scale
            if clip is not None:
                self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.masters, clip)))
            self.optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)
        if self.scaler is not None:
            self.scaler.update(overflow)
        self.scales.append(scale)
        self.skipped.append(overflow)


def _config(precision: str, pp: int) -> dict[str, Any]:
    return {"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, precision: True}


def _optimizer(params: Any, sgd: bool) -> torch.optim.Optimizer:
    # SGD for the GPU check: AdamW turns rounding-level gradient differences (the key bias, whose true
    # gradient is 0) into steps of lr, so two equal recipes on CUDA's fp16 kernels part by ~lr
    return torch.optim.SGD(params, lr=0.1) if sgd else torch.optim.AdamW(params, lr=1e-3)


def _reference(
    precision: str, overflow_step: int | None, device: str = "cpu", sgd: bool = False
) -> dict[str, Any]:
    model = build("gpt2", layers=2).to(device, DTYPES[precision])
    params = list(model.parameters())
    recipe = HalfRecipe(params, precision, lambda masters: _optimizer(masters, sgd), SCALING)
    losses = []
    for step in range(STEPS):
        (ids,) = batch("gpt2", 0, 0)  # one batch, learnt: the loss must fall
        ids = ids.to(device)
        model.zero_grad()
        total = 0.0
        for part in ids.chunk(MICROBATCHES):
            loss = model(input_ids=part, labels=part).loss.float()
            (loss * (recipe.scale / MICROBATCHES)).backward()
            total += loss.item() / MICROBATCHES
        if step == overflow_step:
            params[-1].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        recipe.step([p.grad.float() for p in params], CLIP)  # type: ignore[union-attr]
        losses.append(total)
    names = [n for n, _ in model.named_parameters()]
    return {
        "losses": losses,
        "scales": recipe.scales,
        "skipped": recipe.skipped,
        "norms": recipe.norms,
        "masters": {n: m.detach().cpu() for n, m in zip(names, recipe.masters, strict=True)},
    }


def _train(  # noqa: PLR0917 - also called by test_gpu with its device and optimizer
    world: Any, precision: str, pp: int, overflow_step: int | None, device: str = "cpu", sgd: bool = False
) -> dict[str, Any]:
    """`device` "cuda": the model, batches and reference on the GPU (tests/integration/test_gpu.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    smp.init(_config(precision, pp))
    net = build("gpt2", layers=2).to(device)
    model = smp.DistributedModel(net)
    kwargs: dict[str, Any] = {}
    if precision == "fp16":
        kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": SCALING}
    opt = smp.DistributedOptimizer(_optimizer(model.parameters(), sgd), **kwargs)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    losses, scales, skipped, norms = [], [], [], []
    for step in range(STEPS):
        (ids,) = batch("gpt2", 0, 0)  # one batch, learnt: the loss must fall
        ids = ids.to(device)
        opt.zero_grad()
        scales.append(opt.loss_scale)
        out = train_step(ids)
        last = [p for p in model.local_parameters()][-1]
        if step == overflow_step and smp.pp_rank() == pp - 1:  # one rank only, as an fp16 overflow would
            last.grad.view(-1)[0] = float("inf")
        norm = opt.clip_master_grads(CLIP).item()  # before step(), as smp's docs say
        opt.step()
        if not opt.overflow:
            norms.append(norm)
        losses.append(out.reduce_mean().item())
        skipped.append(opt.overflow)
    dtypes = sorted({str(p.dtype) for p in model.local_parameters()})
    names = {id(p): n for n, p in model.module.named_parameters()}
    masters = {names[id(p)]: m.detach().cpu() for p, m in opt.pairs()}
    devices = sorted({p.device.type for p in model.local_parameters()})
    smp.reset()  # the reference runs alone on the device
    ref = _reference(precision, overflow_step, device, sgd)
    far = [
        ((m - ref["masters"][n]).abs().max().item(), n)
        for n, m in masters.items()
        if not torch.allclose(m, ref["masters"][n], rtol=1e-3, atol=1e-4)
    ]
    worst = max(far) if far else None
    return {
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "norms": norms,
        "dtypes": dtypes,
        "devices": devices,
        "master_dtypes": sorted({str(m.dtype) for m in masters.values()}),
        "worst": worst,
        "ref": {k: v for k, v in ref.items() if k != "masters"},
    }


def _check(r: dict[str, Any], precision: str) -> None:
    assert r["dtypes"] == [str(DTYPES[precision])] and r["master_dtypes"] == ["torch.float32"], r
    assert all(torch.isfinite(torch.tensor(r["losses"]))), r
    assert r["worst"] is None, r
    for got, want in zip(r["losses"], r["ref"]["losses"], strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), r
    assert r["scales"] == r["ref"]["scales"] and r["skipped"] == r["ref"]["skipped"], r
    # clip_master_grads: the whole model's norm of the unscaled fp32 gradients, as torch's on the masters
    assert len(r["norms"]) == len(r["ref"]["norms"]), r
    for got, want in zip(r["norms"], r["ref"]["norms"], strict=True):
        assert abs(got - want) <= 1e-4 * want, r
    assert max(r["norms"]) > CLIP, r  # clipping took effect
