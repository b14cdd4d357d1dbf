"""NCF (neural collaborative filtering) with its embedding tables split by tensor parallelism across
data-parallel ranks.

    mp-launch -n 2 examples/ncf_tp.py                      # tp=2: each rank its own batch
    mp-launch -n 2 examples/ncf_tp.py --prescaled          # tp=2: both ranks share one batch
    mp-launch -n 4 examples/ncf_tp.py --tp 2 --plot ncf.png   # tp=2 x rdp=2

Recommendation models are mostly embedding tables: here four (users and items, for the MLP and for
the matrix-factorization branch). Marked with ``smp.set_tensor_parallelism``, each becomes a
``smp.nn.DistributedEmbedding`` holding 1/tp of every embedding vector; the small MLP stays replicated.
In smp's default mode the tp_ranks are also data-parallel ranks: each reads its own batch, and the
distributed tables look up the ids of the whole TP group's batch at once, so tp=2 costs no extra data
(seed 001 §5.2, docs/tensor.md). With ``--prescaled`` (smp's ``prescaled_batch``) the TP group shares
one batch instead, each rdp replica reading its own.

``--check`` trains the same model in one process on rank 0 (same seed, the same global batches) and
exits non-zero if any step's loss differs by 1e-5 or more. The data is synthetic: a user likes an item
when their hidden taste vectors agree.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import log_loss, plot_losses, progress, say, summary
from torch import nn

import mp as smp


class NCF(nn.Module):
    """NeuMF (He et al., 2017): a GMF branch (the product of two embeddings) beside an MLP branch."""

    def __init__(self, users: int, items: int, dim: int) -> None:
        super().__init__()
        self.user_mlp, self.item_mlp = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.user_gmf, self.item_gmf = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.out = nn.Linear(32 + dim, 1)

    def tables(self) -> list[nn.Embedding]:
        return [self.user_mlp, self.item_mlp, self.user_gmf, self.item_gmf]

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp(torch.cat((self.user_mlp(users), self.item_mlp(items)), -1))
        gmf = self.user_gmf(users) * self.item_gmf(items)
        return self.out(torch.cat((mlp, gmf), -1)).squeeze(-1)


def global_batch(step: int, size: int, users: int, items: int) -> tuple[torch.Tensor, ...]:
    """The step's ``size`` (user, item, liked) triples, the same on every rank."""
    taste = torch.Generator().manual_seed(99)
    u_vec, i_vec = torch.randn(users, 3, generator=taste), torch.randn(items, 3, generator=taste)
    g = torch.Generator().manual_seed(1000 + step)
    u, i = torch.randint(0, users, (size,), generator=g), torch.randint(0, items, (size,), generator=g)
    # how much a user likes things in general, how liked an item is, and a little personal taste
    score = u_vec[u, 0] + i_vec[i, 0] + 0.5 * (u_vec[u, 1:] * i_vec[i, 1:]).sum(-1)
    return u, i, (score > 0).float()


@smp.step
def train_step(model: smp.DistributedModel, users: torch.Tensor, items: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    loss = F.binary_cross_entropy_with_logits(model(users, items), y)
    model.backward(loss)
    return loss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_degree")
    p.add_argument("--prescaled", action="store_true", help="prescaled_batch: the TP group shares a batch")
    p.add_argument("--users", type=int, default=500)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--dim", type=int, default=32, help="embedding size (divisible by --tp)")
    p.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--check", action="store_true", help="compare with plain PyTorch in one process")
    p.add_argument("--plot", help="write the loss curve to this PNG file")
    args = p.parse_args()

    cfg = {"tensor_parallel_degree": args.tp, "ddp": True}
    if args.prescaled:
        cfg.update(prescaled_batch=True, optimize="speed")  # smp allows prescaled_batch with "speed" only
    smp.init(cfg)
    rank0 = smp.rank() == 0

    torch.manual_seed(0)
    model = NCF(args.users, args.items, args.dim)
    for table in model.tables():
        smp.set_tensor_parallelism(table)  # the tables only; the MLP stays data-parallel
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))

    # Who reads what: without prescaled_batch every rank of a data-parallel group (tp_ranks included)
    # has its own slice; with it, the tp_ranks of one rdp replica read the same slice.
    readers, me = (smp.rdp_size(), smp.rdp_rank()) if args.prescaled else (smp.dp_size(), smp.dp_rank())
    tables = sum(1 for _ in model.distributed_modules())
    say(
        rank0,
        f"NCF: tp={smp.tp_size()}, {smp.size()} ranks, {readers} batches of {args.batch} per step "
        f"(prescaled_batch={args.prescaled}); distributed tables: {tables}",
    )
    losses: list[float] = []
    bar = progress(args.steps, rank0)
    for step in range(args.steps):
        u, i, y = global_batch(step, readers * args.batch, args.users, args.items)
        mine = slice(me * args.batch, (me + 1) * args.batch)
        loss = train_step(model, u[mine], i[mine], y[mine]).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        # each reader's mean over its slice; their mean is the loss of the global batch
        losses.append(sum(smp.allgather(loss.item(), smp.DP_GROUP)) / smp.dp_size())
        bar.update()
        log_loss(rank0, step + 1, losses[-1])
    bar.close()
    summary(rank0, losses)

    ok, plain = True, None
    if args.check and rank0:
        plain = plain_pytorch(args, readers * args.batch)
        worst = max(abs(a - b) for a, b in zip(losses, plain, strict=True))
        ok = worst < 1e-5
        print(f"plain PyTorch, 1 process: max |loss difference| {worst:.2e} -> {'OK' if ok else 'FAILED'}")
    if rank0 and args.plot:
        title = "NCF, embeddings split over tensor-parallel ranks"
        plot_losses(args.plot, {f"mp, tp={smp.tp_size()}": losses}, title, reference=plain)
    ok = smp.allgather(ok, smp.WORLD)[0]  # every rank exits with rank 0's verdict
    return 0 if ok else 1


def plain_pytorch(args: argparse.Namespace, size: int) -> list[float]:
    """The same training without mp: one model, the whole global batch each step."""
    torch.manual_seed(0)
    model = NCF(args.users, args.items, args.dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        u, i, y = global_batch(step, size, args.users, args.items)
        loss = F.binary_cross_entropy_with_logits(model(u, i), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    sys.exit(main())
