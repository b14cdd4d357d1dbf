"""The cost model of benchmarks/tensor_ncf.py: each term of an NCF step timed on its own, per rank.

Seed 001 §5.1 and §7.3: with the same batch on every tp_rank (Megatron-style) everything outside the
distributed tables runs T times over; TP across DP runs it once and pays an index all-gather and an
all-to-all instead of an all-gather. Per rank, with B samples per rank in TP across DP and T*B in the
baseline (same global batch):

    step(TP across DP) = E + M(B)   + C_tp      (ids all-gather x2, all-to-all x4 forward and x4 backward)
    step(same batch)   = E + M(T*B) + C_same    (all-gather x4 forward; its backward is a slice)

E is what both modes do alike: the lookup of T*B indices in D/T-wide shards, its backward (a dense
full-shard gradient unless ``sparse=True``), the optimizer over the shards and the MLP, and the
gradient all-reduce of the data-parallel MLP. M(n) is the MLP, GMF product and loss, forward and
backward, on n samples. The best ratio (no communication) is (E + M(T*B)) / (E + M(B)) <= T.

Compute terms run on both ranks at once (as in a step, the two ranks share the host); communication
terms use the TP group smp.init made (its MPI twin on CPU), with the step's shapes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_comm import collectives as col


def timed(fn: Callable[[], object], reps: int, group: dist.ProcessGroup) -> float:
    """Median seconds of ``fn`` over ``reps`` runs started together on every rank; the slowest rank's."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def measure(
    make_model: Callable[[], nn.Module],
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    dims: dict[str, int],
    *,
    sparse: bool,
    group: dist.ProcessGroup,
    reps: int,
) -> dict[str, float]:
    """Seconds per step of every term of the cost model, on this host now (collective over ``group``)."""
    tp = dist.get_world_size(group)
    users, items, d_mlp, d_gmf = dims["users"], dims["items"], dims["mlp_dim"], dims["gmf_dim"]
    batch = dims["global_batch"] // tp  # per rank in TP across DP
    gen = torch.Generator().manual_seed(7)
    model = make_model()
    t: dict[str, float] = {}

    # M(n): everything after the lookups, on n samples (the plain model's MLP, GMF product and loss)
    def mlp_term(n: int) -> Callable[[], None]:
        xm = torch.randn(n, 2 * d_mlp, generator=gen, requires_grad=True)
        ug, ig = (torch.randn(n, d_gmf, generator=gen, requires_grad=True) for _ in range(2))
        y = torch.randint(0, 2, (n,), generator=gen).float()
        mlp, out = model.mlp, model.out

        def run() -> None:
            logits = out(torch.cat((mlp(xm), ug * ig), -1)).squeeze(-1)
            F.binary_cross_entropy_with_logits(logits, y).backward()  # type: ignore[no-untyped-call]

        return run

    # the two sizes alternate, so that the host's load (which drifts) weighs on both alike
    small, large = mlp_term(batch), mlp_term(tp * batch)
    pairs = [(timed(small, 1, group), timed(large, 1, group)) for _ in range(reps)]
    t["M(B)"] = statistics.median(a for a, _ in pairs)
    t["M(TB)"] = statistics.median(b for _, b in pairs)

    # E: the lookups of T*B ids in D/T-wide shards, their backward, the optimizers
    shards = [
        nn.Embedding(rows, width // tp, sparse=sparse)
        for rows, width in ((users, d_mlp), (items, d_mlp), (users, d_gmf), (items, d_gmf))
    ]
    u = torch.randint(0, users, (tp * batch,), generator=gen)
    i = torch.randint(0, items, (tp * batch,), generator=gen)

    def lookups() -> None:
        outs = [shards[0](u), shards[1](i), shards[2](u), shards[3](i)]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    def lookup_fwd() -> None:
        with torch.no_grad():
            for table, ids in zip(shards, (u, i, u, i), strict=True):
                table(ids)

    t["lookup fwd"] = timed(lookup_fwd, reps, group)

    def lookup_fwd_bwd() -> None:
        for s in shards:
            s.zero_grad(set_to_none=True)
        lookups()

    t["lookup fwd+bwd"] = timed(lookup_fwd_bwd, reps, group)
    table_opt = make_opt([s.weight for s in shards])
    t["optimizer: shards"] = timed(table_opt.step, reps, group)
    dense = [p for n, p in model.named_parameters() if not n.startswith(("user_", "item_"))]
    for p in dense:
        p.grad = torch.randn_like(p)
    t["optimizer: MLP"] = timed(make_opt(dense).step, reps, group)
    flat = torch.cat([p.detach().reshape(-1) for p in dense])
    t["all-reduce MLP grads"] = timed(lambda: col.all_reduce_(flat.clone(), group), reps, group)

    # C: the collectives, with the step's shapes, as DistributedEmbedding issues them (dim-0 blocks, the
    # channels merged locally), and as before on MPI's strided datatypes along the channels
    ids = torch.randint(0, users, (batch,), generator=gen)
    local = [torch.randn(tp * batch, w // tp, generator=gen) for w in (d_mlp, d_mlp, d_gmf, d_gmf)]
    grads = [torch.randn(batch, w, generator=gen) for w in (d_mlp, d_mlp, d_gmf, d_gmf)]

    def merge(parts: torch.Tensor) -> torch.Tensor:
        return parts.unflatten(0, (tp, parts.shape[0] // tp)).movedim(0, -2).flatten(-2)

    def unmerge(g: torch.Tensor) -> torch.Tensor:
        return g.unflatten(-1, (tp, g.shape[-1] // tp)).movedim(-2, 0).flatten(0, 1).contiguous()

    t["ids all-gather x2"] = timed(lambda: [col.all_gather(ids, 0, group) for _ in range(2)], reps, group)
    # each exchange and its strided form (before) alternate, so that the load weighs on both alike
    exchanges = {
        "all-to-all fwd x4": (
            lambda: [merge(col.all_to_all(x, 0, 0, group)) for x in local],
            lambda: [col.all_to_all(x, 0, -1, group) for x in local],
        ),
        "all-to-all bwd x4": (
            lambda: [col.all_to_all(unmerge(g), 0, 0, group) for g in grads],
            lambda: [col.all_to_all(g, -1, 0, group) for g in grads],
        ),
        "all-gather fwd x4": (
            lambda: [merge(col.all_gather(x, 0, group)) for x in local],
            lambda: [col.all_gather(x, -1, group) for x in local],
        ),
    }
    for name, (now, strided) in exchanges.items():
        pairs = [(timed(now, 1, group), timed(strided, 1, group)) for _ in range(reps)]
        t[name] = statistics.median(a for a, _ in pairs)
        t[f"before: {name}, strided"] = statistics.median(b for _, b in pairs)
    return t


def analytic(dims: dict[str, int], tp: int, sparse: bool) -> dict[str, dict[str, float]]:
    """Per rank and step: MLP FLOPs, embedding rows looked up, bytes sent by the collectives, and the
    gradient and optimizer bytes of the dense shards (fp32, int64 indices)."""
    batch = dims["global_batch"] // tp
    d_sum = 2 * dims["mlp_dim"] + 2 * dims["gmf_dim"]
    per_sample = 2 * (2 * dims["mlp_dim"] * 256 + 256 * 128 + 128 * 64 + (64 + dims["gmf_dim"]))
    shard_floats = (dims["users"] + dims["items"]) * (dims["mlp_dim"] + dims["gmf_dim"]) // tp
    if sparse:  # only the looked-up rows: T*B per table
        shard_floats = 2 * tp * batch * (dims["mlp_dim"] + dims["gmf_dim"]) // tp
    out = (tp - 1) / tp * batch * d_sum * 4  # an all-to-all sends all but its own block
    return {
        "MLP MFLOP (forward + backward = 3x forward)": {
            "tp-across-dp": 3 * per_sample * batch / 1e6,
            "same-batch": 3 * per_sample * tp * batch / 1e6,
        },
        "embedding rows looked up (x D/T floats)": {
            "tp-across-dp": 4 * tp * batch,
            "same-batch": 4 * tp * batch,
        },
        "KB sent: index all-gathers": {"tp-across-dp": 2 * batch * 8 / 1e3, "same-batch": 0},
        "KB sent: output exchange forward": {
            "tp-across-dp": out / 1e3,
            "same-batch": tp * batch * d_sum / tp * 4 / 1e3,
        },
        "KB sent: output exchange backward": {"tp-across-dp": out / 1e3, "same-batch": 0},
        "collectives on the TP group": {"tp-across-dp": 2 + 4 + 4, "same-batch": 4},
        "MB of embedding gradients written": {
            "tp-across-dp": shard_floats * 4 / 1e6,
            "same-batch": shard_floats * 4 / 1e6,
        },
    }


def predict(t: dict[str, float]) -> dict[str, Any]:
    """Predicted seconds per step of each mode, the common term E and the ratios."""
    common = t["lookup fwd+bwd"] + t["optimizer: shards"] + t["optimizer: MLP"] + t["all-reduce MLP grads"]
    comm_tp = t["ids all-gather x2"] + t["all-to-all fwd x4"] + t["all-to-all bwd x4"]
    comm_same = t["all-gather fwd x4"]
    tp_step = common + t["M(B)"] + comm_tp
    same_step = common + t["M(TB)"] + comm_same
    return {
        "E (common)": common,
        "C_tp": comm_tp,
        "C_same": comm_same,
        "step tp-across-dp": tp_step,
        "step same-batch": same_step,
        "ratio predicted": same_step / tp_step,
        "ratio bound (no communication)": (common + t["M(TB)"]) / (common + t["M(B)"]),
        "ratio bound (E = 0, no communication)": t["M(TB)"] / t["M(B)"],
    }
