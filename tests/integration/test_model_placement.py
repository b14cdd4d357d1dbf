"""DistributedModel.placement on a real 2-rank pipeline: unpartitioned before the first step, replaced
(not changed) by the partitioned one after it; its owners agree with what each rank holds, and the
state gathered through it (mp.state_dicts.full_state_dict) equals plain PyTorch after the same steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import mp as smp
from mp.state_dicts import full_state_dict
from mp_partition import set_partition
from tests.integration._pp2_net import PP2, Net

STEPS = 2


@smp.step
def _train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _plain() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i in range(STEPS):
        x, y = _batch(i)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _run(world: Any) -> dict[str, Any]:
    smp.init(dict(PP2))
    try:
        torch.manual_seed(0)
        net = Net()
        set_partition(net.b, 1)
        set_partition(net.c, 1)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        before = model.placement
        out: dict[str, Any] = {
            "before": (before.partitioned, before.pp_size, before.pp_rank, dict(before.assignment)),
            "before_holds_all": all(before.holds(k) for k in net.state_dict()),
        }
        for i in range(STEPS):
            x, y = _batch(i)
            opt.zero_grad()
            _train_step(model, x, y)
            opt.step()
        after = model.placement
        out["replaced"] = after is not before and not before.partitioned
        out["after"] = (after.partitioned, after.pipelined, after.pp_rank)
        out["owners"] = {k: after.owner(k) for k in net.state_dict()}
        out["local_match"] = sorted(n for n, p in net.named_parameters() if after.is_local(p)) == sorted(
            n[len("module.") :] for n, _ in model.local_named_parameters()
        )
        out["local_params"] = [id(p) for p in after.local_parameters(net)] == [
            id(p) for p in model.local_parameters()
        ]
        after.enter("the placement test's collective")  # the model's entry: both ranks come
        gathered = full_state_dict(net, after, True)
        out["gathered"] = {k: v.clone() for k, v in gathered.items()}
        return out
    finally:
        smp.reset()


def test_the_placement_follows_the_partition_and_gathers_like_plain_pytorch(worlds: Any) -> None:
    results = worlds.run(2, _run, timeout=120)
    plain = _plain()
    for pp_rank, r in enumerate(results):
        assert r["before"] == (False, 2, pp_rank, {}), r["before"]
        assert r["before_holds_all"] and r["replaced"], r
        assert r["after"] == (True, True, pp_rank), r["after"]
        assert r["owners"] == {
            "a.weight": 0,
            "a.bias": 0,
            "b.weight": 1,
            "b.bias": 1,
            "c.weight": 1,
            "c.bias": 1,
        }, r["owners"]
        assert r["local_match"] and r["local_params"], r
        assert list(r["gathered"]) == list(plain), list(r["gathered"])
        for key, want in plain.items():
            assert torch.allclose(r["gathered"][key], want, rtol=0, atol=1e-6), key
    assert results[0]["owners"] == results[1]["owners"]  # both ranks hold the same placement
