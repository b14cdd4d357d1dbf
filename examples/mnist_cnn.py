"""MNIST-style CNN, pipelined over 2 stages with data parallelism (smp's first example, on mp).

    mp-launch -n 2 examples/mnist_cnn.py                   # pp=2
    mp-launch -n 4 examples/mnist_cnn.py --epochs 2        # pp=2 x dp=2 (ddp)
    mp-launch -n 2 examples/mnist_cnn.py --plot loss.png

The network is the one of smp's MNIST example: two convolutions (``net1``) and two linear layers
(``net2``). mp splits it over 2 pipeline ranks by itself ("partitions": 2), runs 4 microbatches per
batch with the "interleaved" schedule, and with 4 ranks keeps 2 data-parallel replicas, each reading its
half of the data. The data is synthetic (28x28 images, 10 classes, each class a noisy template), so the
script runs offline; swap ``synthetic_mnist`` for ``torchvision.datasets.MNIST`` to train on MNIST.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import log_loss, plot_losses, progress, summary
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mp as smp


class Net1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return torch.flatten(x, 1)


class Net2(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(9216, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class GroupedNet(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net1 = Net1()
        self.net2 = Net2(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))


def synthetic_mnist(n: int, seed: int) -> TensorDataset:
    """n images of 10 classes: a fixed random black-and-white template per class plus noise."""
    templates = (torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234)) > 0.5).float()
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = templates[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=gen)
    return TensorDataset((images - 0.5) / 0.5, labels)


# The step function runs once per microbatch; mp pipelines the microbatches over the stages.
@smp.step
def train_step(model: smp.DistributedModel, data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)  # not loss.backward(): the backward pass crosses ranks
    return loss


@smp.step
def test_step(model: smp.DistributedModel, data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output = model(data)
    return (output.argmax(dim=1) == target).sum()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per data-parallel replica")
    parser.add_argument("--samples", type=int, default=1024, help="training images")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--hidden", type=int, default=128, help="width of fc1")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--plot", help="write the loss curve to this PNG file")
    args = parser.parse_args()

    # smp's MNIST config. Anything here can come from `mp-launch --config` instead (then smp.init()).
    smp.init(
        {
            "partitions": 2,
            "microbatches": args.microbatches,
            "pipeline": "interleaved",
            "optimize": "speed",
            "placement_strategy": "spread",
            "ddp": True,
        }
    )
    rank0 = smp.rank() == 0
    torch.manual_seed(1)  # the same initial weights on every rank (each stage keeps its own part)

    # Each data-parallel replica reads its own shard; drop_last keeps every batch divisible by the
    # number of microbatches.
    train = synthetic_mnist(args.samples, seed=0)
    sampler = DistributedSampler(train, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    test = DataLoader(synthetic_mnist(256, seed=1), batch_size=args.batch_size, drop_last=True)

    model = smp.DistributedModel(GroupedNet(args.hidden))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    if rank0:
        print(f"MNIST CNN: pp={smp.pp_size()} x dp={smp.dp_size()} on {smp.size()} ranks", flush=True)

    losses: list[float] = []
    steps = args.epochs * len(loader)
    steps = min(steps, args.max_steps) if args.max_steps else steps
    bar = progress(steps, rank0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data, target in loader:
            if len(losses) == steps:
                break
            # reduce_mean averages the loss of this replica's microbatches
            loss = train_step(model, data, target).reduce_mean()
            optimizer.step()
            optimizer.zero_grad()
            # the mean over the replicas: the loss of the global batch
            losses.append(sum(smp.allgather(loss.item(), smp.DP_GROUP)) / smp.dp_size())
            bar.update()
            log_loss(rank0, len(losses), losses[-1])
    bar.close()

    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test:
            correct += int(sum(c.item() for c in test_step(model, data, target).outputs))
    if rank0:
        print(f"test accuracy: {correct}/{len(test) * args.batch_size}", flush=True)
    summary(rank0, losses)
    if rank0 and args.plot:
        plot_losses(args.plot, {"train": losses}, f"MNIST CNN, pp=2 x dp={smp.dp_size()} (mp)")
    smp.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
