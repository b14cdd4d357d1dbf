"""DistributedEmbedding gathers an index tensor once when several tables look it up (NCF's user ids in
its MLP and GMF tables), and again whenever the tensor is another object or was modified in place;
outputs and gradients equal nn.Embedding's on the TP group's whole batch, tp=2 across DP ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_tensor import nn as tnn
from mp_tensor.context import TPContext
from tests.mp_tensor._tp_probe import count_collectives, tally
from tests.mp_tensor._tp_util import with_group

ROWS, DIM, B = 40, 8, 6


def _reuse(world: Any, sparse: bool) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        torch.manual_seed(0)
        plain = [nn.Embedding(ROWS, DIM, sparse=sparse) for _ in range(2)]
        tables = [tnn.DistributedEmbedding(ROWS, DIM, sparse=sparse, tp=ctx) for _ in range(2)]
        for t, p in zip(tables, plain, strict=True):
            t.load_full_state_dict(p.state_dict())
        ids = torch.randint(0, ROWS, (size * B,), generator=torch.Generator().manual_seed(5))
        mine = ids[rank * B : (rank + 1) * B].clone()
        gathers, diffs = {}, {}
        with count_collectives() as issued:
            outs = [t(mine) for t in tables]
        gathers["same tensor"] = tally(issued).get("all_gather", 0)
        with torch.no_grad():
            with count_collectives() as issued:
                # ``mine`` is still the last gathered tensor: only its copy is gathered
                again = [tables[0](mine), tables[1](mine.clone())]
            gathers["another object"] = tally(issued).get("all_gather", 0)
            with count_collectives() as issued:
                tables[0](mine)  # gathered again: the copy was the last one
                mine.add_(0)  # in place: a new version, whatever the values
                again.append(tables[1](mine))
            gathers["modified in place"] = tally(issued).get("all_gather", 0)
        # each rank's loss over its samples; their sum is the plain loss over the whole batch
        sum((o**2).sum() for o in outs).backward()  # type: ignore[union-attr]
        sum((p(ids) ** 2).sum() for p in plain).backward()  # type: ignore[union-attr]
        for k, (t, p) in enumerate(zip(tables, plain, strict=True)):
            want = p(ids)[rank * B : (rank + 1) * B].detach()
            diffs[f"out{k}"] = float((outs[k].detach() - want).abs().max())
            diffs[f"again{k}"] = float((again[k] - want).abs().max())
            assert t.weight.grad is not None and p.weight.grad is not None
            assert t.weight.grad.is_sparse == sparse
            want_grad = p.weight.grad.to_dense().chunk(size, dim=1)[rank]
            diffs[f"grad{k}"] = float((t.weight.grad.to_dense() - want_grad).abs().max())
        diffs["modified"] = float((again[2] - plain[1](ids)[rank * B : (rank + 1) * B]).abs().max())
        return {"gathers": gathers, "diffs": diffs}

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_one_gather_per_index_tensor(worlds: Any, sparse: bool) -> None:
    for res in worlds.run(2, _reuse, sparse, timeout=120):
        assert res["gathers"] == {"same tensor": 1, "another object": 1, "modified in place": 2}, res
        assert max(res["diffs"].values()) <= 1e-6, res["diffs"]
