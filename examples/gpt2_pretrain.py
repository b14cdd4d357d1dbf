"""GPT-2 pretraining with tensor and pipeline parallelism, activation checkpointing and checkpoints.

    mp-launch -n 4 examples/gpt2_pretrain.py --tp 2 --pp 2 --steps 20 --save-every 10 --ckpt /tmp/gpt2
    mp-launch -n 4 examples/gpt2_pretrain.py --tp 2 --pp 2 --steps 30 --ckpt /tmp/gpt2 --resume
    mp-launch -n 2 examples/gpt2_pretrain.py --tp 1 --pp 2 --plot loss.png

Written like the AWS GPT-2 script for smp v1.10+, with smp's own import line (mp serves it). A Hugging
Face ``GPT2LMHeadModel`` is built from a config (nothing is downloaded) inside ``smp.model_creation``,
which marks its blocks for tensor parallelism; ``smp.DistributedModel`` then replaces them by
distributed blocks (each tp_rank holds 1/tp of every block) and partitions the model over ``--pp``
stages on the first step. Every transformer block recomputes its activations in backward
(``smp.set_activation_checkpointing``). ``smp.save_checkpoint`` writes a partial checkpoint (each rank
its own part) every ``--save-every`` steps and ``smp.resume_from_checkpoint`` picks the run up again,
step counter (``user_content``) and optimizer state included. The data is synthetic: sequences that
repeat short motifs, so the loss falls as the model learns to continue them.

The world is tp x pp x dp ranks. Without ``prescaled_batch`` (smp's default) the tp_ranks are also
data-parallel replicas: each of the dp = world / pp replicas reads its own sequences.
"""

from __future__ import annotations

import argparse
import os
import sys

import smdistributed.modelparallel.torch as smp  # mp's alias of smp's import path
import torch
from _common import log_loss, plot_losses, progress, say, summary
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging


def global_batch(step: int, size: int, vocab: int, seq: int) -> torch.Tensor:
    """The step's ``size`` sequences (the same on every rank): 16 motifs repeated from random phases."""
    pool = torch.Generator().manual_seed(7)
    motifs = [torch.randint(0, vocab, (3 + k % 6,), generator=pool) for k in range(16)]
    g = torch.Generator().manual_seed(1000 + step)  # a function of the step: a resumed run sees the same
    rows = []
    for _ in range(size):
        motif = motifs[int(torch.randint(0, 16, (1,), generator=g))]
        phase = int(torch.randint(0, len(motif), (1,), generator=g))
        rows.append(motif.repeat(seq // len(motif) + 2)[phase : phase + seq])
    return torch.stack(rows)


@smp.step
def train_step(model: smp.DistributedModel, input_ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    model.backward(loss)
    return loss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_degree")
    p.add_argument("--pp", type=int, default=2, help="pipeline_parallel_degree")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="sequences per data-parallel replica and step")
    p.add_argument("--steps", type=int, default=20, help="train up to this step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt", help="checkpoint folder")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="resume from --ckpt (its newest, or --tag)")
    p.add_argument("--tag", help="the checkpoint tag to resume from (default: the newest)")
    p.add_argument("--plot", help="write the loss curve to this PNG file")
    args = p.parse_args()

    smp.init(
        {
            "tensor_parallel_degree": args.tp,
            "pipeline_parallel_degree": args.pp,
            "microbatches": args.microbatches,
            "ddp": True,
        }
    )
    rank0 = smp.rank() == 0
    hf_logging.set_verbosity_error()

    # Dropout off: each pipeline stage draws its own random numbers, and a resumed run is then exactly
    # the run that went on. Eager attention, so that tensor parallelism can map the blocks.
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)  # the same initial weights on every rank; each keeps its part
    with smp.model_creation(tensor_parallelism=args.tp > 1):
        model = GPT2LMHeadModel(config)
    model = smp.DistributedModel(model, trace_device="cpu")

    # Recompute each block's activations in backward instead of keeping them (before the first step).
    # With tp > 1, model_creation has swapped the whole GPT-2 for smp's distributed GPT-2 (as smp did),
    # whose blocks are transformer.seq_layers; otherwise they are Hugging Face's transformer.h.
    module = model.get_module()
    blocks = module.transformer.seq_layers if smp.tp_size() > 1 else module.transformer.h
    for block in blocks.children():
        smp.set_activation_checkpointing(block)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    start = 0
    if args.resume:
        user = smp.resume_from_checkpoint(args.ckpt, tag=args.tag)
        start = user["step"]
        if rank0:
            print(f"resumed from {args.ckpt} at step {start}", flush=True)
    if rank0:
        print(
            f"GPT-2 ({args.layers} layers, width {args.width}): tp={smp.tp_size()} x pp={smp.pp_size()} "
            f"x rdp={smp.rdp_size()} on {smp.size()} ranks, distributed modules: "
            f"{sum(1 for _ in model.distributed_modules())}",
            flush=True,
        )

    # Each data-parallel replica (tp_ranks included) takes its slice of the step's global batch.
    dp, first = smp.dp_size(), smp.dp_rank() * args.batch
    losses: list[float] = []
    bar = progress(args.steps - start, rank0)
    for step in range(start + 1, args.steps + 1):
        ids = global_batch(step, dp * args.batch, args.vocab, args.seq)[first : first + args.batch]
        loss = train_step(model, ids).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(smp.allgather(loss.item(), smp.DP_GROUP)) / dp)
        bar.update()
        log_loss(rank0, step, losses[-1])
        if args.save_every and step % args.save_every == 0:
            # collective: every rank writes its own part; user_content holds plain data
            smp.save_checkpoint(
                args.ckpt, tag=f"step_{step}", partial=True, model=model, optimizer=optimizer,
                user_content={"step": step},
            )  # fmt: skip
            say(rank0, f"checkpoint {os.path.join(args.ckpt, f'step_{step}_partial')} written")
    bar.close()
    summary(rank0, losses)
    if rank0 and args.plot:
        title = f"GPT-2, tp={smp.tp_size()} x pp={smp.pp_size()} (mp)"
        plot_losses(args.plot, {"train": losses}, title)
    smp.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
