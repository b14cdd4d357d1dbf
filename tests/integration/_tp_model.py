"""The tensor-parallel GPT-2 runs shared by tests/integration/test_tp_model.py and other TP tests: the
model config, data, optimizer, the single-process reference and the rank-side training function.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

import mp as smp

transformers = pytest.importorskip("transformers")

STEPS, PER_RANK, SEQ, VOCAB = 3, 4, 16, 64


def _config(layers: int = 2) -> Any:
    return transformers.GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )


def _data(dp_size: int, steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (steps, dp_size * PER_RANK, SEQ), generator=g)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


CLIP = 0.5
"""max_norm of the clipping cases: below the gradient norms of these steps, so clipping applies."""


def _reference(
    dp_size: int, clip: bool = False, layers: int = 2, device: str = "cpu", steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config(layers)).to(device)
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for ids in _data(dp_size, steps).to(device):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}, norms


def gpt_step() -> Any:
    """The step function of these tests: the LM loss of a GPT-2 and its backward."""

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    return train_step


def global_loss(out: Any, dp: int) -> float:
    """Every rank's mean over its samples; the global loss is their mean over the DP group."""
    return float(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / dp)


def assert_losses(losses: list[float], reference: list[float], rank: int) -> None:
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(reference),
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"rank {rank} losses: {m}",
    )


def _train(  # noqa: PLR0917 - also called by test_gpu with its device
    world: Any,
    pp: int,
    microbatches: int,
    clip: bool = False,
    fast: bool = False,
    device: str = "cpu",
    steps: int = STEPS,
) -> dict[str, Any]:
    smp.init(
        {
            "tensor_parallel_degree": 2,
            "pipeline_parallel_degree": pp,
            "microbatches": microbatches,
            "ddp": True,
            "fast_mode": fast,
        }
    )
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = transformers.GPT2LMHeadModel(_config(4 if fast else 2)).to(device)
    before = os.environ.get("MP_PIPELINE_STATIC_STEPS")
    os.environ["MP_PIPELINE_STATIC_STEPS"] = "1"  # fast mode: the steps after the second replay
    try:
        model = smp.DistributedModel(model)
    finally:
        if before is None:
            del os.environ["MP_PIPELINE_STATIC_STEPS"]
        else:
            os.environ["MP_PIPELINE_STATIC_STEPS"] = before
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    train_step = gpt_step()
    dp, rank = smp.dp_size(), smp.dp_rank()
    losses, norms, shortcuts = [], [], 0
    with _RetryLog() as retries:
        for ids in _data(dp, steps).to(device):
            opt.zero_grad()
            out = train_step(model, ids[rank * PER_RANK : (rank + 1) * PER_RANK])
            if model._runtime is not None:
                shortcuts += model._runtime.last_stats["shortcuts"]
            if clip:  # the norm of the whole model's gradient: over the stages and the TP shards
                norms.append(float(opt.clip_master_grads(CLIP)))  # type: ignore[attr-defined]
            opt.step()
            losses.append(global_loss(out, dp))
    result: dict[str, Any] = {
        "losses": losses,
        "dp": dp,
        "norms": norms,
        "shortcuts": shortcuts,
        "retries": retries.messages,
    }
    if pp == 1:
        from mp_tensor import gather_state_dict

        result["state"] = {k: v.detach().cpu() for k, v in gather_state_dict(model.module).items()}
    result["devices"] = sorted({p.device.type for p in model.local_parameters()})
    return result


class _RetryLog(logging.Handler):
    """What mp logged of steps that failed under fast mode's plan and ran again (mp.model_retry), so a
    test that expects the plan to be followed can say why it was not."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self._logger = logging.getLogger("mp.model_retry")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _RetryLog:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
