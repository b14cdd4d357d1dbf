"""One training script for every launcher of the multi-host tests, started with no edit.

    _train.py OUT [--save DIR] [--resume DIR] [--forever [--save-every N]]

The config comes from MP_CONFIG (as `mp-launch --config` passes it). Trains a small MLP for a few steps,
each data-parallel replica on its own batch, and checks on every rank that its losses and parameters equal
plain single-process PyTorch trained on the whole batch. Writes one JSON record per rank to OUT: where the
rank ran (host, local rank, groups) and what it checked. Exits non-zero on a mismatch. `--save` writes a
partial checkpoint after the steps; `--resume` loads one first and trains the steps after it (compared
with plain PyTorch trained through both); `--forever` trains until it is stopped, printing each step
(and with `--save-every N`, saving a partial checkpoint into `--save` every N steps).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mp as smp

STEPS, BATCH = 3, 16


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x[:, :4].argmax(dim=1)


def save(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    smp.save_checkpoint(
        folder,
        tag=f"step{step}",
        partial=True,
        model=model,
        optimizer=optimizer,
        user_content={"next_step": step},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--forever", action="store_true")
    parser.add_argument("--save-every", type=int, default=0)
    args = parser.parse_args()
    out = args.out
    smp.init()
    model = smp.DistributedModel(build())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)  # type: ignore[operator]
        return loss

    first = 0
    if args.resume:
        first = int(smp.resume_from_checkpoint(args.resume)["next_step"])
    losses = []
    step = first
    while step < first + STEPS or args.forever:
        x, y = batch(step, smp.dp_rank())
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()
        losses.append(smp.allgather(float(loss), smp.DP_GROUP))
        if args.forever and smp.rank() == 0:
            print(f"step {step}", flush=True)
            time.sleep(0.05)
        step += 1
        if args.forever and args.save and args.save_every and step % args.save_every == 0:
            save(args.save, model, optimizer, step)
    if args.save and not args.forever:
        save(args.save, model, optimizer, step)

    # Plain PyTorch: the mean loss over every replica's batch (what data parallelism averages).
    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(first + STEPS):
        data = [batch(step, r) for r in range(smp.dp_size())]
        ref_opt.zero_grad()
        per = [F.cross_entropy(ref(x), y) for x, y in data]
        torch.stack(per).mean().backward()
        ref_opt.step()
        ref_losses.append([v.item() for v in per])
    ref_losses = ref_losses[first:]
    mine = {n.removeprefix("module."): p for n, p in model.local_named_parameters()}
    expected = dict(ref.named_parameters())
    gaps = [float((p.detach() - expected[n].detach()).abs().max()) for n, p in mine.items()]
    worst = max(gaps, default=0.0)
    pairs = zip(losses, ref_losses, strict=True)
    loss_gap = max(abs(a - b) for got, want in pairs for a, b in zip(got, want, strict=True))
    record = {
        "rank": smp.rank(),
        "size": smp.size(),
        "host": socket.gethostname(),
        "local_rank": smp.local_rank(),
        "local_size": smp.local_size(),
        "pp_rank": smp.pp_rank(),
        "dp_rank": smp.dp_rank(),
        "tp_rank": smp.tp_rank(),
        "pp_group": smp.get_pp_group(),
        "dp_group": smp.get_dp_group(),
        "params": sorted(mine),
        "param_gap": worst,
        "loss_gap": loss_gap,
        "first_step": first,
        "launcher": smp.state.world.info.launcher.value,
        "address": smp.state.world.network.address,
    }
    with open(f"{out}/rank{smp.rank()}.json", "w") as f:
        json.dump(record, f)
    print(f"rank {record['rank']} done on {record['host']}", flush=True)
    smp.barrier()
    smp.shutdown()
    if worst > 1e-5 or loss_gap > 1e-5:
        rank = record["rank"]
        sys.exit(f"rank {rank}: differs from plain PyTorch (params {worst:.3g}, losses {loss_gap:.3g})")


if __name__ == "__main__":
    main()
