"""Embeddings with ``sparse=True`` under data parallelism through the smp API, on 4 ranks: tp 2 x rdp 2
(each rank its own batch, and prescaled_batch) and tp 1 x dp 4. Their sparse gradients are summed over
the right group (the reduced data-parallel one for the distributed table, the data-parallel one for the
table left whole) and training equals plain PyTorch on the global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

ROWS, DIM, LOCAL_B, STEPS = 30, 8, 4, 3


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = nn.Embedding(ROWS, DIM, sparse=True)  # distributed when tp > 1
        self.whole = nn.Embedding(ROWS, DIM, sparse=True)  # never distributed
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.split(ids) * self.whole(ids)).squeeze(-1)  # type: ignore[no-any-return]


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, ROWS, (n,), generator=g), torch.randn(n, generator=g)


@smp.step
def _step(model: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(ids), y)
    model.backward(loss)
    return loss


def _train(world: Any, tp: int, prescaled: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {"tensor_parallel_degree": tp, "ddp": True}
    if prescaled:
        cfg.update(prescaled_batch=True, optimize="speed")
    smp.init(cfg)
    torch.manual_seed(0)
    plain = Model()
    torch.manual_seed(0)
    model = Model()
    if tp > 1:
        smp.set_tensor_parallelism(model.split)
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(dmodel.parameters(), lr=0.5))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    readers, me = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())
    diffs, sparse = [], []
    for step in range(STEPS):
        ids, y = _batch(step, readers * LOCAL_B)
        mine = slice(me * LOCAL_B, (me + 1) * LOCAL_B)
        loss = _step(dmodel, ids[mine], y[mine]).reduce_mean()
        sparse.append([bool(p.grad is not None and p.grad.is_sparse) for p in dmodel.parameters()])
        opt.step()
        opt.zero_grad()
        mean = sum(smp.allgather(float(loss), smp.DP_GROUP)) / smp.dp_size()
        want = F.mse_loss(plain(ids), y)
        want.backward()  # type: ignore[no-untyped-call]
        plain_opt.step()
        plain_opt.zero_grad()
        diffs.append(abs(mean - want.item()))
    return {"diffs": diffs, "sparse": sparse}


@pytest.mark.parametrize(
    ("tp", "prescaled"), [(2, False), (2, True), (1, False)], ids=["tp2-across-dp", "tp2-prescaled", "dp4"]
)
def test_sparse_embedding_gradients_train_like_plain_pytorch(worlds: Any, tp: int, prescaled: bool) -> None:
    for rank, res in enumerate(worlds.run(4, _train, tp, prescaled, timeout=180)):
        assert max(res["diffs"]) < 1e-5, (rank, res["diffs"])
        assert all(sum(flags) == 2 for flags in res["sparse"]), (rank, res["sparse"])  # both tables
