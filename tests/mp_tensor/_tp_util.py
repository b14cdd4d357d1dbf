"""Shared helpers of the tensor-parallelism tests: run a distributed module and its reference side by side.

Every rank builds the reference on the full batch and the distributed module (weights copied from the
reference) on its own samples (or the full batch with ``prescaled_batch``), runs forward and backward
with the same objective ``sum(out * w)``, and compares the output, the input gradients and every
parameter gradient (shards gathered; replicated gradients summed over the group where each rank saw
only its own samples). Returns the largest absolute difference per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mp_tensor import nn as tnn
from mp_tensor import reference as ref
from mp_tensor.context import TPContext
from mp_tensor.nn.base import DistributedModule, param_spec

SMALL = {
    "num_attention_heads": 4,
    "attention_head_size": 4,
    "hidden_size": 16,
    "intermediate_size": 32,
    "attention_dropout_prob": 0.0,
    "hidden_dropout_prob": 0.0,
}
BATCH, SEQ = 2, 5  # local batch per rank, sequence length


@dataclass
class Case:
    kind: str
    optimize: str = "memory"
    prescaled: bool = False
    opts: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.opts.items()))
        return f"{self.kind}[{self.optimize},prescaled={self.prescaled}{',' + extra if extra else ''}]"


def _slice(t: Tensor | None, rank: int, n_local: int, prescaled: bool) -> Tensor | None:
    if t is None or prescaled:
        return t
    return t[rank * n_local : (rank + 1) * n_local]


def _mask(n: int, s: int) -> Tensor:
    m = torch.zeros(n, 1, 1, s)
    m[0, ..., -1] = -1e4  # one masked key position on the first sample
    return m


def build(
    case: Case, ctx: TPContext, n_total: int
) -> tuple[nn.Module, DistributedModule, list[Any], list[int]]:
    """(reference, distributed, full inputs, indices of inputs that need gradients)."""
    k, o = case.kind, case.opts
    gen = torch.Generator().manual_seed(1234)
    h = SMALL["hidden_size"]

    def x(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    if k == "linear":
        r: nn.Module = nn.Linear(16, 12, bias=o.get("bias", True))
        d: DistributedModule = tnn.DistributedLinear(16, 12, bias=o.get("bias", True), tp=ctx)
        return r, d, [x(n_total, 3, 16)], [0]
    if k == "embedding":
        pad = o.get("padding_idx")
        r = nn.Embedding(20, 8, padding_idx=pad)
        vocab = o.get("vocab_parallel", False)
        d = tnn.DistributedEmbedding(20, 8, padding_idx=pad, vocab_parallel=vocab, tp=ctx)
        ids = torch.randint(0, 20, (n_total, SEQ), generator=gen)
        ids[0, 0] = 3
        return r, d, [ids], []
    if k == "layernorm":
        return (
            nn.LayerNorm(h, eps=1e-5),
            tnn.DistributedLayerNorm(h, tp=ctx),
            [x(n_total, SEQ, h) * 3 + 1],
            [0],
        )
    kw = {**SMALL, **o}
    if k == "attention":
        kw.pop("intermediate_size")
        r = ref.AttentionLayer(**kw)
        d = tnn.DistributedAttentionLayer(tp=ctx, **kw)
        if kw.get("cross_attention"):
            return r, d, [x(n_total, SEQ, h), x(n_total, SEQ + 2, h), _mask(n_total, SEQ + 2)], [0, 1]
        return r, d, [x(n_total, SEQ, h), _mask(n_total, SEQ)], [0]
    if k == "output":
        for key in ("num_attention_heads", "attention_head_size", "attention_dropout_prob"):
            kw.pop(key)
        return (
            ref.TransformerOutputLayer(**kw),
            tnn.DistributedTransformerOutputLayer(tp=ctx, **kw),
            [x(n_total, SEQ, h)],
            [0],
        )
    if k in ("layer", "transformer"):
        r = ref.TransformerLayer(**kw) if k == "layer" else ref.Transformer(**kw)
        d = (
            tnn.DistributedTransformerLayer(tp=ctx, **kw)
            if k == "layer"
            else tnn.DistributedTransformer(tp=ctx, **kw)
        )
        if kw.get("add_cross_attention"):
            inputs = [
                x(n_total, SEQ, h),
                x(n_total, SEQ + 1, h),
                _mask(n_total, SEQ),
                _mask(n_total, SEQ + 1),
            ]
            return r, d, inputs, [0, 1]
        return r, d, [x(n_total, SEQ, h), _mask(n_total, SEQ)], [0]
    if k == "lmhead":
        kw.update(vocab_size=24, num_positions=8)
        r = ref.TransformerLMHead(**kw)
        d = tnn.DistributedTransformerLMHead(tp=ctx, **kw)
        ids = torch.randint(0, 24, (n_total, SEQ), generator=gen)
        amask = torch.zeros(n_total, SEQ, dtype=torch.long)
        amask[0, -1] = 1
        tt = torch.randint(0, 2, (n_total, SEQ), generator=gen) if kw.get("num_token_types", 0) else None
        if kw.get("add_cross_attention"):
            return r, d, [ids, amask, tt, None, x(n_total, SEQ + 1, h), None, None], [4]
        return r, d, [ids, amask, tt, None, None], []
    raise ValueError(k)


def _call(module: nn.Module, kind: str, inputs: list[Any]) -> Tensor:
    if kind in ("linear", "embedding", "layernorm", "output"):
        return module(inputs[0])  # type: ignore[no-any-return]
    out = module(tuple(inputs))
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def _full_grad(p: nn.Parameter, group: dist.ProcessGroup, n: int, prescaled: bool) -> Tensor:
    assert p.grad is not None
    spec = param_spec(p)
    g = p.grad.detach().clone()
    if spec is not None and spec.split_dim is not None:
        parts = [torch.empty_like(g) for _ in range(n)]
        dist.all_gather(parts, g.contiguous(), group=group)
        return torch.cat(parts, dim=spec.split_dim)
    if (spec is not None and spec.scaled_batch) or prescaled:
        return g
    dist.all_reduce(g, group=group)
    return g


def run_case(case: Case, group: dist.ProcessGroup) -> dict[str, float]:
    """Max abs differences between the distributed module and its reference, per compared tensor."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    ctx = TPContext(group=group, optimize=case.optimize, prescaled_batch=case.prescaled)  # type: ignore[arg-type]
    n_total = BATCH if case.prescaled else BATCH * n
    torch.manual_seed(0)
    r, d, full, grad_idx = build(case, ctx, n_total)
    d.load_full_state_dict(r.state_dict())
    r.train()
    d.train()

    def prepare(values: list[Any], local: bool) -> list[Any]:
        out = []
        for i, value in enumerate(values):
            v = value
            if isinstance(v, Tensor):
                v = v.clone()
                if local:
                    v = _slice(v, rank, BATCH, case.prescaled)
                if i in grad_idx:
                    v.requires_grad_(True)
            out.append(v)
        return out

    ref_in, dist_in = prepare(full, False), prepare(full, True)
    ref_out = _call(r, case.kind, ref_in)
    w = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(99))
    (ref_out * w).sum().backward()
    dist_out = _call(d, case.kind, dist_in)
    w_local = _slice(w, rank, BATCH, case.prescaled)
    assert w_local is not None
    (dist_out * w_local).sum().backward()

    diffs: dict[str, float] = {}
    ref_local = _slice(ref_out, rank, BATCH, case.prescaled)
    assert ref_local is not None
    if dist_out.shape != ref_local.shape:
        raise AssertionError(f"{case.name}: output shape {tuple(dist_out.shape)} != {tuple(ref_local.shape)}")
    diffs["output"] = (dist_out - ref_local).abs().max().item()
    for i in grad_idx:
        expected = _slice(ref_in[i].grad, rank, BATCH, case.prescaled)
        assert expected is not None and dist_in[i].grad is not None
        diffs[f"input{i}.grad"] = (dist_in[i].grad - expected).abs().max().item()
    ref_params = dict(r.named_parameters())
    for name, p in d.named_parameters():
        rp = ref_params[name]
        if rp.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        got = _full_grad(p, group, n, case.prescaled)
        if got.shape != rp.grad.shape:
            raise AssertionError(
                f"{case.name}: grad of {name} has shape {tuple(got.shape)} != {tuple(rp.grad.shape)}"
            )
        diffs[f"{name}.grad"] = (got - rp.grad).abs().max().item()
    return diffs


def with_group(fn: Callable[[dist.ProcessGroup], Any]) -> Any:
    """Run ``fn`` with a fresh group of all ranks, destroyed afterwards."""
    group = dist.new_group(list(range(dist.get_world_size())))
    try:
        return fn(group)
    finally:
        dist.destroy_process_group(group)


def run_cases(world: Any, cases: list[Case]) -> dict[str, dict[str, float]]:
    """Worker entry: every case on this rank; {case name: {tensor: max abs diff}}."""
    return with_group(lambda g: {c.name: run_case(c, g) for c in cases})


def worst(results: list[dict[str, dict[str, float]]], tol: float) -> list[str]:
    """The first failing tensor of each case, over all ranks (empty when everything is within ``tol``)."""
    bad = []
    for rank, per_case in enumerate(results):
        for case, diffs in per_case.items():
            for tensor, diff in diffs.items():
                if not diff <= tol:
                    bad.append(f"rank {rank} {case}: {tensor} differs by {diff:.3g}")
                    break
    return bad
