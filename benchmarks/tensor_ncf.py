"""Seed 001 §7.3 on CPU: NCF with large embedding tables, tensor parallelism across data-parallel ranks
versus feeding the same batch to every tp_rank (Megatron-style), at the same global batch size.

Only the four embedding tables are distributed (DistributedEmbedding, tp=2); the MLP is data-parallel.
"tp-across-dp": each rank has its own batch of b samples (global 2b). "same-batch": both ranks get the
same 2b samples (prescaled_batch; global 2b). Runs interleave the two; samples/s = global batch / step.

Run: mpiexec -n 2 python benchmarks/tensor_ncf.py   (writes benchmarks/results/tensor_ncf.{json,md})
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_tensor.context import TPContext
from mp_tensor.grads import reduce_gradients
from mp_tensor.nn import DistributedEmbedding

USERS, ITEMS, MLP_DIM, GMF_DIM = 50_000, 2_000, 128, 32
GLOBAL_BATCH, STEPS, WARMUP, ROUNDS = 4096, 6, 2, 3


class NCF(nn.Module):
    def __init__(self, ctx: TPContext) -> None:
        super().__init__()
        self.user_mlp = DistributedEmbedding(USERS, MLP_DIM, tp=ctx)
        self.item_mlp = DistributedEmbedding(ITEMS, MLP_DIM, tp=ctx)
        self.user_gmf = DistributedEmbedding(USERS, GMF_DIM, tp=ctx)
        self.item_gmf = DistributedEmbedding(ITEMS, GMF_DIM, tp=ctx)
        self.mlp = nn.Sequential(
            nn.Linear(2 * MLP_DIM, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64)
        )
        self.out = nn.Linear(64 + GMF_DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp(torch.cat((self.user_mlp(users), self.item_mlp(items)), -1))
        gmf = self.user_gmf(users) * self.item_gmf(items)
        return self.out(torch.cat((mlp, gmf), -1)).squeeze(-1)  # type: ignore[no-any-return]


def run(mode: str, group: dist.ProcessGroup) -> float:
    rank = dist.get_rank()
    prescaled = mode == "same-batch"
    ctx = TPContext(group=group, prescaled_batch=prescaled)
    torch.manual_seed(0)
    model = NCF(ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    local = GLOBAL_BATCH if prescaled else GLOBAL_BATCH // 2
    gen = torch.Generator().manual_seed(100 + (0 if prescaled else rank))
    times = []
    for step in range(WARMUP + STEPS):
        users = torch.randint(0, USERS, (local,), generator=gen)
        items = torch.randint(0, ITEMS, (local,), generator=gen)
        labels = torch.randint(0, 2, (local,), generator=gen).float()
        dist.barrier(group)
        start = time.perf_counter()
        loss: torch.Tensor = F.binary_cross_entropy_with_logits(model(users, items), labels)
        opt.zero_grad(set_to_none=False)
        loss.backward()  # type: ignore[no-untyped-call]
        reduce_gradients(
            model.parameters(), dp_group=group, rdp_group=None, tp_size=2, prescaled_batch=prescaled
        )
        opt.step()
        dist.barrier(group)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    return GLOBAL_BATCH / statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method="tcp://127.0.0.1:29571",
        rank=int(os.environ["PMI_RANK"]),
        world_size=int(os.environ["PMI_SIZE"]),
    )
    group = dist.new_group([0, 1])
    rates: dict[str, list[float]] = {"tp-across-dp": [], "same-batch": []}
    for _ in range(ROUNDS):
        for mode, values in rates.items():
            values.append(run(mode, group))
    if dist.get_rank() == 0:
        med = {m: statistics.median(v) for m, v in rates.items()}
        result = {
            "config": {
                "users": USERS, "items": ITEMS, "mlp_dim": MLP_DIM, "gmf_dim": GMF_DIM,
                "global_batch": GLOBAL_BATCH, "tp": 2, "ranks": 2, "backend": "gloo", "threads_per_rank": 1,
            },
            "samples_per_s": rates,
            "median_samples_per_s": med,
            "ratio_tp_across_dp_over_same_batch": med["tp-across-dp"] / med["same-batch"],
        }  # fmt: skip
        out = Path(__file__).parent / "results"
        out.mkdir(exist_ok=True)
        (out / "tensor_ncf.json").write_text(json.dumps(result, indent=2) + "\n")
        lines = [
            "# NCF, embeddings distributed over tp=2 (seed 001 §7.3 on CPU)",
            "",
            f"{USERS} users, {ITEMS} items, MLP dim {MLP_DIM}, GMF dim {GMF_DIM}, "
            f"global batch {GLOBAL_BATCH}, 2 ranks (gloo, 1 thread each), median of interleaved rounds.",
            "",
            "| mode | per-rank batch | samples/s |",
            "|---|---|---|",
            f"| TP across DP ranks | {GLOBAL_BATCH // 2} | {med['tp-across-dp']:.0f} |",
            f"| same batch on both tp_ranks | {GLOBAL_BATCH} | {med['same-batch']:.0f} |",
            "",
            f"ratio: {result['ratio_tp_across_dp_over_same_batch']:.2f}x",
        ]
        (out / "tensor_ncf.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
