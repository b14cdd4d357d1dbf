"""ATP: a small GPT whose transformer layers are split over a 2-D device mesh (adaptive tensor
parallelism, Cheng et al.; docs/atp.md).

    mp-launch -n 4 examples/atp_mesh.py                    # DeviceMesh(2, 2)
    mp-launch -n 4 examples/atp_mesh.py --mesh 4x1         # (4, 1): Megatron-LM's 1-D layout
    mp-launch -n 4 examples/atp_mesh.py --mesh auto        # let ATP measure this machine and choose
    mp-launch -n 4 examples/atp_mesh.py --check --plot atp.png

``smp.init`` builds the mesh from the config (``atp_mesh``): the tensor-parallel group of 4 ranks laid
out as ``d1 x d2``. With ``"auto"`` it times all-reduces on every mesh's row and column groups and picks
the mesh with the least predicted communication (the paper's equations 2-4; rank 0 logs the table).
Each ``ATPTransformerLayer`` holds 1/(d1*d2) of the attention heads and of its weights: column-first
linears (QKV, MLP up) and row-first ones (attention out, MLP down) alternate, so that a layer's input
and output stay ``[batch, seq, hidden/d2]`` pieces. The embeddings and the output head are small and
stay whole on every rank. All ranks read the same batch (one tensor-parallel group, no data
parallelism). ``--check`` trains the same model in one process on rank 0 and compares every step.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from _common import log_loss, plot_losses, progress, say, summary
from torch import nn

import mp as smp
from mp_tensor import atp

SPEC = (atp.Replicate(), atp.Shard(-1))  # activations between layers: [b, s, hidden/d2] on every rank


class GPT(nn.Module):
    """Embeddings, a stack of layers, a final LayerNorm and the output head."""

    def __init__(self, layers: nn.ModuleList, vocab: int, seq: int, hidden: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers, self.ln = layers, nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, mesh: atp.DeviceMesh | None = None) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        if mesh is not None:
            x = atp.distribute(x, SPEC, mesh)  # this rank's piece (no communication)
        for layer in self.layers:
            x = layer(x)
        if mesh is not None:
            x = atp.to_global(x, SPEC, mesh)  # all-gather the pieces; differentiable
        return self.head(self.ln(x))


def global_batch(step: int, size: int, vocab: int, seq: int) -> torch.Tensor:
    """Sequences that repeat one of 16 short motifs: the loss falls as the model learns to continue."""
    pool = torch.Generator().manual_seed(7)
    motifs = [torch.randint(0, vocab, (3 + k % 4,), generator=pool) for k in range(16)]
    g = torch.Generator().manual_seed(1000 + step)
    picks = torch.randint(0, 16, (size,), generator=g).tolist()
    return torch.stack([motifs[k].repeat(seq // len(motifs[k]) + 1)[:seq] for k in picks])


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="2x2", help='"d1xd2" with d1*d2 = the number of ranks, or "auto"')
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4, help="divisible by d1*d2")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chunks", type=int, default=1, help="overlap all-reduces with GEMMs (1, 2 or 4)")
    p.add_argument("--check", action="store_true", help="compare with plain PyTorch in one process")
    p.add_argument("--plot", help="write the loss curve to this PNG file")
    args = p.parse_args()

    # The whole world is one tensor-parallel group, laid out as a 2-D mesh.
    smp.init({"tensor_parallel_degree": launched_world_size(), "atp_mesh": args.mesh})
    mesh = smp.state.atp_mesh
    rank0 = smp.rank() == 0
    say(rank0, f"ATP: DeviceMesh{mesh.shape} over {smp.size()} ranks (atp_mesh={args.mesh!r})")

    # A single-device model first (the same on every rank), then each rank takes its pieces of it.
    torch.manual_seed(0)
    layers = [atp.TransformerLayer(args.hidden, args.heads) for _ in range(args.layers)]
    reference = GPT(nn.ModuleList(layers), args.vocab, args.seq, args.hidden)
    sharded = [atp.ATPTransformerLayer.from_reference(r, mesh=mesh, chunks=args.chunks) for r in layers]
    model = GPT(nn.ModuleList(sharded), args.vocab, args.seq, args.hidden)
    whole = {k: v for k, v in reference.state_dict().items() if not k.startswith("layers.")}
    model.load_state_dict(whole, strict=False)  # the embeddings, ln and head: whole copies
    held, total = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in reference.parameters())
    say(rank0, f"rank 0 holds {held:,} of the model's {total:,} parameters")

    # Every rank computes the same loss. The layers' gradients are their pieces' and the whole
    # modules' gradients are whole on every rank, so a plain optimizer keeps the ranks consistent.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses: list[float] = []
    bar = progress(args.steps, rank0)
    for step in range(args.steps):
        ids = global_batch(step, args.batch, args.vocab, args.seq)
        loss = lm_loss(model(ids, mesh), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        bar.update()
        log_loss(rank0, step + 1, losses[-1])
    bar.close()
    summary(rank0, losses)

    ok, plain = True, None
    if args.check and rank0:
        plain = plain_pytorch(copy.deepcopy(reference), args)
        worst = max(abs(a - b) for a, b in zip(losses, plain, strict=True))
        ok = worst < 1e-4
        print(f"plain PyTorch, 1 process: max |loss difference| {worst:.2e} -> {'OK' if ok else 'FAILED'}")
    if rank0 and args.plot:
        curves = {f"ATP, DeviceMesh{mesh.shape}": losses}
        plot_losses(args.plot, curves, "GPT with ATP transformer layers", reference=plain)
    ok = smp.allgather(ok, smp.WORLD)[0]  # every rank exits with rank 0's verdict
    return 0 if ok else 1


def launched_world_size() -> int:
    """The number of ranks before smp.init (the config needs it), from the launcher's environment."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


def plain_pytorch(model: GPT, args: argparse.Namespace) -> list[float]:
    """The same training without mp, on the original layers."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        ids = global_batch(step, args.batch, args.vocab, args.seq)
        loss = lm_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    sys.exit(main())
