"""The jobs behind the checkpoint fixtures in this folder: small models trained two steps, checkpointed,
then trained one step more (the expected result of a resume).

``generate.py`` ran each kind once with the mp of its day and kept the folders under ``v1/`` (a kind's
``expected.pt`` holds the full model state after step 3); tests/integration/test_checkpoint_fixtures.py
resumes them with today's mp and compares. Regenerating would defeat their purpose: they are what
older mp wrote.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

STEPS, SAVE_AT, BATCH, SEQ, VOCAB = 3, 2, 4, 8, 32

KINDS: dict[str, dict[str, Any]] = {
    # kind: the config, the model, whether the checkpoint is partial
    "partial_tp2": {
        "config": {"tensor_parallel_degree": 2, "ddp": True},
        "model": "gpt2_tp",
        "partial": True,
    },
    "full_tp2": {"config": {"tensor_parallel_degree": 2, "ddp": True}, "model": "gpt2_tp", "partial": False},
    "partial_pp2": {
        "config": {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True},
        "model": "gpt2",
        "partial": True,
    },
    "partial_sdp2": {
        "config": {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 20},
        "model": "mlp",
        "partial": True,
    },
    "partial_sdp2_bf16": {
        "config": {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 20, "bf16": True},
        "model": "mlp",
        "partial": True,
    },
    # ZeRO-1: one optimizer share per rdp_rank (optimizer_0_0_0.pt, optimizer_0_0_1.pt)
    "partial_zero2": {
        "config": {"shard_optimizer_state": True, "ddp": True},
        "model": "mlp",
        "partial": True,
    },
}
"""Every kind runs on 2 ranks."""

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDER = os.path.join(HERE, "v1")


def _gpt2() -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def build(
    kind: str, seed: int, config: dict[str, Any] | None = None, model: str | None = None
) -> tuple[Any, Any]:
    """smp.init, the DistributedModel and its DistributedOptimizer (Adam) of ``kind`` (or of another
    ``config`` and ``model``: "gpt2_tp" under smp.tensor_parallelism(), "gpt2" or "mlp" as built)."""
    spec = {**KINDS[kind], **({} if config is None else {"config": config})}
    if model is not None:
        spec["model"] = model
    smp.init(spec["config"])
    torch.manual_seed(seed)
    if spec["model"] == "gpt2_tp":
        with smp.tensor_parallelism():
            net = _gpt2()
    else:
        net = _gpt2() if spec["model"] == "gpt2" else _mlp()
    model = smp.DistributedModel(net)
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3))


@smp.step
def _lm_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


@smp.step
def _mlp_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def train(kind: str, model: Any, opt: Any, steps: range) -> list[float]:
    """This data-parallel rank's share of each step's global batch; the mean loss over the replicas."""
    dp, rank = smp.dp_size(), smp.dp_rank()
    per = BATCH // dp
    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(100 + i)
        opt.zero_grad()
        if KINDS[kind]["model"] == "mlp":
            x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
            out = _mlp_step(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        else:
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            out = _lm_step(model, ids[rank * per : (rank + 1) * per])
        opt.step()
        losses.append(float(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / dp))
    return losses


def full_state(model: Any) -> dict[str, torch.Tensor]:
    """The full model state in fp32 (collective)."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}
