"""HF GPT-2 at tp=2 x pp=2 across hosts (the config from MP_CONFIG): built under
`smp.tensor_parallelism()`, trained 3 steps, and compared on every rank with plain HF GPT-2 (losses, and
the full state dict a user saves). Writes rank{N}.json to argv[1]; exits non-zero on a mismatch."""

from __future__ import annotations

import json
import socket
import sys

import torch
import transformers

import mp as smp

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64


def config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip


def data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def main() -> None:
    smp.init()
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = smp.DistributedModel(transformers.GPT2LMHeadModel(config()))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def train_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)  # type: ignore[operator]
        return loss

    losses = []
    for ids in data():
        optimizer.zero_grad()
        losses.append(float(train_step(model, ids).reduce_mean()))
        optimizer.step()
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # collective: the full state

    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for ids in data():
        ref_opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    expected = ref.state_dict()
    missing = sorted(set(expected) ^ set(state))
    gap = max(float((state[k] - v).abs().max()) for k, v in expected.items() if k in state)
    loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    record = {
        "rank": smp.rank(),
        "host": socket.gethostname(),
        "tp_group": smp.get_tp_group(),
        "pp_group": smp.get_pp_group(),
        "state_gap": gap,
        "loss_gap": loss_gap,
        "key_mismatch": missing,
    }
    with open(f"{sys.argv[1]}/rank{record['rank']}.json", "w") as f:
        json.dump(record, f)
    smp.barrier()
    if missing or gap > 1e-5 or loss_gap > 1e-5:
        sys.exit(f"rank {record['rank']}: differs from plain HF GPT-2: {record}")


if __name__ == "__main__":
    main()
